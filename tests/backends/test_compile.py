"""``torch.compile`` through the CPU backend's custom op, and the op's registration (opcheck).

The triton ops get the same checks under the interpreter in test_triton_interpret.py.
"""

from __future__ import annotations

import pytest
import torch
from backend_ref import make_inputs

import normswap
from normswap.backends import cpu, eager

pytestmark = pytest.mark.skipif(not cpu.available()[0], reason="cpu kernel unavailable (no compiler)")


def test_opcheck_cpu_op():
    for dtype in (torch.float32, torch.bfloat16):
        x, w, b = make_inputs(6, (40,), dtype, bias=True, per_head=3, seed=1)
        torch.library.opcheck(torch.ops.normswap.cpu_rms_norm, (x, [40], w, b, 1e-6))
        torch.library.opcheck(torch.ops.normswap.cpu_rms_norm, (x, [3, 40], None, None, 1e-5))
        _, rstd = torch.ops.normswap.cpu_rms_norm(x, [40], w, b, 1e-6)
        dy = torch.randn(x.shape).to(dtype)
        for wt, bt in ((w, b), (None, None), (w, None)):
            torch.library.opcheck(torch.ops.normswap.cpu_rms_norm_bwd, (dy, x, rstd, [40], wt, bt, 1e-6))


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compile_fullgraph_dynamic_rows_no_recompile(compile_backend, dtype):
    torch._dynamo.reset()
    m = normswap.RMSNorm(48, bias=True, dtype=dtype)  # backend="auto" -> cpu on CPU
    with torch.no_grad():
        m.weight.normal_(1.0, 0.2)
        m.bias.normal_(0.0, 0.2)
    fn = torch.compile(lambda x: m(x) * 2, fullgraph=True, backend=compile_backend, dynamic=True)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows in (2, 9, 17):
            x = torch.randn(rows, 3, 48, dtype=dtype, requires_grad=True)
            y = fn(x)
            gy = torch.randn_like(y)
            got = torch.autograd.grad(y, (x, m.weight, m.bias), gy)
            ref_y = eager.rms_norm(x, (48,), m.weight, m.bias, m.eps) * 2
            ref = torch.autograd.grad(ref_y, (x, m.weight, m.bias), gy)
            assert torch.allclose(y.float(), ref_y.float(), atol=tol, rtol=tol)
            for a, r in zip(got, ref, strict=True):
                assert torch.allclose(a.float(), r.float(), atol=tol * 10, rtol=tol)


def test_compiled_graph_calls_the_custom_op():
    """The compiled graph contains our op (not an inlined eager fallback) and no graph break."""
    torch._dynamo.reset()
    seen = []

    def capture(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    m = normswap.RMSNorm(32)
    torch.compile(m, fullgraph=True, backend=capture)(torch.randn(4, 32))
    assert any("cpu_rms_norm" in t for t in seen), seen


def test_inference_under_no_grad_compiled():
    torch._dynamo.reset()
    m = normswap.RMSNorm(64, dtype=torch.bfloat16)
    fn = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fn(x), cpu.rms_norm(x, (64,), m.weight, None, m.eps))


def _exporting_seen_under_compile_and_export() -> tuple[list[bool], list[bool]]:
    from normswap.backends.tracing import exporting

    seen: list[bool] = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(exporting())
            return x + 1

    torch._dynamo.reset()
    torch.compile(Probe(), fullgraph=True, backend="eager")(torch.zeros(2))
    compiled, seen[:] = list(seen), []
    torch.export.export(Probe(), (torch.zeros(2),))
    return compiled, list(seen)


def test_the_export_path_is_for_export_not_for_compile():
    """normswap's export path (stock aten ops) runs under ``torch.export`` only; under ``torch.compile``
    the fused op stays in the graph (the test above)."""
    compiled, exported = _exporting_seen_under_compile_and_export()
    assert compiled == [False] and exported and all(exported), (compiled, exported)


def test_compile_keeps_the_custom_op_where_dynamo_says_it_is_exporting(monkeypatch):
    """torch 2.11's Dynamo replaced a traced ``torch.compiler.is_exporting()`` by the constant True under
    plain ``torch.compile`` too (pytorch/pytorch#176347, fixed in a later torch): there every compiled
    RMSNorm took the export path and the graph called ``torch.rms_norm`` (the GPU acceptance run,
    torch 2.11). Simulated here by giving Dynamo that rule; normswap must not depend on it."""
    from torch._dynamo.variables import torch as dynamo_torch
    from torch._dynamo.variables.constant import ConstantVariable

    handlers = dynamo_torch.TorchInGraphFunctionVariable._get_handlers()
    assert torch.compiler.is_exporting in handlers  # the rule being replaced (torch 2.13)
    monkeypatch.setitem(handlers, torch.compiler.is_exporting,
                        lambda self, tx, *args, **kwargs: ConstantVariable.create(True))
    said = []

    @torch.compile(fullgraph=True, backend="eager")
    def probe(x):
        said.append(torch.compiler.is_exporting())
        return x + 1

    torch._dynamo.reset()
    probe(torch.zeros(1))
    assert said == [True]  # the simulation took: Dynamo now says "exporting" under torch.compile
    test_compiled_graph_calls_the_custom_op()
    compiled, exported = _exporting_seen_under_compile_and_export()
    assert compiled == [False] and exported and all(exported), (compiled, exported)
    torch._dynamo.reset()
