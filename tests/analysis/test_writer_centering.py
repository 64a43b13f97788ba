"""Writer centering by ops: the writers inside the layers keep the original's weights, one op after each centers it.

What could be silently wrong: a conversion that is no longer exact; a writer whose weights are still edited (a
per-row int8 quantizer would then round other rows than the original's, the point lost); an op before a LayerScale
product (it would center the writer's output, not what ``λ ⊙`` adds: not exact); a LayerScale still rebalanced;
ops that a native checkpoint loses; the default changed; a bad value or a rotation that turns streams silently
accepted; the CLI answering a conflicting flag with a traceback.
"""

from __future__ import annotations

import copy
import re
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

TOL = 1e-10
# model -> (zoo table, the writers inside the layers, where each op must sit: the module whose output it centers)
MODELS = {
    "dinov2": (zoo.MORE, r"\.(attention\.o_proj|mlp\.fc2)$", r"\.layer_scale[12]$"),
    "gpt2": (zoo.EXACT, r"\.(attn|mlp)\.c_proj$", r"\.(attn|mlp)\.c_proj$|\.(attn|mlp)$"),
    "whisper": (zoo.EXACT, r"\.(self_attn|encoder_attn)\.out_proj$|\.fc2$", r"\.out_proj$|\.fc2$|_attn$"),
}


def _build(name: str) -> nn.Module:
    table = MODELS[name][0]
    factory = {k: (v[0] if isinstance(v, tuple) else v) for k, v in table.items()}[name]
    torch.manual_seed(0)
    cls, config = factory()
    return zoo.randomise(cls(config))


def _inputs(model: nn.Module) -> dict:
    g = torch.Generator().manual_seed(7)
    cfg = model.config
    if isinstance(model, tf.Dinov2PreTrainedModel):
        return {"pixel_values": torch.randn(2, 3, cfg.image_size, cfg.image_size, generator=g, dtype=torch.float64)}
    if isinstance(model, tf.WhisperPreTrainedModel):
        return {"input_features": torch.randn(2, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g,
                                              dtype=torch.float64),
                "decoder_input_ids": torch.randint(0, cfg.vocab_size, (2, 5), generator=g)}
    return {"input_ids": torch.randint(0, cfg.vocab_size, (2, 7), generator=g)}


def _outputs(model: nn.Module, kw: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**kw)
    return out.logits


def _patched(model: nn.Module, **options) -> nn.Module:
    conv = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(conv, beta_placement="keep", **options)
    return conv


@pytest.fixture(scope="module")
def pairs() -> dict[str, tuple[nn.Module, nn.Module]]:
    return {}


def _pair(cache: dict, name: str) -> tuple[nn.Module, nn.Module]:
    if name not in cache:
        model = _build(name)
        cache[name] = (model, _patched(model, writer_centering="op"))
    return cache[name]


@pytest.mark.parametrize("name", list(MODELS))
def test_every_writer_keeps_its_weights_and_one_op_after_it_keeps_the_conversion_exact(pairs, name):
    model, conv = _pair(pairs, name)
    _, writers, places = MODELS[name]
    plan = plan_of(conv)
    assert plan.options["writer_centering"] == "op"
    names = [n for n, m in model.named_modules() if re.search(writers, n)]
    ops = [h for h in plan.hooks if h.writer]
    assert names and len(ops) == len(names), plan.summary()  # one op per writer
    for h in ops:
        assert h.where == "output" and re.search(places, h.module), h
        assert "writer_centering='op'" in h.reason and not h.per_norm
    # the writers (weights, biases) and every LayerScale λ are the original's, bit for bit
    before, after = dict(model.named_parameters()), dict(conv.named_parameters())
    kept = [k for k in before if any(k.startswith(n + ".") for n in names) or "lambda1" in k]
    assert kept
    for k in kept:
        assert torch.equal(before[k], after[k]), k
    assert not any(e.owner in names for e in plan.writer_edits) and plan.scale_folds == []
    assert "approximate" not in {s.verdict for s in plan.sites}, plan.table()
    kw = _inputs(model)
    ref, out = _outputs(model, kw), _outputs(conv, kw)
    assert float((out - ref).abs().max()) <= TOL * max(1.0, float(ref.abs().max())), name


def test_the_default_still_centers_the_writers_by_their_weights(pairs):
    model, _ = _pair(pairs, "dinov2")
    conv = _patched(model)
    plan = plan_of(conv)
    assert plan.options["writer_centering"] == "weights"
    assert not any(h.writer for h in plan.hooks) and len(plan.hooks) == 1  # the stem op alone
    w = conv.get_submodule("dinov2.encoder.layer.0.mlp.fc2").weight.detach()
    lam = conv.get_submodule("dinov2.encoder.layer.0.layer_scale2").lambda1.detach()
    scaled = lam[:, None] * w  # what the writer adds: centered over the output features (λ kept, rows rescaled)
    assert float(scaled.sum(0).abs().max()) <= 1e-9 * float(scaled.abs().max())
    assert not torch.equal(w, model.get_submodule("dinov2.encoder.layer.0.mlp.fc2").weight)


