"""``torch.nn.functional.rms_norm``: PyTorch's own op, a fused kernel on CUDA since torch 2.9.

eps is always passed explicitly (``eps=None`` means ``finfo(float32).eps`` in recent torch and
something else in older ones).

Cast order. For a half-precision input with a weight of its own dtype and shape, torch's op already
computes ``eager``'s function: on CPU its composite upcasts to float32, multiplies by rstd and by the
weight in float32 and casts once (checked bit for bit in tests/backends/test_numerics.py); on CUDA the
fused kernel is the LayerNorm kernel's RMS variant, which does the arithmetic in float32 (weight
included) and rounds once at the store. What torch's op cannot express is a bias, a per-head weight
(``(heads, head_dim)`` with reduction over ``head_dim``) or a weight of another dtype: adding or
multiplying those after it, in the input dtype, would round a second time. For half-precision inputs
those calls therefore run the op in float32 (``x`` upcast, fp32 output), apply the per-head weight and
the bias in float32, and round once at the end; this costs an upcast pass and a float32 output, which
is why ``auto`` prefers a fused backend for them (docs/backends.md, "native and a kept bias").
float32/float64 inputs compute in their own dtype, so every post-op there is already exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from normswap.backends.rows import compute_dtype, wants_grad

name = "native"


def available() -> tuple[bool, str]:
    if not hasattr(F, "rms_norm"):
        return False, "torch.nn.functional.rms_norm needs torch >= 2.4"
    return True, f"torch {torch.__version__} rms_norm"


def supports(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    return True


def rounds_once_in_torch(x: torch.Tensor, normalized_shape: tuple[int, ...], weight: torch.Tensor | None,
                         bias: torch.Tensor | None) -> bool:
    """True when ``F.rms_norm`` alone computes this call with one rounding: a float32/float64 input,
    or a half-precision one with no bias and no weight or a weight of x's dtype and the normalised
    shape. Otherwise :func:`rms_norm` takes the float32 route (module docstring)."""
    if compute_dtype(x.dtype) == x.dtype:
        return True
    return bias is None and (weight is None or (weight.dtype == x.dtype
                                                and tuple(weight.shape) == tuple(normalized_shape)))


def rms_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    shape = list(normalized_shape)
    if rounds_once_in_torch(x, normalized_shape, weight, bias):
        w = post_weight = None
        if weight is not None:
            if tuple(weight.shape) == tuple(normalized_shape):
                w = weight.to(x.dtype)  # float32/float64 x: the compute dtype (exact, or eager's rounding)
            else:  # per-head weight, float32/float64 x: a multiply in x's dtype is eager's own step
                post_weight = weight.to(x.dtype)
        y = F.rms_norm(x, shape, w, eps)
        if post_weight is not None:
            y = y * post_weight
        if bias is not None:
            y = y + bias.to(x.dtype)
        return y
    # Half precision with a bias, a per-head weight or a weight of another dtype: float32 throughout.
    cdt = compute_dtype(x.dtype)
    plain = weight is not None and tuple(weight.shape) == tuple(normalized_shape)
    y = F.rms_norm(x.to(cdt), shape, weight.to(cdt) if plain else None, eps)
    post = weight.to(cdt) if weight is not None and not plain else None
    b = bias.to(cdt) if bias is not None else None
    grad = wants_grad(x, weight, bias)
    if not (grad or torch.compiler.is_compiling() or torch.jit.is_tracing()):
        # y is a fresh float32 tensor: finish in place, writing x's dtype on the last step
        if post is not None:
            y.mul_(post)
        return torch.add(y, b, out=torch.empty_like(x)) if b is not None else y.to(x.dtype)
    if post is not None:
        y = y * post
    if b is not None:
        y = y + b
    return y.to(x.dtype)


def bind(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    grad: bool,
):
    """A launcher for calls like this one (cached per module, device, dtype and grad state), or None.

    When the parameters already have x's dtype and the weight is not per-head, the call is
    ``torch.rms_norm`` (the C++ binding ``F.rms_norm`` wraps), plus, for float32/float64 inputs, the
    bias add (in place without gradients): no casts or shape checks per call. Anything else, including
    a half-precision call with a bias (which needs the float32 route to round once), returns None and
    the generic :func:`rms_norm` serves it.
    """
    if any(p is not None and (p.dtype != x.dtype or tuple(p.shape) != tuple(normalized_shape))
           for p in (weight, bias)):
        return None
    if not hasattr(torch, "rms_norm"):
        return None
    shape = list(normalized_shape)
    op = torch.rms_norm
    if not rounds_once_in_torch(x, normalized_shape, weight, bias):
        return None if grad else _bind_float32_route(shape, compute_dtype(x.dtype))
    if bias is None:
        return lambda x, w, b, eps: op(x, shape, w, eps)
    if not grad:  # nothing saved for backward: add the bias in place (no second output allocation)
        return lambda x, w, b, eps: op(x, shape, w, eps).add_(b)
    return lambda x, w, b, eps: op(x, shape, w, eps) + b


def _bind_float32_route(shape: list[int], cdt: torch.dtype):
    """The no-grad float32 route for a half-precision call with a bias (one rounding, as
    :func:`rms_norm`), with fewer launches per call: the float32 copies of weight and bias are made
    once and reused until the parameter changes (a new tensor, or an in-place update, which bumps
    its version counter), so a call is the upcast of x, ``torch.rms_norm`` and the add that writes
    x's dtype. Measured on a GPU host, the generic route cost 3.7x an ``nn.LayerNorm`` call of host
    time (docs/results/backends-gpu.md)."""
    cache: dict[int, tuple[tuple, torch.Tensor]] = {}
    op = torch.rms_norm

    def upcast(p: torch.Tensor | None) -> torch.Tensor | None:
        if p is None or p.is_inference():  # an inference tensor has no version counter: no cache
            return None if p is None else p.to(cdt)
        key = (p.data_ptr(), p._version)
        hit = cache.get(id(p))
        if hit is not None and hit[0] == key:
            return hit[1]
        copy = p.to(cdt)
        if not (p.is_cuda and torch.cuda.is_current_stream_capturing()):  # never keep a graph pool's tensor
            cache[id(p)] = (key, copy)
        return copy

    def call(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float) -> torch.Tensor | None:
        if not x.dim() or x.shape[-1] != shape[-1]:
            return None
        y = op(x.to(cdt), shape, upcast(w), eps)
        return torch.add(y, upcast(b), out=torch.empty_like(x))

    return call
