"""The β placement rule (normswap.surgery.beta_placement): in a default conversion a norm keeps β in its RMSNorm
where folding it into the readers' biases would round worse in bf16 than the original's own path; exact
either way."""

import copy

import pytest
import torch

import normswap
from normswap.analysis.plan import BETA_KEPT_WHY
from normswap.surgery.beta_placement import rounding_costs
from tests.analysis.test_analysis import PreLNLM
from tests.custom_models import randomise

D = 32


def test_a_coherent_shift_rounds_worse_folded_and_a_zero_beta_folds():
    gen = torch.Generator().manual_seed(0)
    w = 0.02 * torch.randn(64, D, generator=gen, dtype=torch.float64) + 0.5  # every row sums β coherently
    c = 0.01 * torch.randn(64, generator=gen, dtype=torch.float64)
    beta = 3 + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64)
    folded, kept = rounding_costs(w, c, beta, "linear")
    assert folded > 4 * kept
    assert rounding_costs(w.T.contiguous(), c, beta, "conv1d") == pytest.approx((folded, kept), rel=1e-12)
    folded, kept = rounding_costs(w, c, torch.zeros(D, dtype=torch.float64), "linear")
    assert folded == kept  # nothing to fold: the same rounding of c either way, so β folds


def _model():
    """A Pre-LN LM whose first attention norm has a large β and a query/key/value projection that sums it
    coherently (folding rounds worse), and whose first MLP norm has β = 0 (folding costs nothing)."""
    model = randomise(PreLNLM(d=D), seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        model.blocks[0].n1.bias.copy_(3 + 0.1 * torch.randn(D, generator=gen))
        model.blocks[0].attn.qkv.weight.add_(0.5)
        model.blocks[0].attn.qkv.bias.mul_(0.01)
        model.blocks[0].n2.bias.zero_()
    return model


def test_patch_keeps_beta_where_folding_rounds_worse_and_stays_exact():
    model = _model()
    ids = torch.randint(0, 40, (2, 9))
    converted = copy.deepcopy(model)
    report = normswap.patch(converted, example_inputs=(ids,))
    plan = report.plan
    kept, folded = plan.site("blocks.0.n1"), plan.site("blocks.0.n2")
    assert not kept.fold_beta and kept.rms_bias and kept.beta_detail.startswith(BETA_KEPT_WHY), kept.beta_detail
    assert folded.fold_beta and not folded.rms_bias
    assert not any(f.site == "blocks.0.n1" for f in plan.folds)
    assert plan.options["beta_placement"] == "rounding" and "β kept in" in plan.summary()
    norm = converted.blocks[0].n1
    assert isinstance(norm, normswap.RMSNorm) and torch.equal(norm.bias, model.blocks[0].n1.bias)
    assert torch.equal(converted.blocks[0].attn.qkv.bias, model.blocks[0].attn.qkv.bias)
    probe = torch.randint(0, 40, (3, 11))
    with torch.no_grad():
        torch.testing.assert_close(converted(probe), model(probe), rtol=0, atol=1e-12)
    # the decision is the plan's: plan() says the same, and the manifest carries it
    dry = normswap.plan(model, (ids,))
    assert [(s.fold_beta, s.beta_detail) for s in dry.sites] == [(s.fold_beta, s.beta_detail) for s in plan.sites]
    assert dry.folds == plan.folds


def test_fold_placement_and_fold_gamma_fold_beta_wherever_the_readers_can_take_it():
    model = _model()
    ids = torch.randint(0, 40, (2, 9))
    for options in ({"beta_placement": "fold"}, {"fold_gamma": True}):
        plan = normswap.plan(model, (ids,), **options)
        assert all(s.fold_beta for s in plan.sites), (options, plan.table(width=None))
        assert "β kept in" not in plan.summary()
