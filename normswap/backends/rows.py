"""Helpers every kernel backend shares: the (rows, n) view of an input, the accumulation dtype, whether a
call wants gradients, and the backward custom ops' fake outputs and gradient placeholders.

One definition each, so the ``cpu`` and ``triton`` launchers and the ``eager`` reference cannot drift.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

#: The tensor types the pointer-reading kernels (``cpu``, ``triton``) take without a second look.
DENSE_TYPES = (torch.Tensor, torch.nn.Parameter)


def dense(t: torch.Tensor | None) -> bool:
    """``t`` is None or a tensor whose storage is its data, which a kernel can read by pointer.

    Not a wrapper subclass such as a ``DTensor`` (FSDP2 shards, tensor parallelism) or a quantised
    tensor: their own storage is not their values, so a kernel handed its pointer would read garbage
    or crash; such calls go to ``native``/``eager``, whose aten ops the subclass dispatches itself (a
    DTensor through its sharding rules). The tensors tracing substitutes for plain ones (fake and
    functional tensors under ``torch.export``/``torch.compile``) are not wrappers and stay dense, so a
    traced program keeps the fused custom ops.
    """
    return t is None or type(t) in DENSE_TYPES or not is_traceable_wrapper_subclass(t)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64; everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def wants_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd is on and one of ``tensors`` (None entries skipped) requires a gradient: the call must
    record a graph, so a backend launches its ``autograd.Function`` (or a decision cache keys on it)
    rather than a forward-only kernel. One definition for every backend's dispatch."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def fake_grads(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a kernel backend's backward custom op returns, as its fake (meta) kernel builds it for
    tracing: dx shaped as ``x``, dw/db shaped as the parameters, or for an absent parameter the empty
    placeholder the real op returns (custom ops cannot return None; :func:`param_grads` drops it)."""
    dw = weight.new_empty(weight.shape) if weight is not None else x.new_empty((0,))
    db = bias.new_empty(bias.shape) if bias is not None else x.new_empty((0,))
    return x.new_empty(x.shape), dw, db


def param_grads(
    weight: torch.Tensor | None, bias: torch.Tensor | None, dw: torch.Tensor, db: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The weight and bias gradients an ``autograd`` backward returns from a backward custom op's
    ``dw``, ``db``: None for an absent parameter, in place of the op's empty placeholder."""
    return dw if weight is not None else None, db if bias is not None else None


def as_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """A (rows, n) view of ``x`` with unit column stride, copying only when no such view exists."""
    rows = x.numel() // n if n else 0
    try:
        x2 = x.view(rows, n)
    except RuntimeError:
        x2 = x.contiguous().view(rows, n)
    if n > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


def grad_launcher(apply: Callable[..., torch.Tensor], normalized_shape: tuple[int, ...]) -> Callable:
    """The bound launcher of a kernel backend when gradients are wanted: its ``autograd.Function``
    ``apply`` for inputs whose last dim is the normalised one, None otherwise (the caller's general
    path then raises the error or serves the call)."""
    n = normalized_shape[0]

    def call_grad(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float):
        if x.dim() and x.shape[-1] == n:
            return apply(x, normalized_shape, w, b, eps)
        return None

    return call_grad
