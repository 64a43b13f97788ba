"""The transaction behind ``patch``: what the working copy shares with the user's model and what
the surgery may write."""

import copy

import pytest
import torch

import normswap
from normswap import api, surgery
from normswap.inputs import hf_example_inputs
from tests.zoo import EXACT, build


def test_float64_patch_adopts_edited_tensors_and_leaves_the_rest_in_place():
    """A float64 model is not copied whole: parameters the plan does not edit keep their storage, the
    edited ones are replaced (same Parameter objects), and the untied head keeps the original values."""
    model = build(EXACT, "gpt2")
    reference = copy.deepcopy(model)
    params = dict(model.named_parameters())
    storage = {n: p.data_ptr() for n, p in params.items()}
    head = model.lm_head.weight.detach().clone()
    probe = hf_example_inputs(model, seed=5)

    report = normswap.patch(model)

    written = surgery.written_parameters(report.plan, reference)
    assert written and "transformer.h.0.attn.c_attn.weight" not in written
    after = dict(model.named_parameters())
    norms = tuple(f"{sp.name}." for sp in report.plan.sites if sp.convert)
    for name, p in params.items():
        if name.startswith(norms):  # a LayerNorm, replaced by an RMSNorm
            continue
        assert after[name] is p, name  # the user's Parameter objects stay
        if name in written:
            assert p.data_ptr() != storage[name], name
        else:
            assert p.data_ptr() == storage[name], name
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert torch.equal(model.lm_head.weight, head)
    with torch.no_grad():
        a, b = reference(**probe).logits, model(**probe).logits
    assert float((a - b).abs().max() / a.abs().max()) < 1e-12


def test_an_unlisted_in_place_write_is_caught_before_the_commit(monkeypatch):
    """If the surgery wrote a parameter that written_parameters does not list, that tensor is the
    user's own: the conversion must stop with an internal error, not commit or claim success."""
    model = build(EXACT, "gpt2-untied")
    real = surgery.written_parameters
    monkeypatch.setattr(surgery, "written_parameters",
                        lambda plan, m: {n for n in real(plan, m) if "c_proj" not in n})
    modules = [type(m) for m in model.modules()]
    with pytest.raises(normswap.NormswapError, match="internal error.*c_proj"):
        normswap.patch(model)
    assert [type(m) for m in model.modules()] == modules  # nothing committed


def test_plan_leaves_every_tensor_of_a_float64_model_unwritten():
    model = build(EXACT, "gpt2")
    before = api.versions(model)
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    normswap.plan(model)
    assert api.versions(model) == before
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage
