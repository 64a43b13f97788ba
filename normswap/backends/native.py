"""``torch.nn.functional.rms_norm``: PyTorch's own op, a fused kernel on CUDA since torch 2.9.

eps is always passed explicitly (``eps=None`` means ``finfo(float32).eps`` in recent torch and
something else in older ones). The weight is cast to the input dtype so the fused path is not
skipped on a dtype mismatch. Cast order differs from ``eager`` in one place: torch multiplies the
weight in float32 and casts once at the end (Gemma order), so half-precision results can differ
from ``eager`` by one rounding of the output dtype. A bias, which torch's op lacks, is added after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

name = "native"


def available() -> tuple[bool, str]:
    if not hasattr(F, "rms_norm"):
        return False, "torch.nn.functional.rms_norm needs torch >= 2.4"
    return True, f"torch {torch.__version__} rms_norm"


def supports(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    return True


def rms_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    w = None
    post_weight = None
    if weight is not None:
        if tuple(weight.shape) == tuple(normalized_shape):
            w = weight.to(x.dtype)
        else:  # e.g. a per-head weight of shape (heads, head_dim) with reduction over head_dim
            post_weight = weight.to(x.dtype)
    y = F.rms_norm(x, list(normalized_shape), w, eps)
    if post_weight is not None:
        y = y * post_weight
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y


def bind(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    grad: bool,
):
    """A launcher for calls like this one (cached per module, device, dtype and grad state), or None.

    When the parameters already have x's dtype and the weight is not per-head, the call is
    ``torch.rms_norm`` (the C++ binding ``F.rms_norm`` wraps) plus the bias add (in place without
    gradients): no casts or shape checks per call. Anything else returns None (the generic
    :func:`rms_norm` then serves it).
    """
    if any(p is not None and (p.dtype != x.dtype or tuple(p.shape) != tuple(normalized_shape))
           for p in (weight, bias)):
        return None
    if not hasattr(torch, "rms_norm"):
        return None
    shape = list(normalized_shape)
    op = torch.rms_norm
    if bias is None:
        return lambda x, w, b, eps: op(x, shape, w, eps)
    if not grad:  # nothing saved for backward: add the bias in place (no second output allocation)
        return lambda x, w, b, eps: op(x, shape, w, eps).add_(b)
    return lambda x, w, b, eps: op(x, shape, w, eps) + b
