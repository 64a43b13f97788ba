"""Stem centering: a stream started by a weight quantizers round is centered by one op, not by that weight.

What could be silently wrong: a conversion that is no longer exact (at the traced size or another one), a
start writer whose weights are still edited (then a quantizer rounds other weights than the original's, the
whole point lost), more than one op per stream start, an op that a native checkpoint or the low-memory path
loses, a compat checkpoint that is not the stock architecture, a verdict that hides the op, an option value
that is silently accepted, and a stream whose op would be a second one in a chain (CLIP's pre-LayerNorm)
losing its norms' exactness instead of falling back to the weights.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as tf
from click.testing import CliRunner
from torch import nn

import normswap
from normswap.analysis.plan import plan_of
from normswap.cli import main
from normswap.errors import NormswapError
from tests import zoo
from tests.analysis.test_constant_trades import _randomise_embeddings

TOL = 1e-9


class _SeriesEncoder(nn.Module):
    """A time-series / audio-feature encoder: a Linear input projection of raw features, a learned
    position table, Pre-LN blocks and a final norm (the shape of PatchTST, an audio frame encoder...)."""

    def __init__(self, features: int = 6, width: int = 32, length: int = 12, layers: int = 2) -> None:
        super().__init__()
        self.proj = nn.Linear(features, width)
        self.pos = nn.Parameter(torch.randn(length, width))
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.norm(h)


def _series() -> nn.Module:
    torch.manual_seed(0)
    return zoo.randomise(_SeriesEncoder())


def _hf(name: str) -> nn.Module:
    factory = {**zoo.EXACT, **{k: v[0] for k, v in zoo.MORE.items()}}[name]
    torch.manual_seed(0)
    cls, config = factory()
    return _randomise_embeddings(zoo.randomise(cls(config)), 0)


# name -> (builder, the start writer's module, an input builder taking a size or None for the traced one)
def _pixels(model: nn.Module, size: int | None, interpolate: bool) -> dict:
    g = torch.Generator().manual_seed(3)
    side = size or model.config.image_size
    kw = {"pixel_values": torch.randn(2, 3, side, side, generator=g, dtype=torch.float64)}
    if interpolate and size:
        kw["interpolate_pos_encoding"] = True
    return kw


def _audio(model: nn.Module, size: int | None) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"input_values": torch.randn(2, size or 4000, generator=g, dtype=torch.float64)}


def _series_input(model: nn.Module, size: int | None) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(2, size or 12, 6, generator=g, dtype=torch.float64)}


MODELS = {
    "vit": (lambda: _hf("vit"), "vit.embeddings.patch_embeddings.projection",
            lambda m, s: _pixels(m, s, True)),
    "deit": (lambda: _hf("deit"), "deit.embeddings.patch_embeddings.projection",
             lambda m, s: _pixels(m, s, True)),
    "dinov2": (lambda: _hf("dinov2"), "dinov2.embeddings.patch_embeddings.projection",
               lambda m, s: _pixels(m, s, False)),
    "series": (_series, "proj", _series_input),
}
OTHER_SIZE = {"vit": 48, "deit": 48, "dinov2": 48, "series": 7}


def _patched(model: nn.Module, **options) -> nn.Module:
    conv = copy.deepcopy(model)
    if isinstance(model, _SeriesEncoder):
        options.setdefault("example_inputs", _series_input(model, None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(conv, **options)
    return conv


def _run(model: nn.Module, kw: dict) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(**kw)
    if isinstance(out, torch.Tensor):
        return [out]
    return [v for v in out.values() if isinstance(v, torch.Tensor)]


def _assert_close(ref: list[torch.Tensor], out: list[torch.Tensor], what: object) -> None:
    assert len(ref) == len(out), what
    for r, o in zip(ref, out, strict=True):
        assert float((o - r).abs().max()) <= TOL * max(1.0, float(r.abs().max())), what


@pytest.fixture(scope="module")
def pairs() -> dict[str, tuple[nn.Module, nn.Module]]:
    return {}


def _pair(cache: dict, name: str) -> tuple[nn.Module, nn.Module]:
    if name not in cache:
        model = MODELS[name][0]()
        cache[name] = (model, _patched(model))
    return cache[name]


@pytest.mark.parametrize("name", list(MODELS))
def test_one_op_keeps_the_start_writer_bitwise_and_the_conversion_exact_at_two_sizes(pairs, name):
    model, conv = _pair(pairs, name)
    _, writer, inputs = MODELS[name]
    plan = plan_of(conv)
    assert len(plan.hooks) == 1, plan.summary()  # one op for the one stream start
    hook = plan.hooks[0]
    assert not hook.per_norm and "stem_centering='op'" in hook.reason and writer in hook.reason
    assert {s.verdict for s in plan.sites} == {"exact-with-centering"}, plan.table()  # the op counted
    assert plan.options["stem_centering"] == "op"
    # the start writer, and every writer behind the op (class token, position table), as the original's
    before, after = dict(model.named_parameters()), dict(conv.named_parameters())
    start = [k for k in before if k.startswith(writer + ".")]
    assert start
    behind = [k for k in before if any(t in k for t in ("cls_token", "position_embeddings", "distillation_token"))
              or k == "pos"]
    for k in start + behind:
        assert torch.equal(before[k], after[k]), k
    assert not any(e.owner == writer or e.target in behind for e in plan.writer_edits)
    for size in (None, OTHER_SIZE[name]):
        kw = inputs(model, size)
        # transformers' DINOv2 resamples its position table in float32 (whatever the model's dtype): both
        # models carry that rounding, the same behind the op as without it
        tol = 1e-6 if size and name == "dinov2" else TOL
        ref, out = _run(model, kw), _run(conv, kw)
        assert len(ref) == len(out)
        for r, o in zip(ref, out, strict=True):
            assert float((o - r).abs().max()) <= tol * max(1.0, float(r.abs().max())), (name, size)


@pytest.mark.parametrize("name", ["vit", "series"])
def test_weights_centers_the_start_writer_as_before_with_no_op(pairs, name):
    model, _ = _pair(pairs, name)
    _, writer, inputs = MODELS[name]
    conv = _patched(model, stem_centering="weights")
    plan = plan_of(conv)
    assert plan.hooks == [] and {s.verdict for s in plan.sites} == {"exact"}, plan.table()
    assert plan.options["stem_centering"] == "weights"
    w = conv.get_submodule(writer).weight.detach()
    assert not torch.equal(w, model.get_submodule(writer).weight)
    axis = 0  # Linear and Conv2d: output features first
    assert float(w.sum(axis).abs().max()) <= 1e-9 * float(w.abs().max())  # centered over the output features
    kw = inputs(model, None)
    _assert_close(_run(model, kw), _run(conv, kw), name)


def test_an_embedding_table_start_keeps_its_weight_edits():
    """A gather is no weight a quantizer rounds: GPT-2's token and position tables are centered as before."""
    model = zoo.build(zoo.EXACT, "gpt2")
    plan = normswap.plan(model, untie=True)  # the tie kept (the default) centers wte by an op instead
    assert plan.hooks == [] and {s.verdict for s in plan.sites} == {"exact"}
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= {e.target for e in plan.writer_edits}


