"""Fused-MoE models are analysed and verified in float64.

transformers' default fused-experts path (``grouped_mm``) has no float64 kernel on CPU; the float64
working copy runs the ``eager`` experts instead (same weights, a loop of ``F.linear``), the report
says so, and the user's model keeps its own setting.
"""

from __future__ import annotations

import pytest
import torch
from transformers import PhimoeConfig, PhimoeForCausalLM

import normswap


def _phimoe(seed: int = 1) -> PhimoeForCausalLM:
    config = PhimoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=64)
    model = PhimoeForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # γ/β randomised: a dropped β or an uncentred writer would show
        for name, p in model.named_parameters():
            one = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else 0.2) + one)
    return model.float().eval()


@pytest.mark.parametrize("example", [True, False], ids=["example_inputs", "no_inputs"])
def test_grouped_mm_moe_verifies_in_float64_and_keeps_the_users_setting(example):
    model, reference = _phimoe(), _phimoe()
    assert model.get_experts_implementation() == {"": "grouped_mm"}
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    report = normswap.patch(model, (ids,) if example else None)
    assert report.verification["verify_dtype"] == "float64"
    assert "experts_implementation='eager'" in report.verification["verify_precision"]
    assert "'grouped_mm'" in report.plan.options["experts_implementation"]
    assert "working_dtype" not in report.plan.options  # no fallback to the model's float32
    sites = report.plan.sites
    assert [s.verdict for s in sites] == ["exact"] * 5, report.plan.table()
    assert all(s.error is not None and s.error <= 1e-9 for s in sites)
    assert report.verification["max_rel_error"] <= 1e-9
    # the user's model still runs its own experts code, and matches the original to float32 rounding
    assert model.get_experts_implementation() == {"": "grouped_mm"}
    other = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, want = model(other).logits, reference(other).logits
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


def test_a_float64_capable_implementation_is_left_alone():
    model = _phimoe()
    model.set_experts_implementation("batched_mm")
    report = normswap.patch(model, (torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3)),))
    assert report.verification["verify_dtype"] == "float64"
    assert "experts_implementation" not in report.plan.options
    assert "experts_implementation=" not in report.verification["verify_precision"]
    assert model.get_experts_implementation() == {"": "batched_mm"}
