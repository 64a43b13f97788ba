"""``untie=None`` (the default): a head tied to the input embedding stays tied, the embedding is centered by one op,
and heads are untied only where the plan needs their own weight (γ folded into them, an approximate norm's reader
rewrite, or a tie that would cost a stream its one op). Exactness in float64, LayerNorm γ/β randomised."""

from __future__ import annotations

import copy
import warnings

import torch

import normswap
from normswap import presets
from normswap.inputs import hf_example_inputs
from normswap.surgery.verify import compare
from tests.zoo import EXACT, build


def _worst(original: torch.nn.Module, converted: torch.nn.Module, seed: int) -> float:
    probe = hf_example_inputs(original, seed=seed)
    with torch.no_grad():
        return compare(original(**probe), converted(**probe))["worst_rel_error_any_output"]


def _patched(name: str, **options) -> tuple[torch.nn.Module, torch.nn.Module, normswap.Report]:  # noqa: ANN003
    original = build(EXACT, name)
    model = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(model, **options)
    return original, model, report


def test_gpt2_keeps_its_tie_and_centers_the_embedding_by_one_op():
    original, model, report = _patched("gpt2")
    plan = report.plan
    assert not plan.unties and model.lm_head.weight is model.transformer.wte.weight
    assert [h.module for h in plan.hooks] == ["transformer.wte"]
    assert {s.verdict for s in plan.sites} == {"exact-with-centering"}
    assert plan.options["untie"] is None
    assert all(_worst(original, model, seed) <= 1e-9 for seed in (3, 4))
    # the head the quantizers see is the original's: the tied table, unedited
    assert torch.equal(model.lm_head.weight, original.lm_head.weight)


def test_untie_true_still_clones_the_head_and_centers_the_table_by_weights():
    original, model, report = _patched("gpt2", untie=True)
    assert report.plan.unties and not report.plan.hooks and model.lm_head.weight is not model.transformer.wte.weight
    assert {s.verdict for s in report.plan.sites} == {"exact"}
    assert _worst(original, model, 5) <= 1e-9


def test_a_gamma_fold_into_the_head_unties_it_by_default():
    original, model, report = _patched("gpt2", fold_gamma=True)
    assert [u.module for u in report.plan.unties] == ["lm_head"]
    assert report.plan.site("transformer.ln_f").fold_gamma
    assert _worst(original, model, 6) <= 1e-9


def test_keep_tied_with_fold_gamma_keeps_the_last_norms_gamma_and_stays_exact():
    """Before: γ of ``ln_f`` was folded into the head the embedding shares (relative error 0.5 at verification)."""
    original, model, report = _patched("gpt2", fold_gamma=True, untie=False)
    assert not report.plan.unties and model.lm_head.weight is model.transformer.wte.weight
    assert not report.plan.site("transformer.ln_f").fold_gamma
    assert report.plan.site("transformer.h.0.ln_1").fold_gamma  # the others still fold
    assert _worst(original, model, 7) <= 1e-9


def test_a_tie_that_would_cost_a_second_stream_its_op_is_untied():
    """BLOOM: the op at a tied embedding would leave none for the stream its embedding LayerNorm starts, so the
    default unties there (as many exact norms as ``untie=True``)."""
    original, model, report = _patched("bloom")
    _, _, untied = _patched("bloom", untie=True)
    assert report.plan.unties and report.plan.counts() == untied.plan.counts()
    assert "approximate" not in {s.verdict for s in report.plan.sites}
    assert _worst(original, model, 8) <= 1e-9


def test_beta_folds_into_a_tied_heads_own_bias_and_the_tie_stays():
    """BERT's MLM head: the last norm's β goes into the decoder's bias (the shared weight is only read), so the
    tie and the fold both hold; a γ fold would rewrite the shared weight and unties instead (above)."""
    original, _ = presets.build("tiny-bert", dtype=torch.float64)
    model = copy.deepcopy(original)
    report = normswap.patch(model, example_inputs=presets.example_inputs("tiny-bert"), mode="exact",
                            beta_placement="fold")
    site = report.plan.site("cls.predictions.transform.LayerNorm")
    assert site.convert and site.fold_beta and not report.plan.unties
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert not torch.equal(model.cls.predictions.decoder.bias, original.cls.predictions.decoder.bias)
    assert all(_worst(original, model, seed) <= 1e-9 for seed in (9, 10))
