"""``normswap.integrations.executorch.delegable_program``: the XNNPACK form applied to an already exported program.

No ExecuTorch here: what is asserted is the rewritten ``ExportedProgram`` (torch alone). The rewrite must leave no
``aten.rms_norm`` and no reduction, compute each norm's mean of squares as one product with a ``1/n`` constant of
the program (a buffer, not an op-made tensor, which XNNPACK would leave outside its delegate), record what
``delegable_norms`` records at export, and leave the input program and its state dict as they were.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

import normswap
from normswap.integrations.executorch import DELEGABLE_FORMS, delegable_norms, delegable_program
from tests.integrations.test_executorch_form import REDUCTIONS, _converted, _export, _norms, _ops, assert_agrees


def _products(ep: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The nodes that read one of the rewrite's ``1/n`` constants."""
    consts = {p for p, b in ep.graph_signature.inputs_to_buffers.items() if "normswap_mean_weight" in b}
    return [n for n in ep.graph.nodes if n.op == "call_function"
            and any(isinstance(a, torch.fx.Node) and a.name in consts for a in n.args)]


def _reductions(ep: torch.export.ExportedProgram) -> Counter:
    return Counter(t for t in _ops(ep) if t.startswith("aten.") and t.split(".")[1] in REDUCTIONS)


@functools.cache
def _default(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.export.ExportedProgram]:
    """The converted model, its inputs and its default export, made once per model for the tests that rewrite it
    (an export is seconds of CPU): each of them asserts that the rewrite left the program it was given as it was,
    so a rewrite that changed it fails there rather than hiding behind the sharing."""
    model, inputs = _converted(name)
    return model, inputs, _export(model, name, inputs)


@pytest.mark.parametrize("name", ["gpt2", "vit"])
@pytest.mark.parametrize("form", DELEGABLE_FORMS)
def test_rewrite_holds_no_reduction_and_equals_the_default(name, form):
    model, inputs, default = _default(name)
    before = _ops(default)
    count = before.count("aten.rms_norm.default")
    assert count == _norms(model) > 0  # the default form: one aten.rms_norm per norm
    ep = delegable_program(default, form)
    # the norms' reductions are gone; the model's others (GPT-2's embedding centering: a mean) stay
    assert _reductions(ep) + Counter({"aten.rms_norm.default": count}) == _reductions(default)
    products = _products(ep)
    expected = {"addmm": "aten.addmm.default", "mm": "aten.mm.default", "linear": "aten.linear.default"}[form]
    assert len(products) == count and {str(n.target) for n in products} == {expected}
    assert _ops(default) == before  # the input program is not modified
    assert list(ep.state_dict) == list(default.state_dict)  # the constants are not persistent
    assert_agrees(ep, default, model, name, inputs)


@pytest.mark.parametrize("name", ["gpt2", "vit"])
def test_rewrite_records_what_delegable_norms_records(name):
    default = _default(name)[2]
    before = _ops(default)
    rewritten = delegable_program(default)
    assert _ops(default) == before
    model, inputs = _converted(name)  # its own model: delegable_norms changes it while it exports
    with delegable_norms(model):
        at_export = _export(model, name, inputs)
    skip = {"aten._assert_tensor_metadata.default", "aten.to.dtype"}  # casts either export may record
    assert Counter(t for t in _ops(rewritten) if t not in skip) == Counter(t for t in _ops(at_export) if t not in skip)


def test_torch_rms_norm_eps_none_weightless_float32_and_dynamic_shapes():
    """Any ``aten.rms_norm``: ``torch.nn.RMSNorm`` with ``eps=None`` (the dtype's epsilon) and without a weight."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.RMSNorm(32), torch.nn.Linear(32, 32),
                                torch.nn.RMSNorm(32, eps=1e-5, elementwise_affine=False)).eval()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
    x = torch.randn(1, 6, 32) * 1e-3  # small rows: eps is a visible share of the mean of squares
    seq = torch.export.Dim("seq", min=2, max=64)
    default = torch.export.export(model, (x,), dynamic_shapes=({1: seq},))
    with pytest.raises(ValueError, match=r"^delegable_program: the program was exported with dynamic shapes; pass"):
        delegable_program(default)  # exported again without them, it would silently become static
    ep = delegable_program(default, dynamic_shapes=({1: seq},))
    assert "aten.rms_norm.default" not in _ops(ep) and len(_products(ep)) == 2
    eps = sorted(float(v) for k, v in ep.constants.items() if "normswap_eps" in k)  # non-persistent buffers
    assert eps == pytest.approx([torch.finfo(torch.float32).eps, 1e-5], rel=1e-6)
    for length in (6, 11):
        y = torch.randn(1, length, 32) * 1e-3
        with torch.no_grad():
            ref = model(y)
            assert (ep.module()(y) - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_without_rms_norm_the_program_itself_and_misuse_is_one_line():
    linear = torch.nn.Linear(4, 4)
    ep = torch.export.export(linear, (torch.randn(2, 4),))
    assert delegable_program(ep) is ep
    norm = normswap.RMSNorm(8)
    with pytest.raises(ValueError, match=r"^delegable_program: unknown form 'sum' \(one of addmm, mm, linear\)$"):
        delegable_program(torch.export.export(norm, (torch.randn(2, 8),)), "sum")
