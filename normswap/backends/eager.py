"""Pure-PyTorch RMSNorm. Runs on every device and dtype; the reference the other backends match.

Cast order (same as Hugging Face ``LlamaRMSNorm``): the mean of squares, ``rsqrt`` and ``x * rstd``
run in float32 (float64 for float64 inputs); the normalised value is cast back to the input dtype
*before* the weight multiply; bias is added last; the result has the input dtype.
"""

from __future__ import annotations

import torch

from normswap.backends.rows import compute_dtype

__all__ = ["available", "compute_dtype", "rms_norm", "supports"]
name = "eager"


def available() -> tuple[bool, str]:
    return True, "pure PyTorch, always available"


def supports(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    return True


def rms_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    dims = tuple(range(-len(normalized_shape), 0))
    xf = x.to(compute_dtype(x.dtype))
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
    y = (xf * rstd).to(x.dtype)
    if weight is not None:
        y = y * weight.to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y
