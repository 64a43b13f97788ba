"""``writer_centering="auto"``: an op after the writers a LayerScale scales or whose centering would widen a row.

A per-row int8 weight grid (torchao, NNCF int8 weights, LLM.int8) rounds row ``i`` of a writer on a step of
``max|W'_i| / 127``. Centering a writer whose rows are of very different scale (a LayerScale λ spanning decades, or
rows of a writer without one far smaller than its others) makes the small rows mostly ``−m`` (the mean row), and
on DINOv2-small the centered LayerScale writers cost torchao and NNCF even where no row widens (round 52). Those
writers keep their rows behind an op, λ taken into them and balanced back out as ``layer_scale="keep"`` does;
every other writer is centered by weights as by default (GPT-2, Whisper: no op, nothing changes).

What could be silently wrong: the conversion no longer exact; the choice not the rule's (a LayerScale or widening
writer centered by weights, or an op where none is asked: GPT-2's writers); an op writer whose rows are not the
original's up to a per-row scale (a per-row grid would round other integers); its rows not balanced (a per-tensor
grid would lose the small rows); the widening figure not the statistic's; the choice not recorded or lost by a
native checkpoint; a rotation that turns streams, or the low-memory path (which plans on a proxy without the real
weights), silently accepted.
"""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
import transformers as tf
from click.testing import CliRunner

import normswap
from normswap.analysis.plan import plan_of
from normswap.analysis.planner import WRITER_AUTO_WIDENING
from normswap.cli import main
from normswap.errors import NormswapError
from tests import zoo

TOL = 1e-10
WIDE = "encoder.layer.0.layer_scale1"  # the one LayerScale spread over five decades (2e-4 … 11.3)


def _dinov2() -> torch.nn.Module:
    """A tiny DINOv2 (3 layers), γ/β and biases randomised; one λ log-uniform over 2e-4 … 11.3 (DINOv2-small's
    spread), every other in [0.5, 1.5]."""
    cfg = tf.Dinov2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=2, intermediate_size=128,
                          image_size=28, patch_size=14, layerscale_value=1.0)
    torch.manual_seed(0)
    model = zoo.randomise(tf.Dinov2Model(cfg))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambda" in name:
                u = torch.rand(p.shape, generator=g, dtype=torch.float64)
                p.copy_(torch.exp(math.log(2e-4) + u * (math.log(11.3) - math.log(2e-4))) if name.startswith(WIDE)
                        else 0.5 + u)
    return model


def _gpt2() -> torch.nn.Module:
    return zoo.build(zoo.EXACT, "gpt2")


def _patched(model: torch.nn.Module, **options) -> torch.nn.Module:
    out = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(out, beta_placement="keep", **options)
    return out


