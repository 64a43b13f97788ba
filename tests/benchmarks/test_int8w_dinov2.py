"""``benchmarks/int8w_dinov2.py``'s pieces on a tiny DINOv2 replica (float64, LayerNorm γ/β and LayerScale λ
randomised): the ``writer-ops`` variant and the compat hybrids compute the original's function, and the
simulated per-row int8 grids round each row on its own. No real checkpoint, no engine, no network."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

tf = pytest.importorskip("transformers")

import int8w_dinov2 as bench  # noqa: E402

import normswap  # noqa: E402


def _tiny_dino() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = tf.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, patch_size=7,
                          image_size=28, layer_norm_eps=1e-6)
    model = tf.Dinov2Model(cfg).eval().double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lambda1"):  # LayerScale over three decades, as DINOv2's
                p.copy_(10 ** (torch.rand(p.shape, generator=gen, dtype=p.dtype) * 3 - 2))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen, dtype=p.dtype))
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return model


def _tokens(model: torch.nn.Module, px: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(pixel_values=px).last_hidden_state


def test_writer_ops_is_exact_and_keeps_the_original_writers() -> None:
    """The original's writer rows behind a centering op: the same outputs as the original in float64, and every
    writer weight bit-identical to the original's (what a per-row quantizer then rounds); the native conversion
    it starts from has other rows (so the check is not vacuous)."""
    model = _tiny_dino()
    px = torch.randn(3, 3, 28, 28, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ops = bench.writer_ops(model)
        native = copy.deepcopy(model)
        normswap.patch(native, beta_placement="keep")
    torch.testing.assert_close(_tokens(ops, px), _tokens(model, px), rtol=1e-9, atol=1e-9)
    for mine, theirs, conv in zip(ops.encoder.layer, model.encoder.layer, native.encoder.layer, strict=True):
        assert torch.equal(mine.attention.o_proj.weight, theirs.attention.o_proj.weight)
        assert torch.equal(mine.mlp.fc2.weight, theirs.mlp.fc2.weight)
        assert not torch.equal(conv.mlp.fc2.weight, theirs.mlp.fc2.weight)


def test_balanced_writer_ops_are_the_product_auto_and_exact() -> None:
    """``writer-ops-bal`` (by hand: the original's rows behind ops, λ folded and balanced back out) is the model
    ``writer_centering="auto"`` writes on a DINOv2 (an op after every LayerScale writer): the same function as the
    original, the same writer tensors as the product's to float rounding; ``orig-bal`` and ``wauto-widen`` exact too."""
    model = _tiny_dino()
    px = torch.randn(3, 3, 28, 28, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bal = bench.writer_ops(model, balance=True)
        widen = bench.writer_ops(model, balance=True, widening_above=2.0)
        auto = copy.deepcopy(model)
        normswap.patch(auto, beta_placement="keep", writer_centering="auto")
        orig_bal = copy.deepcopy(model)
        for layer in orig_bal.encoder.layer:
            bench.balanced_rows(layer.attention.o_proj, layer.layer_scale1)
            bench.balanced_rows(layer.mlp.fc2, layer.layer_scale2)
    ref = _tokens(model, px)
    for variant in (bal, widen, auto, orig_bal):
        torch.testing.assert_close(_tokens(variant, px), ref, rtol=1e-9, atol=1e-9)
    for mine, theirs in zip(bal.encoder.layer, auto.encoder.layer, strict=True):
        for path in ("attention.o_proj.weight", "mlp.fc2.weight", "layer_scale1.lambda1", "layer_scale2.lambda1"):
            torch.testing.assert_close(mine.get_parameter(path), theirs.get_parameter(path), rtol=1e-12, atol=0)
    w = bal.encoder.layer[0].mlp.fc2.weight.detach().abs().amax(1)  # rows balanced: equal maxima within 8/9
    assert float(w.min() / w.max()) > 8 / 9 - 1e-12


def test_hybrid_takes_one_group_and_stays_exact(tmp_path: Path) -> None:
    """A hybrid carries compat's tensors of its group only and computes the original's function."""
    model = _tiny_dino()
    px = torch.randn(2, 3, 28, 28, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = copy.deepcopy(model)
        normswap.patch(conv, beta_placement="keep")
        normswap.save(conv, tmp_path / "compat", format="compat")
        compat = tf.Dinov2Model.from_pretrained(tmp_path / "compat", torch_dtype=torch.float64).eval()
    hyb = bench.hybrid(model, compat, bench.HYBRIDS["attn"])
    torch.testing.assert_close(_tokens(hyb, px), _tokens(model, px), rtol=1e-9, atol=1e-9)
    for mine, theirs, src in zip(hyb.encoder.layer, model.encoder.layer, compat.encoder.layer, strict=True):
        assert torch.equal(mine.attention.o_proj.weight, src.attention.o_proj.weight)
        assert not torch.equal(mine.attention.o_proj.weight, theirs.attention.o_proj.weight)
        assert torch.equal(mine.mlp.fc2.weight, theirs.mlp.fc2.weight)


@pytest.mark.parametrize("symmetric", [False, True], ids=["nncf-asym", "llm-int8-sym"])
def test_fake_rows_rounds_each_row_on_its_own_grid(symmetric: bool) -> None:
    """Per row: at most half a step off, at most 256 (asymmetric) / 255 (symmetric) levels, and a row scaled by a
    power of two rounds to the same values scaled (the grid follows the row, as a per-row scale does)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 50, generator=gen, dtype=torch.float64) * torch.logspace(-3, 1, 6, dtype=torch.float64)[:, None]
    q = bench.fake_rows(w, symmetric)
    span = w.abs().amax(1) * 2 / 254 if symmetric else (w.amax(1) - w.amin(1)) / 255
    assert ((q - w).abs() <= span[:, None] / 2 + 1e-12).all()
    for row in q:
        assert row.unique().numel() <= 256
    scaled = w.clone()
    scaled[2] *= 8
    torch.testing.assert_close(bench.fake_rows(scaled, symmetric)[2], q[2] * 8)
    half = bench.fake_rows(w.float(), False, half=True)
    assert half.dtype == torch.float32 and not torch.equal(half, bench.fake_rows(w.float(), False))


def test_null_draw_is_the_original_function_with_the_same_row_integers() -> None:
    """A null draw rescales each writer row and divides λ by the same factor: the same function, and on a
    symmetric per-row grid the same integers (the row's scale moves with it), so only float noise differs; the
    rows themselves do change (not vacuous)."""
    model = _tiny_dino()
    px = torch.randn(2, 3, 28, 28, dtype=torch.float64)
    null = bench.null_draw(model, 3)
    torch.testing.assert_close(_tokens(null, px), _tokens(model, px), rtol=1e-9, atol=1e-9)
    for mine, theirs in zip(null.encoder.layer, model.encoder.layer, strict=True):
        a, b = mine.mlp.fc2.weight.detach(), theirs.mlp.fc2.weight.detach()
        assert not torch.equal(a, b)
        step_a = a.abs().amax(1, keepdim=True) / 127
        step_b = b.abs().amax(1, keepdim=True) / 127
        assert torch.equal(torch.round(a / step_a), torch.round(b / step_b))


def test_per_token_grid_rounds_each_token_on_its_own_scale() -> None:
    x = torch.tensor([[1.0, -0.5, 0.25], [100.0, 3.0, -40.0]], dtype=torch.float64)
    q = bench.per_token_int8(x)
    assert torch.equal(q[:, 0], x[:, 0])  # each token's absmax is on its grid
    assert float((q - x).abs()[0].max()) <= 0.5 / 127 + 1e-12 and float((q - x).abs()[1].max()) <= 50 / 127 + 1e-12


@pytest.mark.parametrize(("norms", "readers"), [("all", False), ("last", False), ("none", True), ("last", True)])
def test_leak_variants_are_exact_and_keep_the_default_writers(norms: str, readers: bool) -> None:
    """Round 54's diagnostics (``native-normc`` / ``-lastc`` / ``-cread`` / ``-cread-lastc``): the default
    conversion with mean subtractions before its norms or readers blind to the stream's mean computes the
    original's function in float64, keeps the default's writer rows bit for bit (the rows NNCF rounds), and
    changes the readers exactly when asked to."""
    model = _tiny_dino()
    px = torch.randn(3, 3, 28, 28, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        variant = bench.leak_variant(model, norms, readers)
        native = copy.deepcopy(model)
        normswap.patch(native, beta_placement="keep")
    torch.testing.assert_close(_tokens(variant, px), _tokens(model, px), rtol=1e-9, atol=1e-9)
    for mine, conv in zip(variant.encoder.layer, native.encoder.layer, strict=True):
        assert torch.equal(mine.attention.o_proj.weight, conv.attention.o_proj.weight)
        assert torch.equal(mine.mlp.fc2.weight, conv.mlp.fc2.weight)
        assert torch.equal(mine.mlp.fc1.weight, conv.mlp.fc1.weight) != readers
    if readers:  # blind to a mean: the reader's γ-weighted rows sum to zero
        layer = variant.encoder.layer[0]
        torch.testing.assert_close(layer.mlp.fc1.weight @ layer.norm2.weight,
                                   torch.zeros(layer.mlp.fc1.out_features, dtype=torch.float64), rtol=0, atol=1e-12)


def test_openvino_groups_split_dinov2s_weights_once() -> None:
    """Each weight node of DINOv2's OpenVINO graph (its friendly names, as ``openvino.convert_model`` gives them
    for the ONNX export) falls in exactly one of the split's groups, and the writers/readers groups are their
    unions: the per-group NNCF runs compress every weight once between them."""
    import re

    from bench_quant_engines import OPENVINO, OPENVINO_GROUPS

    names = ["/model/embeddings/patch_embeddings/projection/Conv/WithoutBiases"] + [
        f"/model/encoder/layer.{i}/{p}/MatMul" for i in range(12)
        for p in ("attention/q_proj", "attention/k_proj", "attention/v_proj", "attention/o_proj", "mlp/fc1",
                  "mlp/fc2")]
    split = ("qkv", "o", "fc1", "fc2", "conv")
    for name in names:
        hits = [g for g in split if re.fullmatch(OPENVINO_GROUPS[g], name)]
        assert len(hits) == 1, (name, hits)
        assert bool(re.fullmatch(OPENVINO_GROUPS["writers"], name)) == (hits[0] in ("o", "fc2"))
        assert bool(re.fullmatch(OPENVINO_GROUPS["readers"], name)) == (hits[0] in ("qkv", "fc1"))
    assert {f"ov-w8-{g}" for g in split} <= set(OPENVINO) and set(bench.OV_GROUPS) <= set(OPENVINO)
