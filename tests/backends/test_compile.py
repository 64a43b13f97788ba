"""``torch.compile`` on CPU: ``auto`` gives inductor a decomposable norm (which it fuses with the
ops around it); ``backend="cpu"`` keeps the CPU backend's custom op, checked here with its registration
(opcheck).

The triton ops get the same checks under the interpreter in test_triton_interpret.py.
"""

from __future__ import annotations

import pytest
import torch
from backend_ref import make_inputs

import normswap
from normswap import backends
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


# auto: the decomposed ops (inductor in float32 only: an inductor compile costs ~10 s); cpu: the custom op
@pytest.mark.parametrize(("compile_backend", "dtype", "backend"), [
    *((c, d, "cpu") for c in ("aot_eager", "inductor") for d in (torch.float32, torch.bfloat16)),
    ("aot_eager", torch.float32, "auto"), ("aot_eager", torch.bfloat16, "auto"),
    ("inductor", torch.float32, "auto"),
])
def test_compile_fullgraph_dynamic_rows_no_recompile(compile_backend, dtype, backend):
    torch._dynamo.reset()
    m = normswap.RMSNorm(48, bias=True, dtype=dtype, backend=backend)
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


def _compiled_targets(m: torch.nn.Module, x: torch.Tensor) -> list[str]:
    """The ops Dynamo hands the compiler for ``m(x)`` (fullgraph: no graph break)."""
    torch._dynamo.reset()
    seen: list[str] = []

    def capture(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch.compile(m, fullgraph=True, backend=capture)(x)
    return seen


def test_compiled_graph_calls_the_custom_op():
    """Asked for explicitly, the cpu backend is our op in the compiled graph (not an inlined eager
    fallback), with no graph break."""
    seen = _compiled_targets(normswap.RMSNorm(32, backend="cpu"), torch.randn(4, 32))
    assert any("cpu_rms_norm" in t for t in seen), seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_auto_under_compile_on_cpu_is_decomposable(dtype, monkeypatch):
    """Under torch.compile on CPU ``auto`` picks a path inductor decomposes and fuses with the residual add
    and the bias around it (issue 40: the fused C++ kernel, an opaque extern call to inductor, made a
    compiled GPT-2 5% slower than its LayerNorm original); eager mode keeps the C++ kernel."""
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    backends.refresh()
    rows, n = 128, 768
    want = "native" if dtype in (torch.float32, torch.float64) else "eager"
    assert backends.select_for("cpu", dtype, rows, n, graph=True)[0] == want
    assert backends.select_for("cpu", dtype, rows, n, bias=True, grad=True, graph=True)[0] == want
    if dtype in cpu.kernel().dtypes:
        assert backends.select_for("cpu", dtype, rows, n)[0] == "cpu"  # eager: the fused kernel
    m = normswap.RMSNorm(n, bias=True, dtype=dtype)
    seen = _compiled_targets(m, torch.randn(4, n, dtype=dtype))
    assert not any("normswap" in t for t in seen), seen
    assert any("rms_norm" in t or "rsqrt" in t for t in seen), seen
    if dtype in cpu.kernel().dtypes:
        assert backends.resolve("auto", torch.randn(4, n, dtype=dtype), m.weight, m.bias) is cpu  # eager


def test_inference_under_no_grad_compiled():
    torch._dynamo.reset()
    m = normswap.RMSNorm(64, dtype=torch.bfloat16, backend="cpu")
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
