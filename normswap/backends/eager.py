"""Pure-PyTorch RMSNorm. Runs on every device and dtype; the reference the other backends match.

Cast order (same as Hugging Face ``LlamaRMSNorm``): the mean of squares, ``rsqrt`` and ``x * rstd``
run in float32 (float64 for float64 inputs); the normalised value is cast back to the input dtype
*before* the weight multiply; bias is added last; the result has the input dtype.
"""

from __future__ import annotations

import torch

name = "eager"


def available() -> tuple[bool, str]:
    return True, "pure PyTorch, always available"


def supports(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    return True


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything else accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
