"""CUDA-only checks of the triton backend at real sizes (skipped without a GPU).

Speed is not asserted here (benchmarks/bench_ops.py --device cuda measures it); these check that the
compiled kernels agree with the float64 reference at shapes the interpreter is too slow for, that
dW is deterministic on the device, and that torch.compile with inductor keeps the custom ops.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from backend_ref import check_against_reference

import normswap
from normswap import backends
from normswap.backends import eager
from normswap.backends import triton as tb

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4096, 768), (2048, 4096), (33, 8192), (7, 32768), (1000, 3)])
def test_forward_backward_large(dtype, shape):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", generator=g).to(dtype).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda", generator=g)).to(dtype).requires_grad_(True)
    b = (0.1 * torch.randn(shape[-1], device="cuda", generator=g)).to(dtype).requires_grad_(True)
    y = tb.rms_norm(x, (shape[-1],), w, b, 1e-6)
    check_against_reference(y, x, (shape[-1],), w, b, 1e-6, f"cuda {dtype}")
    gy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w, b), gy)
    x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    ref = torch.autograd.grad(eager.rms_norm(x64, (shape[-1],), w64, b64, 1e-6), (x64, w64, b64), gy.double())
    base = torch.autograd.grad(eager.rms_norm(x, (shape[-1],), w, b, 1e-6), (x, w, b), gy)
    for a, r, c in zip(got, ref, base, strict=True):
        err, err0 = (a.double() - r).abs().max().item(), (c.double() - r).abs().max().item()
        assert err <= 2 * err0 + 5e-2 * (shape[0] ** 0.5), (err, err0)


def test_dweight_deterministic_on_device():
    x = torch.randn(8192, 1024, device="cuda", requires_grad=True)
    w = torch.ones(1024, device="cuda", requires_grad=True)
    gy = torch.randn_like(x)
    first = torch.autograd.grad(tb.rms_norm(x, (1024,), w, None, 1e-6), (w,), gy)[0]
    again = torch.autograd.grad(tb.rms_norm(x, (1024,), w, None, 1e-6), (w,), gy)[0]
    assert torch.equal(first, again)


def test_auto_follows_the_eager_and_graph_rules_on_cuda():
    backends.refresh()
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    huge = torch.empty(32768, 4096, device="cuda", dtype=torch.bfloat16)  # saves more GPU than host time
    assert backends.resolve("auto", huge, w, None) is tb
    assert backends.resolve("auto", huge[:8192], w, None) is backends.native  # eager: host time wins
    assert backends.resolve("auto", huge[:8], w, None) is backends.native
    # the module's cached decision: native in eager, triton while a CUDA graph is captured
    m = normswap.RMSNorm(4096, device="cuda", dtype=torch.bfloat16)
    x = huge[:8192].normal_()
    with torch.no_grad():
        eager_y = m(x)
        tb.rms_norm(x, (4096,), m.weight, None, m.eps)  # compile the kernel the capture will switch to
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            m(x)  # warm-up on the side stream, as CUDA-graph capture requires
            with torch.cuda.graph(graph):
                captured = m(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured.float(), eager_y.float(), atol=2e-2, rtol=2e-2)


def test_inductor_compile_on_cuda():
    torch._dynamo.reset()
    m = normswap.RMSNorm(2048, bias=True, backend="triton", device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(m, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for rows in (17, 300):
            x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            y = fn(x)
            y.float().sum().backward()
            ref = eager.rms_norm(x, (2048,), m.weight, m.bias, m.eps)
            assert torch.allclose(y.float(), ref.float(), atol=5e-2)


def test_launch_handles_give_the_same_results_as_triton_launches():
    """The second call per specialisation launches through the cached CompiledKernel handle."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    b = torch.randn(1024, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    gy = torch.randn_like(x)
    first = tb.rms_norm(x, (1024,), w, b, 1e-6)
    g_first = torch.autograd.grad(first, (x, w, b), gy)
    assert tb.launch_handles() > 0 or not tb.HANDLES_ENABLED[0]
    second = tb.rms_norm(x, (1024,), w, b, 1e-6)  # through the handles
    g_second = torch.autograd.grad(second, (x, w, b), gy)
    assert tb.HANDLES_ENABLED[0], "the direct launch failed and fell back (triton API changed?)"
    assert torch.equal(first, second)
    assert all(torch.equal(a, c) for a, c in zip(g_first, g_second, strict=True))
    check_against_reference(second.detach(), x.detach(), (1024,), w.detach(), b.detach(), 1e-6)
