"""Online Hadamards survive engines that replace ``nn.Linear`` (:mod:`normswap.rotation.carry`).

A DINOv2 replica in float64 (γ/β/λ randomised) with the ops alone (``rotate(model, "none", online=True)``):
its Linears replaced by a stand-in module that computes ``x @ Wᵀ + b`` the way the engines' modules do
(bitsandbytes' ``Linear4bit``, HQQ's ``HQQLinear``, quanto's ``QLinear``: a new module, no hooks). Swapped, the
model computes wrong outputs; its next call refuses, one line naming the module; ``carry_online_ops`` puts the
ops back and the model equals the original to 1e-9; ``normswap.save`` refuses a model missing an op before
writing anything. A native checkpoint loaded through ``from_pretrained(..., quantization_config=...)`` with a
stand-in quantizer that swaps the Linears before the weights load, as transformers' bitsandbytes integration
does, gets its ops back from the checkpoint and equals the original."""

import pytest
import torch
from torch import nn

import normswap
from normswap.errors import NormswapError
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.rotation import carry
from normswap.rotation.rotate import HADAMARD_BUFFER, rotate
from tests.benchmark_modules import tiny_dinov2

STANDIN = "normswap_test_standin"  # the stand-in quantizer's quant_method


class StandInLinear(nn.Module):
    """What an engine puts where a Linear was: a new module computing ``x @ Wᵀ + b`` (with the weight in the
    engine's format; here as is), no hooks, no buffers of the Linear's."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None, dtype=None) -> None:  # noqa: ANN001
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "StandInLinear":
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, device=linear.weight.device,
                  dtype=linear.weight.dtype)
        if linear.weight.device.type != "meta":
            with torch.no_grad():
                new.weight.copy_(linear.weight)
                if linear.bias is not None:
                    new.bias.copy_(linear.bias)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight.T
        return out + self.bias if self.bias is not None else out


def swap_linears(model: nn.Module) -> list[str]:
    """Replace every ``nn.Linear`` by a :class:`StandInLinear`, as the engines' replacement functions do
    (``setattr`` on the parent); returns the paths swapped."""
    paths = [p for p, m in model.named_modules() if isinstance(m, nn.Linear)]
    for path in paths:
        parent, _, name = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, name, StandInLinear.from_linear(getattr(owner, name)))
    return paths


def _run(model, probe, *, hooks=True):
    """The model's output; ``hooks=False``: what it computes past every refusal (the model's guard and the
    swapped modules' own, :class:`carry.Refuse`, taken off), i.e. what the swap gave before normswap guarded it."""
    if not hooks:
        for m in model.modules():
            carry.Refuse.disarm(m)
    with torch.no_grad(), default_dtype(torch.float64):
        out = model(**probe) if hooks else model.forward(**probe)  # forward(): past the model's own hooks
    return out.last_hidden_state


def _relative(out, ref):
    return float((out - ref).abs().max() / ref.abs().max())


def _online_model():
    model = tiny_dinov2(seed=3)
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    normswap.patch(model, beta_placement="keep")
    rotate(model, "none", online=True, seed=4)
    return model, probe, ref