def test_an_op_before_the_layerscale_product_would_not_be_exact(pairs):
    """The place matters: centering ``fc2``'s own output and then scaling it by λ leaves a mean in the stream."""
    model, conv = _pair(pairs, "dinov2")
    x = torch.randn(3, 4, model.config.hidden_size, dtype=torch.float64)
    lam = model.get_submodule("dinov2.encoder.layer.0.layer_scale2").lambda1.detach()
    assert float((lam * (x - x.mean(-1, keepdim=True))).mean(-1).abs().max()) > 1e-3
    ops = {h.module for h in plan_of(conv).hooks if h.writer}
    assert "dinov2.encoder.layer.0.layer_scale2" in ops and "dinov2.encoder.layer.0.mlp" not in ops


def test_native_checkpoint_keeps_the_ops_and_compat_is_the_stock_model(pairs, tmp_path):
    model, conv = _pair(pairs, "dinov2")
    kw = _inputs(model)
    ref = _outputs(model, kw)
    normswap.save(conv, tmp_path / "native")
    native = normswap.load(tmp_path / "native", dtype=torch.float64).eval()
    assert sum(h.writer for h in plan_of(native).hooks) == 4
    normswap.save(conv, tmp_path / "compat", format="compat")
    stock = tf.Dinov2ForImageClassification.from_pretrained(tmp_path / "compat", dtype=torch.float64).eval()
    assert not any(isinstance(m, normswap.RMSNorm) for m in stock.modules())
    key = "dinov2.encoder.layer.1.attention.o_proj.weight"
    for loaded in (native, stock):
        out = _outputs(loaded, kw)
        assert float((out - ref).abs().max()) <= TOL * max(1.0, float(ref.abs().max())), type(loaded).__name__
        assert torch.equal(loaded.get_parameter(key), model.get_parameter(key))


def test_a_bad_value_or_a_turning_rotation_is_a_one_line_error_and_the_model_is_untouched():
    model = _build("gpt2")
    before = copy.deepcopy(model.state_dict())
    for options, words in (({"writer_centering": "ops"}, "'op'"),
                           ({"writer_centering": "op", "rotate": "hadamard"}, "rotate='none'")):
        with pytest.raises(NormswapError) as err:
            normswap.patch(model, **options)
        assert "\n" not in str(err.value) and words in str(err.value) and "writer_centering" in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_cli_refuses_writer_ops_with_a_turning_rotation_as_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "out"), "--rotate", "hadamard",
                                       "--writer-centering", "op"])
    assert result.exit_code == 2, result.output
    assert "--writer-centering op" in result.output and not (tmp_path / "out").exists()


def test_online_hadamards_alone_compose_with_writer_ops(pairs):
    """``--rotate none --online-hadamard`` turns no stream: its ops sit before the Linear inputs and fold into the
    readers' and writers' input columns, the writer ops after the writers stay where they are; still exact."""
    model, _ = _pair(pairs, "gpt2")
    conv = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(conv, beta_placement="keep", writer_centering="op", rotate="none", online_hadamard=True)
    plan = plan_of(conv)
    assert sum(h.writer for h in plan.hooks) == 4 and plan.options["writer_centering"] == "op"
    kw = _inputs(model)
    ref, out = _outputs(model, kw), _outputs(conv, kw)
    assert float((out - ref).abs().max()) <= 1e-9 * max(1.0, float(ref.abs().max()))


def test_low_memory_conversion_carries_every_writer_op(tmp_path):
    """The streaming converter plans a reduced-depth proxy: the writer ops of every layer it never traced must be
    in the written checkpoint too (5 layers, 10 writers), and the result the same as in memory."""
    torch.manual_seed(0)
    cfg = tf.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=5, num_attention_heads=4,
                       intermediate_size=64, num_labels=5)
    model = zoo.randomise(tf.ViTForImageClassification(cfg)).float()
    model.save_pretrained(tmp_path / "src")
    mem, stream = tmp_path / "mem", tmp_path / "stream"
    normswap.convert(tmp_path / "src", mem, low_memory=False, writer_centering="op")
    report = normswap.convert(tmp_path / "src", stream, low_memory=True, writer_centering="op")
    assert report.streamed and sum(h.writer for h in report.plan.hooks) == 10
    a, b = normswap.load(mem).eval(), normswap.load(stream).eval()
    px = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(a(pixel_values=px).logits, b(pixel_values=px).logits)
    key = "vit.layers.4.mlp.fc2.weight"
    assert torch.equal(b.get_parameter(key), model.get_parameter(key))


def test_a_post_ln_encoder_whose_mlp_carries_the_mean_keeps_its_carry_under_writer_ops():
    """BERT's FFN-output norms are exact through the mean carry: neurons added to the MLP write the previous
    norm's mean through its output projection. An op after that projection would remove the mean again (the
    conversion was refused: "planned exact but its input is not zero-mean"); those writers keep the carry, and
    ``op`` converts as ``weights`` does there (the approximate norms' calibration may round differently: 1e-8)."""
    torch.manual_seed(0)
    cls, config = zoo.APPROXIMATE["bert"]()
    model = zoo.randomise(cls(config))
    by_weights, by_ops = _patched(model), _patched(model, writer_centering="op")
    verdicts = [(s.name, s.verdict) for s in plan_of(by_weights).sites]
    assert [(s.name, s.verdict) for s in plan_of(by_ops).sites] == verdicts
    assert any(v == "exact" for _, v in verdicts) and plan_of(by_ops).mean_carries
    kw = _inputs(model)
    ref, a, b = _outputs(model, kw), _outputs(by_weights, kw), _outputs(by_ops, kw)
    assert float((b - a).abs().max()) <= 1e-8 * max(1.0, float(ref.abs().max()))
