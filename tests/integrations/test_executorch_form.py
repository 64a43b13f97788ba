"""``normswap.integrations.executorch.delegable_norms``: the export form ExecuTorch's XNNPACK backend delegates whole.

No ExecuTorch here (not a test dependency): what is asserted is what ``torch.export`` records. XNNPACK's
partitioner takes no 3-D ``mean``; inside the context each norm's mean of squares must be a matrix product with
a constant ``1/n`` column, and ``XNNPACKQuantizer`` annotates ``linear`` and ``mul`` (not ``addmm``, ``pow``), so
the default form's reduction must be ``addmm(eps, pow(x, 2), column)``. The measured effect on ExecuTorch is in
benchmarks/executorch_gpt2_speed.py and docs/results/deploy-speed.md.
"""

from __future__ import annotations

import copy

import pytest
import torch

import normswap
from normswap.integrations.executorch import DELEGABLE_FORMS, delegable_norms
from tests.integrations.compat import example_inputs, first_output, tensor_inputs
from tests.zoo import EXACT, build

REDUCTIONS = ("mean", "sum", "rms_norm", "layer_norm", "var", "norm")


def _converted(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny float64 converted model (LayerNorm γ/β randomised by the zoo) and its tensor inputs."""
    model = build(EXACT, name)
    normswap.patch(model, calibration=False)
    model = model.double().eval()
    inputs = example_inputs(name, model)
    if name == "gpt2":
        inputs = tensor_inputs(inputs)
    return model, inputs


class _Call(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, name: str) -> None:
        super().__init__()
        self.model = model
        self.extra = {"use_cache": False} if name == "gpt2" else {}

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return first_output(self.model(**inputs, **self.extra))


def _export(model: torch.nn.Module, name: str, inputs: dict[str, torch.Tensor]) -> torch.export.ExportedProgram:
    return torch.export.export(_Call(model, name), (), kwargs=inputs)


def _ops(ep: torch.export.ExportedProgram) -> list[str]:
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


def _norm_nodes(ep: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The aten ops recorded inside a ``normswap.RMSNorm`` (the innermost module of their ``nn_module_stack``)."""
    out = []
    for n in ep.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        if n.op == "call_function" and str(n.target).startswith("aten.") and stack:
            inner = str(list(stack.values())[-1][1])
            if inner.endswith("RMSNorm"):
                out.append(n)
    return out


def assert_agrees(ep: torch.export.ExportedProgram, default: torch.export.ExportedProgram, model: torch.nn.Module,
                  name: str, inputs: dict[str, torch.Tensor]) -> None:
    """``ep`` computes what the default-form program and the eager float64 model compute, to 1e-12 relative."""
    with torch.no_grad():
        got = ep.module()(**inputs)
        ref = default.module()(**inputs)
        eager = _Call(model, name)(**inputs)
    assert got.dtype == torch.float64
    assert (got - ref).abs().max() <= 1e-12 * ref.abs().max()
    assert (got - eager).abs().max() <= 1e-12 * eager.abs().max()


def _norms(model: torch.nn.Module) -> int:
    return sum(isinstance(m, normswap.RMSNorm) for m in model.modules())


@pytest.mark.parametrize("name", ["gpt2", "vit"])
@pytest.mark.parametrize("form", DELEGABLE_FORMS)
def test_form_holds_no_reduction_and_equals_default(name, form):
    model, inputs = _converted(name)
    default = _export(model, name, inputs)
    assert "aten.rms_norm.default" in [str(n.target) for n in _norm_nodes(default)]  # the check can fail
    with delegable_norms(model, form) as count:
        ep = _export(model, name, inputs)
    assert count == _norms(model) > 0
    in_norms = [str(n.target) for n in _norm_nodes(ep)]
    assert len(in_norms) >= 5 * count
    assert not [t for t in in_norms if any(r in t.split(".")[1] for r in REDUCTIONS)], in_norms
    # each norm's reduction: one matrix product whose weight is that norm's 1/n buffer
    buffers = ep.graph_signature.inputs_to_buffers
    mean_inputs = {p for p, b in buffers.items() if b.endswith("export_mean_weight")}
    products = [n for n in ep.graph.nodes if n.op == "call_function"
                and any(str(a) in mean_inputs for a in n.args if isinstance(a, torch.fx.Node))]
    assert len(products) == count
    expected = {"addmm": "aten.addmm.default", "mm": "aten.mm.default", "linear": "aten.linear.default"}[form]
    assert {str(n.target) for n in products} == {expected}
    # the squares are pow (left in float by XNNPACKQuantizer, which annotates mul)
    assert {str(n.args[0].target) if form == "mm" or form == "linear" else str(n.args[1].target)
            for n in products} == {"aten.pow.Tensor_Scalar"}
    assert_agrees(ep, default, model, name, inputs)


def test_float32_and_bfloat16_round_like_the_default():
    torch.manual_seed(0)
    norm = normswap.RMSNorm(48, eps=1e-5, bias=True)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_(0, 0.3)
    for dtype in (torch.float32, torch.bfloat16):
        module = copy.deepcopy(norm).to(dtype)
        x = (torch.randn(2, 5, 48) * 3).to(dtype)
        with delegable_norms(module):
            ep = torch.export.export(module, (x,))
        got = ep.module()(x)
        ref = torch.export.export(module, (x,)).module()(x)
        assert got.dtype == dtype
        tol = 1e-6 if dtype == torch.float32 else 1e-2  # 1/n's rounding; bf16: at most one output ulp apart
        assert (got.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()


def test_restored_after_the_context_and_after_an_error():
    model, inputs = _converted("vit")
    keys = list(model.state_dict())
    buffers = [n for n, _ in model.named_buffers()]
    with delegable_norms(model):
        assert len([n for n, _ in model.named_buffers()]) == len(buffers) + 2 * _norms(model)
        assert list(model.state_dict()) == keys  # the constants are not persistent
    assert [n for n, _ in model.named_buffers()] == buffers
    assert all("export_form" not in vars(m) for m in model.modules())
    assert any("rms_norm" in t for t in _ops(_export(model, "vit", inputs)))  # the default form again

    with pytest.raises(ValueError, match="channel dimension"), delegable_norms(model):  # export raises inside
        _export(model, "vit", {"pixel_values": torch.randn(2, 5, 32, 32, dtype=torch.float64)})
    assert [n for n, _ in model.named_buffers()] == buffers
    assert all(m.export_form is None for m in model.modules() if isinstance(m, normswap.RMSNorm))


def test_eager_calls_inside_the_context_are_unchanged():
    model, inputs = _converted("gpt2")
    call = _Call(model, "gpt2")
    with torch.no_grad():
        ref = call(**inputs)
        with delegable_norms(model):
            got = call(**inputs)
    assert torch.equal(got, ref)


def test_misuse_is_one_clear_line():
    with pytest.raises(ValueError, match=r"^delegable_norms: Linear has no normswap.RMSNorm \(convert it first"):
        with delegable_norms(torch.nn.Linear(4, 4)):
            pass
    norm = normswap.RMSNorm(8)
    with pytest.raises(ValueError, match=r"^delegable_norms: unknown form 'sum' \(one of addmm, mm, linear\)$"):
        with delegable_norms(norm, "sum"):
            pass
    with delegable_norms(norm):
        with pytest.raises(ValueError, match="already inside delegable_norms"):
            with delegable_norms(norm):
                pass
        assert norm.export_form == "addmm"  # the refused inner context left the outer one's state
    assert norm.export_form is None and not hasattr(norm, "export_eps")


def test_strict_export_records_the_form_and_the_default_after():
    """Dynamo's strict capture reads the form from the module like the default (non-strict) export does."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), normswap.RMSNorm(16, eps=1e-5)).eval()
    x = torch.randn(2, 3, 16)
    with delegable_norms(model):
        inside = {str(n.target) for n in torch.export.export(model, (x,), strict=True).graph.nodes}
    after = {str(n.target) for n in torch.export.export(model, (x,), strict=True).graph.nodes}
    assert "aten.addmm.default" in inside and "aten.rms_norm.default" not in inside
    assert "aten.rms_norm.default" in after and "aten.addmm.default" not in after