def test_a_swap_drops_the_ops_the_next_call_refuses_and_carrying_them_back_is_exact():
    model, probe, ref = _online_model()
    assert _relative(_run(model, probe), ref) <= 1e-9
    assert sorted(carry.held_ops(model)) == sorted(
        [f"encoder.layer.{i}.mlp.{fc}" for i in range(2) for fc in ("fc1", "fc2")]
        + [f"encoder.layer.{i}.norm1" for i in range(2)])
    swapped = swap_linears(model)
    assert "encoder.layer.0.mlp.fc2" in swapped and carry.missing_online_ops(model) == [
        f"encoder.layer.{i}.mlp.{fc}" for i in range(2) for fc in ("fc1", "fc2")]  # norm1's ops stay: norms stay
    # what the engines' swap gave before: a model that runs, and computes wrong outputs
    assert _relative(_run(model, probe, hooks=False), ref) > 1e-3
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.0\.mlp\.fc1` \(StandInLinear\) has lost its online "
                                            r"Hadamard.*carry_online_ops.*\(3 other module\(s\) too\)$"):
        _run(model, probe)
    with pytest.raises(NormswapError, match="has lost its online Hadamard"):  # refused until the ops are back
        _run(model, probe)
    carried = carry.carry_online_ops(model)
    assert carried == [f"encoder.layer.{i}.mlp.{fc}" for i in range(2) for fc in ("fc1", "fc2")]
    assert isinstance(model.encoder.layer[0].mlp.fc2, StandInLinear)
    assert _relative(_run(model, probe), ref) <= 1e-9
    assert id(model.encoder.layer[0].mlp.fc2) in _watched(model)  # the guard now watches the carried modules
    assert carry.carry_online_ops(model) == []  # nothing left to carry: harmless twice


def test_block_diagonal_ops_are_carried_with_their_block_factor():
    """``online_block`` ops (round 50) store ``H_b`` itself as the factor: the carry must keep that layout."""
    model = tiny_dinov2(seed=3)
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    normswap.patch(model, beta_placement="keep")
    rotate(model, "none", online=True, seed=4, online_block=4)
    fc2 = model.encoder.layer[0].mlp.fc2
    assert getattr(fc2, HADAMARD_BUFFER).shape == (4, 4)
    swap_linears(model)
    assert _relative(_run(model, probe, hooks=False), ref) > 1e-3
    carry.carry_online_ops(model)
    assert isinstance(model.encoder.layer[0].mlp.fc2, StandInLinear)
    assert getattr(model.encoder.layer[0].mlp.fc2, HADAMARD_BUFFER).shape == (4, 4)
    assert _relative(_run(model, probe), ref) <= 1e-9


def _guard(model):
    (guard,) = [h for h in model._forward_pre_hooks.values() if isinstance(h, carry.OpsGuard)]
    return guard


def _watched(model):
    """Ids of what the model's guard watches: the modules on the way to each op, the ops' hooks and hook
    dictionaries."""
    return {id(e[2]) for e in _guard(model).entries}


def test_a_model_nobody_swapped_runs_no_check_beyond_the_identity_comparison(monkeypatch):
    """The guard's per-call work is one comparison of the watched modules; the full check runs only when one
    changed (its cost per call: benchmarks/online_guard_cost.py)."""
    model, probe, ref = _online_model()
    assert list(model._forward_pre_hooks.values()) == [_guard(model)]  # one hook on the model, nothing else
    monkeypatch.setattr(carry, "check_online_ops", lambda m: pytest.fail("the full check ran on an unswapped model"))
    for _ in range(2):
        assert _relative(_run(model, probe), ref) <= 1e-9


def test_save_refuses_a_model_missing_an_op_and_writes_nothing(tmp_path):
    model, probe, ref = _online_model()
    model.encoder.layer[1].mlp.fc2 = StandInLinear.from_linear(model.encoder.layer[1].mlp.fc2)
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.1\.mlp\.fc2` \(StandInLinear\) has lost"):
        normswap.save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_an_op_whose_values_were_never_loaded_is_refused_not_invented():
    model, probe, ref = _online_model()
    held = carry.held_ops(model)["encoder.layer.0.mlp.fc1"]
    held.buffers = {k: torch.empty_like(v, device="meta") for k, v in held.buffers.items()}
    held.live = dict(held.buffers)  # as a loader's module holds them: on the meta device, never loaded
    model.encoder.layer[0].mlp.fc1 = StandInLinear.from_linear(model.encoder.layer[0].mlp.fc1)
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.0\.mlp\.fc1` \(StandInLinear\) lost its online "
                                            "Hadamard and the op's values were never loaded"):
        carry.carry_online_ops(model)
    assert not hasattr(model.encoder.layer[0].mlp.fc1, HADAMARD_BUFFER)


def test_a_wrapper_that_calls_the_original_linear_keeps_the_op_and_is_left_alone():
    model, probe, ref = _online_model()

    class Wrapper(nn.Module):  # PEFT's LoRA layers call the Linear they wrap as `base_layer`
        def __init__(self, base: nn.Module) -> None:
            super().__init__()
            self.base_layer = base

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base_layer(x)

    model.encoder.layer[0].mlp.fc2 = Wrapper(model.encoder.layer[0].mlp.fc2)
    assert carry.missing_online_ops(model) == [] and carry.carry_online_ops(model) == []
    assert _relative(_run(model, probe), ref) <= 1e-9


def _register_standin_quantizer():
    from transformers.quantizers.auto import (
        AUTO_QUANTIZATION_CONFIG_MAPPING,
        AUTO_QUANTIZER_MAPPING,
        register_quantization_config,
        register_quantizer,
    )
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    if STANDIN in AUTO_QUANTIZER_MAPPING:
        return AUTO_QUANTIZATION_CONFIG_MAPPING[STANDIN]

    @register_quantization_config(STANDIN)
    class StandInConfig(QuantizationConfigMixin):
        def __init__(self, **kwargs) -> None:  # noqa: ANN003
            self.quant_method = STANDIN

    @register_quantizer(STANDIN)
    class StandInQuantizer(HfQuantizer):
        """Swaps every ``nn.Linear`` for a :class:`StandInLinear` before the weights load, on the meta device,
        as transformers' bitsandbytes integration swaps in ``Linear4bit``; the weights load into it as they
        are (nothing to quantize)."""

        requires_calibration = False

        def _process_model_before_weight_loading(self, model, **kwargs) -> None:  # noqa: ANN001, ANN003
            swap_linears(model)

        def is_serializable(self) -> bool:
            return False

        @property
        def is_trainable(self) -> bool:
            return False

    return StandInConfig


def test_a_quantization_config_that_swaps_linears_before_loading_gets_the_ops_back(tmp_path):
    from transformers import AutoModel

    config_cls = _register_standin_quantizer()
    model, probe, ref = _online_model()
    normswap.save(model, tmp_path / "ckpt")
    loaded = AutoModel.from_pretrained(tmp_path / "ckpt", quantization_config=config_cls(), dtype=torch.float64)
    fc2 = loaded.encoder.layer[1].mlp.fc2
    # the registered quantizer's class: by name, since this module may be imported twice (test_online_guard_gaps)
    assert type(fc2).__name__ == "StandInLinear" and carry.holds_op(fc2)
    assert torch.equal(getattr(fc2, HADAMARD_BUFFER), getattr(model.encoder.layer[1].mlp.fc2, HADAMARD_BUFFER))
    assert id(fc2) in _watched(loaded)  # the loader's carry: the guard watches the engine's modules
    assert _relative(_run(loaded, probe), ref) <= 1e-9
    loaded = normswap.load(tmp_path / "ckpt", quantization_config=config_cls(), dtype=torch.float64)
    assert type(loaded.encoder.layer[0].mlp.fc1).__name__ == "StandInLinear"
    assert _relative(_run(loaded, probe), ref) <= 1e-9


# ------------------------------------------------------------------ round 51: swaps the garbage collector never sees
def test_a_swap_whose_old_module_is_still_referenced_is_refused_at_the_next_call():
    """The old Linear kept alive (a list, a closure, an engine's own bookkeeping) is never freed: the guard
    compares the module instances, so it refuses anyway, before the model runs."""
    model, probe, ref = _online_model()
    kept = [model.encoder.layer[0].mlp.fc1, model.encoder.layer[1].mlp.fc2]
    model.encoder.layer[0].mlp.fc1 = StandInLinear.from_linear(kept[0])
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.0\.mlp\.fc1` \(StandInLinear\) has lost its online"):
        _run(model, probe)
    carry.carry_online_ops(model)
    assert _relative(_run(model, probe), ref) <= 1e-9
    # a write into `_modules` (torch.ao's eager quantization swaps that way), the old module still referenced
    mlp = model.encoder.layer[1].mlp
    mlp._modules["fc2"] = StandInLinear.from_linear(kept[1])
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.1\.mlp\.fc2` \(StandInLinear\) has lost"):
        _run(model, probe)
    # a swap of a module above the op (the whole MLP rebuilt), the old one referenced
    old_mlp = model.encoder.layer[0].mlp
    model.encoder.layer[0].mlp = type(old_mlp)(model.config).double()
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.0\.mlp\.fc1` \(Linear\) has lost"):
        _run(model, probe)
    assert kept and old_mlp is not None


