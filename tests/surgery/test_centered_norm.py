"""A Post-LN norm's centering op (``per_norm_centering=True``) runs inside the norm: ``RMSNorm.centers_input``.

``RMSNorm(x - mean(x))·γ + β`` is ``LayerNorm(x)`` with the same γ, β and eps, so the norm runs torch's one
``layer_norm`` kernel instead of a Python pre-hook plus a mean and a subtraction (round 58: the hook cost a
BERT-class encoder 4-6 % of its eager time). Float64 against the original, LayerNorm parameters randomised."""

from __future__ import annotations

import copy
import warnings

import torch
from transformers import BertConfig, BertModel

import normswap


def _bert() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     vocab_size=97)
    original = BertModel(cfg).eval()
    for m in original.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.normal_()
    original = original.double()
    converted = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(converted, per_norm_centering=True, mean_carry=False)
    return original, converted


def _centered(model: torch.nn.Module) -> list[normswap.RMSNorm]:
    return [m for m in model.modules() if isinstance(m, normswap.RMSNorm) and m.centers_input]


def test_post_ln_norms_center_their_input_without_a_hook_and_stay_exact():
    original, converted = _bert()
    norms = _centered(converted)
    # the two Post-LN norms of each layer, and the embeddings' norm (its tables keep their rows: round 62)
    assert len(norms) == 5
    assert all(not n._forward_pre_hooks and not n._forward_hooks for n in norms)
    assert all(("input", 0) in n._normswap_hooks for n in norms)  # still recorded as the plan's op
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = original(ids).last_hidden_state, converted(ids).last_hidden_state
    assert (got - ref).abs().max() < 1e-12


def test_the_centered_norm_is_layer_norm_eager_traced_scripted_and_removable():
    _, converted = _bert()
    norm = _centered(converted)[0]
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) + 3.0
    ref = torch.nn.functional.layer_norm(x, (32,), norm.weight, norm.bias, norm.eps)
    with torch.no_grad():
        assert (norm(x) - ref).abs().max() < 1e-12
        assert (torch.compile(norm, backend="eager")(x) - ref).abs().max() < 1e-12
        assert (norm.__prepare_scriptable__()(x) - ref).abs().max() < 1e-12
    graph = torch.export.export(norm, (x,)).graph_module.code
    assert "layer_norm" in graph and "rms_norm" not in graph
    assert "centers_input=True" in repr(norm)
    norm._normswap_hooks[("input", 0)].remove()
    assert not norm.centers_input
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight + norm.bias
    with torch.no_grad():
        assert (norm(x) - rms).abs().max() < 1e-12  # the cached layer_norm decision was dropped


def test_saved_and_loaded_post_ln_norms_center_again(tmp_path):
    original, converted = _bert()
    converted = converted.float()
    normswap.save(converted, tmp_path / "out")
    loaded = normswap.load(tmp_path / "out")
    assert len(_centered(loaded)) == 5
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = original.float()(ids).last_hidden_state
        assert (loaded(ids).last_hidden_state - ref).abs().max() < 1e-4