def test_clip_pre_layernorm_stream_falls_back_to_weights_rather_than_a_chain_of_ops():
    """CLIP's patch convolution writes the input of pre_layrnorm, whose output starts the stream the blocks
    read and takes that stream's op: an op before it too would be a chain of two, and the norms after it
    would lose exactness. The patch convolution is then centered by its weights, every norm exact."""
    model = zoo.build(zoo.EXACT, "clip-vision")
    plan = normswap.plan(model)
    assert len(plan.hooks) == 1 and "pre_layrnorm" in plan.hooks[0].module
    assert "approximate" not in {s.verdict for s in plan.sites}, plan.table()
    assert "vision_model.embeddings.patch_embedding.weight" in {e.target for e in plan.writer_edits}


def test_wav2vec2_plan_is_the_same_in_both_modes():
    """wav2vec2's feature projection is already left as it is (its output is also read by the positional
    convolution, and the op that convolution's GELU needs centers the sum), and each feature-extractor conv
    writes a norm inside its own layer, where no module boundary could hold an op (one op per norm): those
    convs keep their weight edits. The rule changes nothing there, and the conversion stays exact."""
    model = _hf("wav2vec2-stable")
    conv = _patched(model)
    plan, before = plan_of(conv), normswap.plan(model, stem_centering="weights")
    assert plan.hooks == before.hooks and plan.writer_edits == before.writer_edits, plan.summary()
    assert "approximate" not in {s.verdict for s in plan.sites}
    proj = "wav2vec2.feature_projection.projection.weight"
    assert torch.equal(model.get_parameter(proj), conv.get_parameter(proj))
    for size in (None, 5600):
        kw = _audio(model, size)
        _assert_close(_run(model, kw), _run(conv, kw), size)


