"""Every CPU-runnable backend against a float64 reference (property tests with hypothesis).

The triton kernels get the same treatment under the interpreter in test_triton_interpret.py.
"""

from __future__ import annotations

import pytest
import torch
from backend_ref import check_against_reference, make_inputs
from hypothesis import given, settings
from hypothesis import strategies as st

import normswap
from normswap import backends

CPU_BACKENDS = ["eager", "native", "cpu"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _run(backend, x, shape, w, b, eps):
    module = backends.BACKENDS[backend]
    assert module.available()[0], module.available()[1]
    assert module.supports(x, w, b)
    return module.rms_norm(x, tuple(shape), w, b, eps)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 40),
    n=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    log_eps=st.floats(-12, -1),
    log_scale=st.floats(-4, 3),
    weight=st.booleans(),
    bias=st.booleans(),
    strided=st.booleans(),
    fp32_weight=st.booleans(),
    per_head=st.sampled_from([0, 0, 3]),
    seed=st.integers(0, 2**16),
)
def test_matches_float64_reference(backend, rows, n, dtype, log_eps, log_scale, weight, bias, strided,
                                   fp32_weight, per_head, seed):
    eps = 10.0**log_eps
    x, w, b = make_inputs(rows, (n,), dtype, scale=10.0**log_scale, weight=weight, bias=bias,
                          per_head=per_head, strided=strided, seed=seed,
                          weight_dtype=torch.float32 if fp32_weight else None)
    y = _run(backend, x, (n,), w, b, eps)
    check_against_reference(y, x, (n,), w, b, eps, f"{backend} {dtype} {tuple(x.shape)}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_tiny_variance_rows(backend, dtype):
    """pytorch#189581: a wrong eps (bf16's own) or a missing upcast scales such rows by ~1.7x."""
    eps = 1e-6
    x, w, b = make_inputs(64, (1024,), dtype, scale=1e-3, seed=1)
    y = _run(backend, x, (1024,), w, b, eps)
    check_against_reference(y, x, (1024,), w, b, eps, backend)
    # The normalised rows must have rms close to sqrt(ms / (ms + eps)), not a constant factor off.
    unit = _run(backend, x, (1024,), None, None, eps).double()
    ms = x.double().pow(2).mean(-1)
    expected = (ms / (ms + eps)).sqrt()
    assert torch.allclose(unit.pow(2).mean(-1).sqrt(), expected, rtol=2e-2)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_large_fp16_values_do_not_overflow(backend):
    """x^2 of 3e4 overflows fp16 (max 65504): the sum of squares must be done in fp32."""
    x, w, b = make_inputs(8, (512,), torch.float16, scale=3e4, seed=2)
    x = x.clamp(-6e4, 6e4)
    y = _run(backend, x, (512,), w, b, 1e-5)
    assert torch.isfinite(y).all()
    check_against_reference(y, x, (512,), w, b, 1e-5, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", [(0, 16), (5, 1), (1, 1), (0, 1)])
def test_empty_and_single_element_rows(backend, shape):
    x = torch.randn(shape)
    w = torch.rand(shape[-1]) + 0.5
    y = _run(backend, x, (shape[-1],), w, None, 1e-6)
    assert y.shape == x.shape
    check_against_reference(y, x, (shape[-1],), w, None, 1e-6, backend)
    if shape == (5, 1):  # a 1-element row normalises to sign(x) * |x| / sqrt(x^2 + eps)
        assert torch.allclose(y, w * x / torch.sqrt(x * x + 1e-6), atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_multi_dim_normalized_shape(backend):
    x, w, b = make_inputs(6, (4, 24), torch.float32, bias=True, seed=3)
    y = _run(backend, x, (4, 24), w, b, 1e-5)
    check_against_reference(y, x, (4, 24), w, b, 1e-5, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_module_gradcheck_float64(backend):
    """Gradients of x, weight and bias through ``normswap.RMSNorm`` in float64 (incl. per-head)."""
    for per_head in (0, 3):
        m = normswap.RMSNorm(12, bias=True, backend=backend, dtype=torch.float64,
                             param_shape=(per_head, 12) if per_head else None)
        with torch.no_grad():
            m.weight.normal_(1.0, 0.3)
            m.bias.normal_(0.0, 0.3)
        x = torch.randn(4, per_head or 2, 12, dtype=torch.float64, requires_grad=True)

        def f(x, w, b, m=m):
            return normswap.rms_norm(x, 12, w, b, m.eps, backend=backend)

        assert torch.autograd.gradcheck(f, (x, m.weight, m.bias), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_eager_autograd(backend, dtype):
    """Low-precision gradients: same tolerance rule, with eager's autograd as the same-dtype baseline."""
    x, w, b = make_inputs(16, (96,), dtype, bias=True, seed=4, requires_grad=True)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    got = torch.autograd.grad(backends.BACKENDS[backend].rms_norm(x, (96,), w, b, 1e-5), (x, w, b), gy)
    base = torch.autograd.grad(backends.eager.rms_norm(x, (96,), w, b, 1e-5), (x, w, b), gy)
    x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    ref = torch.autograd.grad(backends.eager.rms_norm(x64, (96,), w64, b64, 1e-5), (x64, w64, b64),
                              gy.double())
    atol = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype] * 4  # dW sums 16 rows
    for name, g, g0, r in zip("xwb", got, base, ref, strict=True):
        err, err0 = (g.double() - r).abs().max().item(), (g0.double() - r).abs().max().item()
        assert err <= 2 * err0 + atol, f"d{name}: {err:.3g} vs eager {err0:.3g}"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_residual_composite(backend):
    """Non-triton backends: ``rms_norm_residual`` is the add followed by the backend's norm."""
    x, w, b = make_inputs(8, (64,), torch.bfloat16, bias=True, seed=6)
    res = torch.randn(x.shape).to(torch.bfloat16)
    y, h = backends.rms_norm_residual(x, res, 64, w, b, 1e-6, backend=backend)
    assert torch.equal(h, x + res)
    assert torch.equal(y, backends.BACKENDS[backend].rms_norm(x + res, (64,), w, b, 1e-6))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_on_a_zero_mean_input_half_precision_error_is_layer_norms(backend, dtype, bias):
    """What makes a converted bf16/fp16 model as accurate as the original: on a zero-mean input an
    RMSNorm equals the LayerNorm it replaces, and with one rounding (float32 arithmetic, weight and
    bias included) its error against float64 is layer_norm's. With the old three-rounding order it was
    ~1.7x (the ``three`` line below checks that this test can tell)."""
    gen = torch.Generator().manual_seed(7)
    n = 32
    x64 = torch.randn(8192, n, generator=gen, dtype=torch.float64) * 2
    x = (x64 - x64.mean(-1, keepdim=True)).to(dtype)
    x = x - x.float().mean(-1, keepdim=True).to(dtype)  # as zero-mean as the dtype allows
    w = (1 + 0.5 * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)
    b = (0.5 * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype) if bias else None
    xd = x.double()
    ref = torch.nn.functional.layer_norm(xd, (n,), w.double(), None if b is None else b.double(), 1e-5)
    ln = torch.nn.functional.layer_norm(x, (n,), w, b, 1e-5)
    y = _run(backend, x, (n,), w, b, 1e-5)
    r = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    three = ((r.to(dtype).double() * w.double()).to(dtype).double() + (0 if b is None else b.double())).to(dtype)

    def err(t):
        return (t.double() - ref).norm().item()

    assert err(y) <= 1.05 * err(ln), (err(y), err(ln))
    assert err(three) > 1.3 * err(ln)


def test_native_half_precision_is_eagers_function_bit_for_bit():
    """torch's own op rounds once for a half-precision input with a weight of its dtype (its CPU
    composite multiplies the weight in float32 and casts once); native's float32 route does the same
    where the op cannot (a bias, a per-head weight, a float32 weight). Same operations as eager on CPU,
    so the same bits."""
    gen = torch.Generator().manual_seed(9)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(33, 3, 40, generator=gen).to(dtype)
        plain, head = (1 + torch.randn(40, generator=gen)).to(dtype), (1 + torch.randn(3, 40, generator=gen)).to(dtype)
        for w, b in ((None, None), (plain, None), (None, plain), (plain, plain), (head, None), (plain, head),
                     (plain.float(), None), (plain, plain.float())):
            got = backends.native.rms_norm(x, (40,), w, b, 1e-5)
            assert torch.equal(got, backends.eager.rms_norm(x, (40,), w, b, 1e-5))


def test_native_bound_float32_route_matches_and_follows_parameter_updates():
    """A half-precision module call with a bias and no gradients takes native's bound float32 route
    (float32 copies of weight and bias cached per module): the same bits as the generic route, and a
    parameter updated in place, or replaced, is read again on the next call."""
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16):
        m = normswap.RMSNorm(40, bias=True, backend="native").to(dtype)
        with torch.no_grad():
            m.weight.copy_(1 + torch.randn(40, generator=gen))
            m.bias.copy_(torch.randn(40, generator=gen))
        x = torch.randn(7, 40, generator=gen).to(dtype)

        def generic(m=m, x=x):
            return backends.native.rms_norm(x, (40,), m.weight.detach(), m.bias.detach(), m.eps)

        with torch.no_grad():
            assert torch.equal(m(x), generic())
            assert m(x) is not m(x)  # a fresh output per call
            m.weight.mul_(2)  # in place: the version counter moves
            m.bias.add_(1)
            assert torch.equal(m(x), generic())
            m.bias = torch.nn.Parameter(torch.randn(40, generator=gen).to(dtype))  # a new tensor
            assert torch.equal(m(x), generic())
        with torch.inference_mode():
            assert torch.equal(m(x), generic())
