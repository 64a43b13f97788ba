"""Pure-PyTorch RMSNorm. Runs on every device and dtype; the reference the other backends match.

Cast order (the LayerNorm one: torch's ``layer_norm`` computes in float32 and rounds once): the mean
of squares, ``rsqrt``, ``x * rstd``, ``* weight`` and ``+ bias`` all run in the compute dtype (float32,
float64 for float64 inputs), with the weight and bias upcast from their own dtype; the result is
rounded to the input dtype once, at the end. A converted model then rounds where the LayerNorm it
replaces rounded, which is what keeps its bf16/fp16 error at the original model's
(tests/surgery/test_bf16_fidelity.py). This is not Hugging Face ``LlamaRMSNorm``'s order (which rounds
``x * rstd`` to the input dtype before the weight multiply); normswap replaces LayerNorms, not those.

Without gradients the elementwise steps run in place on the float32 copy of a half-precision input
and the last one writes the input dtype directly (``out=``), so the one-rounding order moves no more
memory than the old three-rounding one did. While a graph is traced, and for float32/float64 inputs
with gradients, the same arithmetic runs as plain out-of-place ops (autograd derives the backward);
half-precision inputs with gradients use a small ``autograd.Function`` with the analytic float32
backward (see ``_HalfPrecision``).
"""

from __future__ import annotations

import torch

from normswap.backends.rows import compute_dtype, wants_grad

__all__ = ["available", "compute_dtype", "rms_norm", "supports"]
name = "eager"


def available() -> tuple[bool, str]:
    return True, "pure PyTorch, always available"


def supports(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    return True


def _param(p: torch.Tensor, x_dtype: torch.dtype, cdt: torch.dtype) -> torch.Tensor:
    """``p`` as an operand of compute-dtype arithmetic: kept when it upcasts exactly inside the op (it has
    x's dtype or the compute dtype), else converted to the compute dtype first (e.g. a float64 weight of a
    bfloat16 input is rounded to float32, not multiplied in float64)."""
    return p if p.dtype == x_dtype or p.dtype == cdt else p.to(cdt)


def rms_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    dtype = x.dtype
    cdt = compute_dtype(dtype)
    w = None if weight is None else _param(weight, dtype, cdt)
    b = None if bias is None else _param(bias, dtype, cdt)
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or not (_fits(w, x) and _fits(b, x)):
        return _graph(x, normalized_shape, w, b, eps)
    if wants_grad(x, w, b):
        if dtype == cdt:
            return _graph(x, normalized_shape, w, b, eps)
        return _HalfPrecision.apply(x, normalized_shape, w, b, eps)
    return _forward(x, normalized_shape, w, b, eps)[0]


def _graph(x: torch.Tensor, normalized_shape: tuple[int, ...], w: torch.Tensor | None,
           b: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The function as plain out-of-place ops: what tracing records, and autograd's graph in float32 and
    float64 (where it is the same graph as before the one-rounding change)."""
    dims = tuple(range(-len(normalized_shape), 0))
    cdt = compute_dtype(x.dtype)
    xf = x.to(cdt)
    y = xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
    if w is not None:
        y = y * w.to(cdt)
    if b is not None:
        y = y + b.to(cdt)
    return y.to(x.dtype)


def _forward(x: torch.Tensor, normalized_shape: tuple[int, ...], w: torch.Tensor | None,
             b: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` without an autograd graph: in place on a fresh compute-dtype tensor, the last step
    writing x's dtype directly (no separate cast pass). Same operations, in the same order, as
    :func:`_graph`, so the same bits."""
    dims = tuple(range(-len(normalized_shape), 0))
    dtype = x.dtype
    cdt = compute_dtype(dtype)
    half = dtype != cdt
    xf = x.to(cdt)  # a fresh copy of a half input, x itself otherwise
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
    if w is None and b is None:
        return (torch.mul(xf, rstd, out=torch.empty_like(x)) if half else xf * rstd), rstd
    y = xf.mul_(rstd) if half else xf * rstd
    if b is None:
        return (torch.mul(y, w, out=torch.empty_like(x)) if half else y.mul_(w)), rstd
    if w is not None:
        y.mul_(w)
    return (torch.add(y, b, out=torch.empty_like(x)) if half else y.add_(b)), rstd


class _HalfPrecision(torch.autograd.Function):
    """bf16/fp16 with gradients: :func:`_forward`, and the analytic float32 backward.

    Autograd through :func:`_graph` would keep full-size float32 intermediates for each step and run
    a float32 backward per op (measured 1.1-1.4x the old three-rounding graph's forward+backward,
    which ran its weight multiply in the input dtype); this saves x, rstd and the parameters and
    computes ``dx = rstd * (g - xhat * mean(g * xhat))`` (``g = dy * w``), ``dW = sum(dy * xhat)``,
    ``dB = sum(dy)`` in float32 in a few in-place passes. Not differentiable twice.
    """

    @staticmethod
    def forward(ctx, x, normalized_shape, w, b, eps):  # type: ignore[override]
        y, rstd = _forward(x, normalized_shape, w, b, eps)
        ctx.save_for_backward(x, rstd, w, b)
        ctx.dims = tuple(range(-len(normalized_shape), 0))
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        x, rstd, w, b = ctx.saved_tensors
        cdt = rstd.dtype
        g = dy.to(cdt)
        if g is dy:
            g = g.clone()
        xhat = x.to(cdt).mul_(rstd)
        dw = db = None
        if w is not None and ctx.needs_input_grad[2]:
            dw = (g * xhat).sum_to_size(w.shape).to(w.dtype)
        if b is not None and ctx.needs_input_grad[3]:
            db = g.sum_to_size(b.shape).to(b.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            if w is not None:
                g.mul_(w)
            c = (g * xhat).mean(ctx.dims, keepdim=True)
            g.sub_(xhat.mul_(c))
            dx = torch.mul(g, rstd, out=torch.empty_like(x))
        return dx, None, dw, db, None


def _fits(p: torch.Tensor | None, x: torch.Tensor) -> bool:
    """``p`` broadcasts onto x without enlarging it (its shape is a suffix of x's): in-place ops apply."""
    return p is None or (p.dim() <= x.dim() and p.shape == x.shape[x.dim() - p.dim():])