def test_native_and_compat_checkpoints_round_trip(pairs, tmp_path):
    model, conv = _pair(pairs, "dinov2")
    kw = _pixels(model, None, False)
    ref = _run(model, kw)
    normswap.save(conv, tmp_path / "native")
    native = normswap.load(tmp_path / "native", dtype=torch.float64).eval()
    assert len(plan_of(native).hooks) == 1 and plan_of(native).options["stem_centering"] == "op"
    normswap.save(conv, tmp_path / "compat", format="compat")
    stock = tf.Dinov2ForImageClassification.from_pretrained(tmp_path / "compat", dtype=torch.float64).eval()
    assert not any(isinstance(m, normswap.RMSNorm) for m in stock.modules())
    key = "dinov2.embeddings.patch_embeddings.projection.weight"
    for loaded in (native, stock):
        _assert_close(ref, _run(loaded, kw), type(loaded).__name__)
        assert torch.equal(loaded.get_parameter(key), model.get_parameter(key))


def test_low_memory_conversion_carries_the_op(tmp_path):
    torch.manual_seed(0)
    cfg = tf.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=5, num_attention_heads=4,
                       intermediate_size=64, num_labels=5)
    model = zoo.randomise(tf.ViTForImageClassification(cfg)).float()
    model.save_pretrained(tmp_path / "src")
    mem, stream = tmp_path / "mem", tmp_path / "stream"
    normswap.convert(tmp_path / "src", mem, low_memory=False)
    report = normswap.convert(tmp_path / "src", stream, low_memory=True)
    assert report.streamed and len(report.plan.hooks) == 1
    a, b = normswap.load(mem).eval(), normswap.load(stream).eval()
    px = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(a(pixel_values=px).logits, b(pixel_values=px).logits)
        ref = model(pixel_values=px).logits
        assert float((b(pixel_values=px).logits - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    key = "vit.embeddings.patch_embeddings.projection.weight"
    assert torch.equal(b.get_parameter(key), model.get_parameter(key))


def test_rotation_folds_into_the_start_writers_by_default_and_follows_the_op_when_asked(pairs, tmp_path):
    """With ``rotate`` the default is ``"weights"``: ``Q`` folds into the centered start writers, no op, and the
    compat format holds it. ``stem_centering="op"`` with a rotation: the op commutes with ``Q`` (``Q·1 = ±1``),
    and ``Q`` is an op right after it (native only). Exact both ways."""
    model, _ = _pair(pairs, "vit")
    kw = _pixels(model, None, True)
    ref = _run(model, kw)
    for stem in (None, "op"):
        conv = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = normswap.patch(conv, rotate="hadamard", stem_centering=stem)
        plan = report.plan
        assert plan.options["stem_centering"] == (stem or "weights")
        assert len(plan.hooks) == (1 if stem else 0) and plan.rotations, plan.summary()
        assert bool(plan.rotations[0].get("ops")) == bool(stem)
        _assert_close(ref, _run(conv, kw), stem)
        if stem is None:
            normswap.save(conv, tmp_path / "compat", format="compat")
            stock = tf.ViTForImageClassification.from_pretrained(tmp_path / "compat", dtype=torch.float64).eval()
            _assert_close(ref, _run(stock, kw), "compat")
        else:
            with pytest.raises(NormswapError, match="compat format cannot hold the rotation op"):
                normswap.save(conv, tmp_path / "refused", format="compat")


def test_a_bad_value_is_a_one_line_error(tmp_path):
    model = _series()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NormswapError) as err:
        normswap.patch(model, _series_input(model, None), stem_centering="weight")
    assert "\n" not in str(err.value) and "'weights'" in str(err.value) and "stem_centering" in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    result = CliRunner().invoke(main, ["convert", "tiny-vit", "--out", str(tmp_path / "o"), "--stem-centering", "x"])
    assert result.exit_code != 0 and "--stem-centering" in result.output and not (tmp_path / "o").exists()


def test_cli_flag_reaches_the_manifest(tmp_path):
    runner = CliRunner()
    for value in ("weights", None):
        out = tmp_path / str(value)
        args = ["convert", "tiny-vit", "--out", str(out), "-q"] + (["--stem-centering", value] if value else [])
        result = runner.invoke(main, args)
        assert result.exit_code == 0, result.output
        loaded = normswap.load(out)
        assert plan_of(loaded).options["stem_centering"] == (value or "op")
        assert len(plan_of(loaded).hooks) == (0 if value else 1)


def test_a_rotation_after_the_op_on_a_module_returning_a_tuple():
    """Data2Vec-vision's embeddings return ``(tokens, grid size)``: the stem op sits on that output, and a
    rotation of a model patched with the op puts its ``Q`` there too, turning the one tensor it holds."""
    model = _hf("data2vec-vision")
    conv = _patched(model, fold_gamma=True, stem_centering="op")
    assert len(plan_of(conv).hooks) == 1
    rot = normswap.rotate(conv, "hadamard", seed=0)
    assert rot.rotated and [op["module"] for r in rot.rotated for op in r["ops"]] == ["data2vec_vision.embeddings"]
    kw = _pixels(model, None, False)
    with torch.no_grad():
        ref, out = model(**kw).logits, conv(**kw).logits
    assert float((out - ref).abs().max()) <= TOL * max(1.0, float(ref.abs().max()))


def test_the_op_is_one_mean_and_one_subtraction_in_onnx_runtime_and_every_norm_fuses(pairs, tmp_path):
    """Exported, the stem op is one ``ReduceMean`` and one ``Sub`` per image in ONNX Runtime's optimised graph
    (the stream start, not a norm's), every RMSNorm still lands on ``SimplifiedLayerNormalization``, and the
    conversion without the op has none."""
    pytest.importorskip("onnxruntime")
    import onnx
    import onnxruntime as ort

    from normswap.integrations.onnx import fused_norm_ops

    model, conv = _pair(pairs, "vit")
    x = _pixels(model, None, False)["pixel_values"].float()
    with torch.no_grad():
        ref = copy.deepcopy(model).float()(pixel_values=x).logits
    counts = {}
    for name, m in (("op", conv), ("weights", _patched(model, stem_centering="weights"))):
        m = copy.deepcopy(m).float().eval()
        path = tmp_path / f"{name}.onnx"
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(m, (x,), str(path), dynamo=False, opset_version=18)
        assert fused_norm_ops(path)["SimplifiedLayerNormalization"] == len(plan_of(conv).sites), name
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.optimized_model_filepath = str(tmp_path / f"{name}.opt.onnx")
        sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        ops = [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]
        counts[name] = (ops.count("ReduceMean"), ops.count("Sub"))
        out = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
        assert float((out - ref).abs().max()) <= 1e-4 * float(ref.abs().max()), name
    assert counts["op"][0] == counts["weights"][0] + 1 and counts["op"][1] == counts["weights"][1] + 1, counts


def test_the_default_op_falls_back_to_weights_where_the_op_would_leave_norms_approximate():
    """SAM2's Hiera: its position parameter is added where the stem op cannot reach it, so by default the op left
    3 norms approximate that centered stem weights make exact (the transformers sweep: 11 exact -> 8). The default
    now takes whichever is exact at more norms; an explicit ``stem_centering="op"`` is kept as asked."""
    torch.manual_seed(0)
    config = tf.Sam2HieraDetConfig(  # the transformers sweep's tiny config
        hidden_size=32, num_attention_heads=1, image_size=[128, 128], patch_kernel_size=[7, 7], patch_stride=[4, 4],
        patch_padding=[3, 3], query_stride=[2, 2], window_positional_embedding_background_size=[7, 7],
        num_query_pool_stages=3, blocks_per_stage=[1, 2, 2, 2], embed_dim_per_stage=[32, 64, 128, 256],
        num_attention_heads_per_stage=[1, 2, 4, 8], window_size_per_stage=[8, 4, 14, 7], global_attention_blocks=[4])
    model = zoo.randomise(tf.Sam2HieraDetModel(config).double().eval(), 0)
    pixels = torch.randn(2, 3, 128, 128, dtype=torch.float64)
    plans = {}
    for stem in (None, "op", "weights"):
        conv = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = normswap.patch(conv, {"pixel_values": pixels}, mode="all", stem_centering=stem)
        plans[stem] = report.plan
        if stem is None:
            default = conv
    exact = {k: sum(s.verdict.startswith("exact") for s in p.sites) for k, p in plans.items()}
    assert exact["op"] < exact["weights"] == exact[None], exact
    assert plans[None].options["stem_centering"] == "weights" and plans["op"].options["stem_centering"] == "op"
    other = torch.randn(1, 3, 128, 128, dtype=torch.float64)
    with torch.no_grad():
        ref, out = model(pixel_values=other).last_hidden_state, default(pixel_values=other).last_hidden_state
    assert (out - ref).abs().max() <= 0.1 * ref.abs().max()  # approximate norms remain: checked exact ones above
