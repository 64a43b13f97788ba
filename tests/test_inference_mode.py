"""A model built under ``torch.inference_mode()`` converts (its inference tensors become ordinary copies).

Such a model's parameters are inference tensors: outside that mode PyTorch neither writes them in place
nor tracks them ("Inference tensors do not track version counter"), and ``patch`` does both. It now
replaces each by an ordinary copy with the same values (ties kept) and converts exactly; calling
``patch`` inside an ``inference_mode`` block is refused in one line.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import normswap
from normswap.errors import NormswapError
from normswap.pipeline import release_inference_tensors
from tests.custom_models import TinyGPT, randomise_layer_norms, tiny_gpt2_config


def _gpt2_in_inference_mode() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    randomise_layer_norms(model)
    with torch.inference_mode():
        built = transformers.GPT2LMHeadModel(model.config).double()
        built.load_state_dict(model.double().state_dict())
    return built.eval()


@pytest.mark.parametrize("untie", [True, False])
def test_a_model_built_under_inference_mode_converts_exactly(untie):
    model = _gpt2_in_inference_mode()
    assert all(p.is_inference() for p in model.parameters())
    ids = torch.randint(0, 99, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = model(ids).logits.clone()
    report = normswap.patch(model, untie=untie)
    assert report.changed and all(s.verdict.startswith("exact") for s in report.sites)
    assert not any(t.is_inference() for t in [*model.parameters(), *model.buffers()])
    assert (model.lm_head.weight is model.transformer.wte.weight) is (not untie)
    with torch.no_grad():
        got = model(ids).logits
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-12


def test_a_custom_module_built_under_inference_mode_converts_and_saves(tmp_path):
    torch.manual_seed(2)
    with torch.inference_mode():
        net = TinyGPT().double().eval()
        randomise_layer_norms(net)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = net(ids)
    normswap.patch(net, example_inputs=(ids,))
    assert net.head.weight is net.tok.weight or not any(p.is_inference() for p in net.parameters())
    with torch.no_grad():
        torch.testing.assert_close(net(ids), expected, rtol=1e-10, atol=1e-10)
    out = normswap.save(net, tmp_path / "net")
    fresh = normswap.load(out, model=TinyGPT().double())
    with torch.no_grad():
        assert torch.equal(fresh(ids), net(ids))


def test_ties_stay_ties_and_an_ordinary_model_is_left_alone():
    with torch.inference_mode():
        net = TinyGPT()
    assert net.head.weight is net.tok.weight
    replaced = release_inference_tensors(net)
    assert "tok.weight" in replaced and net.head.weight is net.tok.weight
    assert not net.tok.weight.is_inference() and net.tok.weight.requires_grad
    assert release_inference_tensors(net) == []


def test_patch_inside_inference_mode_is_refused_in_one_line():
    model = _gpt2_in_inference_mode()
    with torch.inference_mode(), pytest.raises(NormswapError, match="outside the `with torch.inference_mode") as err:
        normswap.patch(model)
    assert "\n" not in str(err.value)
    assert all(p.is_inference() for p in model.parameters())  # refused before touching anything
