"""Pieces of ``benchmarks/nncf_encoder_draws.py``: the exact re-rounding of a Post-LN encoder's attention weights
(per-head orthogonal turns of the query/key rows and of the value rows with the output projection's columns),
applied alike to the original and its conversions (the mean carry; the centering ops).

What could be silently wrong: a turn that changes the function (a "draw" would then measure another model), one
that leaves a weight a per-row int8 grid rounds as it was (no draw where the docs say one), one that touches the
FFN (the docs say its rounding is the shipped one in every draw), and two models of a pair turned differently.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import normswap
from tests import benchmark_modules
from tests.zoo import APPROXIMATE, build

draws = benchmark_modules.load("nncf_encoder_draws")

OPTIONS = {"carry": {}, "ops": {"per_norm_centering": True, "mean_carry": False}}


def _models(name: str) -> dict[str, torch.nn.Module]:
    original = build(APPROXIMATE, name)
    out = {"original": original.base_model}
    for label, opts in OPTIONS.items():
        conv = copy.deepcopy(original)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            normswap.patch(conv, calibration=False, **opts)
        out[label] = conv.base_model.eval()
    return out


def _hidden(model: torch.nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 99, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


@pytest.mark.parametrize("name", ["bert", "mpnet"])
def test_a_draw_is_exact_and_rerounds_the_attention_weights_only(name):
    for label, model in _models(name).items():
        turned = draws.redraw(model, 3)
        ref = _hidden(model)
        assert float((_hidden(turned) - ref).abs().max() / ref.abs().max()) <= 1e-12, label
        for layer, new in zip(model.encoder.layer, turned.encoder.layer, strict=True):
            for lin, lin2 in zip(draws.attention_parts(layer), draws.attention_parts(new), strict=True):
                changed = (lin.weight - lin2.weight).abs().amax(1) > 1e-9  # every row a new mix: rounded anew
                assert bool(changed.all()), label
            for a, b in ((layer.intermediate.dense, new.intermediate.dense), (layer.output.dense, new.output.dense)):
                assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias), label
        assert draws.redraw(model, 0) is not model  # draw 0: a copy, the shipped weights
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), draws.redraw(model, 0).parameters(),
                                                     strict=True))


@pytest.mark.parametrize("name", ["bert", "mpnet"])
def test_both_models_of_a_pair_get_the_same_turns(name):
    """A conversion's attention weights that equal the original's stay equal after the same draw (the value and
    output projections: the op conversion leaves the writers and the value reader as the original has them)."""
    models = _models(name)
    original, ops = models["original"], models["ops"]
    a, b = draws.redraw(original, 5), draws.redraw(ops, 5)
    same = 0
    for lo, lc, ta, tb in zip(original.encoder.layer, ops.encoder.layer, a.encoder.layer, b.encoder.layer,
                              strict=True):
        for w0, w1, t0, t1 in zip(draws.attention_parts(lo), draws.attention_parts(lc), draws.attention_parts(ta),
                                  draws.attention_parts(tb), strict=True):
            if torch.equal(w0.weight, w1.weight):
                same += 1
                assert torch.allclose(t0.weight, t1.weight, rtol=0, atol=1e-12)
    assert same >= 2  # at least the output projections (writers behind the ops keep the original's weights)
    other = draws.redraw(ops, 6)
    assert not torch.allclose(draws.attention_parts(other.encoder.layer[0])[3].weight,
                              draws.attention_parts(b.encoder.layer[0])[3].weight)  # another seed, other turns