def test_a_deep_copy_is_guarded_as_its_own_model():
    """``copy.deepcopy`` copies the guard with the model, and the copy's guard watches the copy's modules: a
    swap in the copy is refused at the copy's next call; the original is untouched and still exact."""
    import copy
    import gc

    model, probe, ref = _online_model()
    twin = copy.deepcopy(model)
    assert _guard(twin) is not _guard(model) and _watched(twin).isdisjoint(_watched(model))
    twin.encoder.layer[0].mlp.fc1 = StandInLinear.from_linear(twin.encoder.layer[0].mlp.fc1)
    gc.collect()
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.0\.mlp\.fc1` \(StandInLinear\) has lost"):
        _run(twin, probe)
    assert _relative(_run(model, probe), ref) <= 1e-9
    assert carry.carry_online_ops(twin) == ["encoder.layer.0.mlp.fc1"]
    assert _relative(_run(twin, probe), ref) <= 1e-9
    assert carry.holds_op(model.encoder.layer[0].mlp.fc1)  # the original's op was not moved to the copy


def test_torch_compile_traces_the_guard_a_swap_before_or_after_compiling_is_refused():
    """Dynamo evaluates the guard's comparison while tracing (nothing of it reaches the graph) and guards on
    the modules it read: a model swapped before compiling is refused at the first compiled call, one swapped
    after compiling recompiles and is refused there, and once the ops are carried back it is exact again."""
    torch._dynamo.reset()
    model, probe, ref = _online_model()
    compiled = torch.compile(model)
    assert _relative(_run(compiled, probe), ref) <= 1e-9
    model.encoder.layer[1].mlp.fc2 = StandInLinear.from_linear(model.encoder.layer[1].mlp.fc2)
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.1\.mlp\.fc2` \(StandInLinear\) has lost"):
        _run(compiled, probe)
    carry.carry_online_ops(model)
    assert _relative(_run(compiled, probe), ref) <= 1e-9

    torch._dynamo.reset()
    model, probe, ref = _online_model()
    model.encoder.layer[0].mlp.fc1 = StandInLinear.from_linear(model.encoder.layer[0].mlp.fc1)
    # Dynamo's tracing is what meets the guard, whatever the backend: the eager one keeps this part quick
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.0\.mlp\.fc1` \(StandInLinear\) has lost"):
        _run(torch.compile(model, backend="eager"), probe)
    # fullgraph=True: Dynamo reports the refusal as its own error, which carries the line; no output either
    with pytest.raises(Exception, match=r"has lost its online Hadamard"):
        _run(torch.compile(model, fullgraph=True, backend="eager"), probe)
    torch._dynamo.reset()


def test_torch_ao_dynamic_quantization_is_refused_then_carried_without_running_the_op_twice():
    """torch.ao's ``quantize_dynamic`` deep-copies the model, writes its int8 Linears into ``_modules`` and copies
    each Linear's pre-hooks onto them, without the op's buffers: refused at the next call (not an
    ``AttributeError`` from inside the op); carried, the op runs once and the error is int8 rounding."""
    import warnings

    from torch.ao.quantization import quantize_dynamic

    model, probe, ref = _online_model()
    model, probe, ref = model.float(), {k: v.float() for k, v in probe.items()}, ref.float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.0\.mlp\.fc1` \(Linear\) has lost its online"):
        _run(q, probe)
    assert carry.carry_online_ops(q) == [f"encoder.layer.{i}.mlp.{fc}" for i in range(2) for fc in ("fc1", "fc2")]
    fc1 = q.encoder.layer[0].mlp.fc1
    assert type(fc1).__module__.startswith("torch.ao.nn.quantized") and len(fc1._forward_pre_hooks) == 1
    assert 1e-4 < _relative(_run(q, probe), ref) < 0.02
    assert _relative(_run(model, probe), ref) <= 1e-6  # the float model it copied is untouched


def test_a_module_above_the_ops_replaced_by_one_that_lacks_an_op_is_refused_even_when_told():
    """Replacing the MLP by one whose ``fc1`` keeps its op and whose ``fc2`` does not: the guard is told of the
    assignment (torch's module-registration hook) and must not take the new MLP as carrying both ops."""
    model, probe, ref = _online_model()
    layer = model.encoder.layer[1]
    fresh = type(layer.mlp)(model.config).double()
    fresh.fc1 = layer.mlp.fc1  # the op's module, moved over
    layer.mlp = fresh
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.1\.mlp\.fc2` \(Linear\) has lost"):
        _run(model, probe)


def test_a_model_pickled_whole_keeps_its_guard():
    """``torch.save(model)`` / ``torch.load``: the guard travels with the model and watches the loaded modules."""
    import io

    model, probe, ref = _online_model()
    buf = io.BytesIO()
    torch.save(model, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert _relative(_run(loaded, probe), ref) <= 1e-9
    loaded.encoder.layer[0].mlp.fc2 = StandInLinear.from_linear(loaded.encoder.layer[0].mlp.fc2)
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.0\.mlp\.fc2` \(StandInLinear\) has lost"):
        _run(loaded, probe)