def _px(n: int = 3) -> torch.Tensor:
    return torch.randn(n, 3, 28, 28, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _rel(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def _widening(weight: torch.Tensor, lam: torch.Tensor | None) -> float:
    """Centering's widening of a ``[out, in]`` weight's rows, computed here independently of the planner."""
    w = weight.detach().double() * (1 if lam is None else lam.detach().double()[:, None])
    return float(((w - w.mean(0)).abs().amax(1) / w.abs().amax(1)).max())


@pytest.fixture(scope="module")
def dino() -> tuple[torch.nn.Module, torch.nn.Module]:
    model = _dinov2()
    return model, _patched(model, writer_centering="auto")


def test_an_op_after_every_layer_scale_writer_and_the_conversion_is_exact(dino):
    model, conv = dino
    plan = plan_of(conv)
    assert plan.options["writer_centering"] == "auto"
    widening = plan.options["writer_widening"]
    writers = {f"encoder.layer.{i}.{w}": f"encoder.layer.{i}.layer_scale{k}"
               for i in range(3) for w, k in (("attention.o_proj", 1), ("mlp.fc2", 2))}
    assert set(widening) == set(writers)
    for path, scale in writers.items():  # the planner's figure is the statistic, λ folded in
        lam = model.get_submodule(scale).lambda1
        assert widening[path] == pytest.approx(_widening(model.get_submodule(path).weight, lam), rel=1e-3), path
    assert widening["encoder.layer.0.attention.o_proj"] > WRITER_AUTO_WIDENING  # the wide λ widens its rows
    assert min(widening.values()) < WRITER_AUTO_WIDENING  # the narrow ones do not: an op all the same
    ops = {h.module for h in plan.hooks if h.writer}
    assert ops == set(writers.values()), ops
    assert all(h.where == "output" and not h.per_norm for h in plan.hooks if h.writer)
    assert "approximate" not in {s.verdict for s in plan.sites}, plan.table()
    px = _px()
    with torch.no_grad():
        ref, out = model(pixel_values=px).last_hidden_state, conv(pixel_values=px).last_hidden_state
    assert _rel(ref, out) <= TOL


def test_every_op_writer_keeps_the_original_rows_up_to_a_row_scale_with_balanced_ranges(dino):
    model, conv = dino
    for i in range(3):
        for path, scale in ((f"encoder.layer.{i}.attention.o_proj", f"encoder.layer.{i}.layer_scale1"),
                            (f"encoder.layer.{i}.mlp.fc2", f"encoder.layer.{i}.layer_scale2")):
            w0 = model.get_submodule(path).weight.detach() * model.get_submodule(scale).lambda1.detach()[:, None]
            w1 = conv.get_submodule(path).weight.detach()
            lam1 = conv.get_submodule(scale).lambda1.detach()
            # what the writer adds is the original's, row for row (no centering); the row maxima are balanced
            assert float((w1 * lam1[:, None] - w0).abs().max()) <= 1e-12 * float(w0.abs().max()), path
            peak, target = w1.abs().amax(1), float(model.get_submodule(path).weight.detach().abs().max())
            assert bool((peak <= target * (1 + 1e-12)).all()) and bool((peak > target * 8 / 9 * (1 - 1e-12)).all())
            # so a per-row symmetric int8 grid rounds the original's integers
            q0 = torch.round(w0 / w0.abs().amax(1, keepdim=True) * 127)
            q1 = torch.round(w1 / peak[:, None] * 127)
            assert torch.equal(q0, q1), path


def test_auto_is_op_with_balanced_rows_on_a_layer_scale_model_and_weights_none(dino):
    """On a model whose every writer a LayerScale scales, ``"auto"`` is ``"op"`` with the rows balanced: the same ops,
    the same tensors elsewhere, λ and the writers' rows differing by a per-row scale (``"op"`` leaves λ as it was);
    ``"weights"`` has no writer op."""
    model, conv = dino
    op = _patched(model, writer_centering="op")
    assert {h.module for h in plan_of(op).hooks if h.writer} == {h.module for h in plan_of(conv).hooks if h.writer}
    assert plan_of(op).scale_folds == [] and len(plan_of(conv).scale_folds) == 6
    a, b = dict(op.named_parameters()), dict(conv.named_parameters())
    moved = [k for k in a if not torch.equal(a[k], b[k])]
    assert moved and all(re.search(r"(o_proj|fc2)\.(weight|bias)$|lambda1$", k) for k in moved), moved
    plan = plan_of(_patched(model))
    assert not any(h.writer for h in plan.hooks) and "writer_widening" not in plan.options


def test_gpt2_without_layer_scale_keeps_every_weight_edit_unless_a_row_widens():
    model = _gpt2()
    conv = _patched(model, writer_centering="auto")
    plan = plan_of(conv)
    assert not any(h.writer for h in plan.hooks) and max(plan.options["writer_widening"].values()) <= 2
    # one MLP writer with rows 1e-3 of the others' scale: its centering widens them, it gets the op alone
    odd = copy.deepcopy(model)
    path = "transformer.h.1.mlp.c_proj"
    with torch.no_grad():
        odd.get_submodule(path).weight[:, ::2] *= 1e-3  # Conv1D: [in, out], output features along the columns
    conv = _patched(odd, writer_centering="auto")
    plan = plan_of(conv)
    assert [h.module for h in plan.hooks if h.writer] == [path] and plan.options["writer_widening"][path] > 100
    assert torch.equal(conv.get_submodule(path).weight, odd.get_submodule(path).weight)  # no λ: the original's
    ids = torch.randint(0, odd.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref, out = odd(input_ids=ids).logits, conv(input_ids=ids).logits
    assert _rel(ref, out) <= TOL


def test_native_checkpoint_records_and_keeps_the_choice(dino, tmp_path):
    model, conv = dino
    normswap.save(conv, tmp_path / "native")
    loaded = normswap.load(tmp_path / "native", dtype=torch.float64).eval()
    plan = plan_of(loaded)
    assert sum(h.writer for h in plan.hooks) == 6
    assert plan.options["writer_widening"] == plan_of(conv).options["writer_widening"]
    px = _px()
    with torch.no_grad():
        assert _rel(model(pixel_values=px).last_hidden_state, loaded(pixel_values=px).last_hidden_state) <= TOL


def test_online_hadamards_alone_compose_with_auto(dino):
    model, _ = dino
    conv = _patched(model, writer_centering="auto", rotate="none", online_hadamard=True)
    assert sum(h.writer for h in plan_of(conv).hooks) == 6
    px = _px()
    with torch.no_grad():
        assert _rel(model(pixel_values=px).last_hidden_state, conv(pixel_values=px).last_hidden_state) <= 1e-9


def test_a_turning_rotation_or_the_low_memory_path_is_refused_in_one_line(tmp_path):
    model = _gpt2()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NormswapError) as err:
        normswap.patch(model, writer_centering="auto", rotate="hadamard")
    assert "\n" not in str(err.value) and "writer_centering='auto'" in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model.float().save_pretrained(tmp_path / "src")
    with pytest.raises(NormswapError) as err:
        normswap.convert(tmp_path / "src", tmp_path / "out", low_memory=True, writer_centering="auto")
    assert "\n" not in str(err.value) and "low_memory" in str(err.value) and not (tmp_path / "out").exists()


def test_cli_takes_auto_and_refuses_it_with_a_turning_rotation(tmp_path):
    result = CliRunner().invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "bad"), "--rotate", "hadamard",
                                       "--writer-centering", "auto"])
    assert result.exit_code == 2, result.output
    assert "--writer-centering auto" in result.output and not (tmp_path / "bad").exists()
    result = CliRunner().invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "bad"), "--low-memory",
                                       "--writer-centering", "auto"])
    assert result.exit_code == 2 and "--low-memory" in result.output and not (tmp_path / "bad").exists()
    result = CliRunner().invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "ok"),
                                       "--writer-centering", "auto"])
    assert result.exit_code == 0, result.output
    assert plan_of(normswap.load(tmp_path / "ok")).options["writer_centering"] == "auto"
