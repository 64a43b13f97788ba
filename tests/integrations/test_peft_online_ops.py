"""PEFT adapters on Linears that run an online Hadamard (:mod:`normswap.rotation.carry`, round 51).

The op is a pre-hook on the Linear and its weight holds ``W·M`` (the op takes ``x`` to ``x·M``). PEFT's LoRA
layer calls that Linear as its ``base_layer``, so the op keeps running and the adapter reads the input before
it, as the Linear's caller sees it: the unmerged model is right. PEFT's merge adds the adapter's update ``ΔW``
to the weight, which is in the op's basis: without a turn the merged model computes ``x·M·ΔWᵀ`` where it
computed ``x·ΔWᵀ`` (relative error 0.77 on this replica before round 51). Since round 51 the adapter layer that
wraps such a Linear merges ``ΔW·M``: ``merge_and_unload`` and ``merge_adapter`` / ``unmerge_adapter`` are
exact, with and without a call between wrapping and merging, for ``nn.Linear`` and GPT-2's ``Conv1D``.

Float64 replicas, LayerNorm γ/β randomised; adapters with random (non-zero) ``B``."""

from __future__ import annotations

import pytest
import torch

import normswap
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.rotation import carry
from normswap.rotation.rotate import rotate
from tests.benchmark_modules import tiny_dinov2
from tests.zoo import EXACT, build

peft = pytest.importorskip("peft")


def _out(model, probe):
    with torch.no_grad(), default_dtype(torch.float64):
        out = model(**probe)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _relative(out, ref):
    return float((out - ref).abs().max() / ref.abs().max())


def _online_dinov2():
    model = tiny_dinov2(seed=3)
    probe = hf_example_inputs(model, seed=5)
    normswap.patch(model, beta_placement="keep")
    rotate(model, "none", online=True, seed=4)
    return model, probe


def _lora(model, targets, **kw):
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False, **kw))


def test_merge_and_unload_of_a_lora_on_linears_with_ops_is_exact():
    model, probe = _online_dinov2()
    lora = _lora(model, ["fc1", "fc2", "query"])  # fc1/fc2 run an op; query reads norm1's shared op
    ref = _out(lora, probe)
    merged = lora.merge_and_unload()
    fc1 = merged.encoder.layer[0].mlp.fc1
    assert type(fc1) is torch.nn.Linear and carry.holds_op(fc1)  # the merged Linear keeps its op
    assert _relative(_out(merged, probe), ref) <= 1e-9
    assert carry.missing_online_ops(merged) == []


def test_an_adapter_loaded_and_merged_without_a_call_between_is_exact(tmp_path):
    """``PeftModel.from_pretrained(base, dir).merge_and_unload()``: no forward call while the adapter is in."""
    model, probe = _online_dinov2()
    lora = _lora(model, ["fc1", "fc2"])
    ref = _out(lora, probe)
    lora.save_pretrained(tmp_path / "adapter")
    base, _ = _online_dinov2()
    merged = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload()
    assert _relative(_out(merged, probe), ref) <= 1e-9


def test_merge_adapter_and_unmerge_adapter_round_trip():
    model, probe = _online_dinov2()
    weight = model.encoder.layer[1].mlp.fc2.weight.detach().clone()
    lora = _lora(model, ["fc2"])
    ref = _out(lora, probe)
    lora.merge_adapter()
    assert _relative(_out(lora, probe), ref) <= 1e-9
    lora.unmerge_adapter()
    assert torch.allclose(lora.get_base_model().encoder.layer[1].mlp.fc2.weight, weight, rtol=0, atol=1e-12)
    assert _relative(_out(lora, probe), ref) <= 1e-9


def test_a_lora_on_gpt2_conv1d_with_ops_merges_exactly():
    """GPT-2's ``Conv1D`` stores its weight ``[in, out]`` (PEFT's ``fan_in_fan_out``): the update is turned along
    its input axis."""
    model = build(EXACT, "gpt2")
    normswap.patch(model, beta_placement="keep")
    rotate(model, "none", online=True, seed=1)
    assert carry.holds_op(model.transformer.h[0].mlp.c_proj)
    probe = {"input_ids": torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])}
    lora = _lora(model, ["c_proj", "c_fc"], fan_in_fan_out=True)
    ref = _out(lora, probe)
    merged = lora.merge_and_unload()
    assert _relative(_out(merged, probe), ref) <= 1e-9


def test_a_dora_adapter_on_a_linear_with_an_op_is_refused_at_merge_before_that_layer_changes():
    """DoRA merges ``m/‖W + ΔW‖ · (W + ΔW)`` with the norm taken in the op's basis in its forward (mixed: the
    base weight turned, the update not), which no turn of the update reproduces: refused, one line."""
    from normswap.errors import NormswapError

    model, probe = _online_dinov2()
    lora = _lora(model, ["fc1"], use_dora=True)
    fc1 = lora.get_base_model().encoder.layer[0].mlp.fc1.base_layer
    weight = fc1.weight.detach().clone()
    with pytest.raises(NormswapError, match=r"^adapter `default` is a DoraLinearVariant on a Linear that runs an "
                                            r"online Hadamard: it cannot be merged exactly"):
        lora.merge_and_unload()
    assert torch.equal(fc1.weight, weight)  # the first layer to merge refused before its weight changed


def test_torch_compile_fullgraph_runs_a_lora_model_and_its_merge():
    """The guard is told when PEFT wraps the op's Linear (and unwraps it at merge), as the assignment happens:
    the next call finds nothing changed, so ``fullgraph=True`` traces without running the full check."""
    import copy

    torch._dynamo.reset()
    model, probe = _online_dinov2()
    torch.manual_seed(0)
    ref = _out(_lora(copy.deepcopy(model), ["fc1", "fc2"]), probe)
    torch.manual_seed(0)  # the same adapter again, on a deep copy (whose guard is told too); no eager call
    lora = _lora(copy.deepcopy(model), ["fc1", "fc2"])
    assert _relative(_out(torch.compile(lora, fullgraph=True, backend="eager"), probe), ref) <= 1e-9
    merged = lora.merge_and_unload()
    assert _relative(_out(torch.compile(merged, fullgraph=True, backend="eager"), probe), ref) <= 1e-9
    torch._dynamo.reset()
