"""Shared helpers for the backend tests: a float64 reference and the tolerance rule.

Tolerance rule (flash-attention's convention, kernels.md "Targets" 6): a backend's max error against
the float64 reference may be at most twice the error of the same-dtype ``eager`` result plus an
absolute slack per dtype.
"""

from __future__ import annotations

import torch

from normswap.backends import eager

ATOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float64: 1e-10}


def ref64(x, shape, weight, bias, eps):
    """``weight * x / sqrt(mean(x^2) + eps) + bias`` in float64, parameters as given (the contract
    upcasts them from their own dtype; a float32 weight of a bf16 input is not rounded to bf16)."""
    dims = tuple(range(-len(shape), 0))
    xd = x.detach().double()
    y = xd * torch.rsqrt(xd.pow(2).mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.detach().double()
    if bias is not None:
        y = y + bias.detach().double()
    return y


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.detach().double() - b.detach().double()).abs().max().item()


def check_against_reference(y, x, shape, weight, bias, eps, label=""):
    """Assert ``y`` (any backend's output) satisfies the tolerance rule; returns (err, eager_err)."""
    ref = ref64(x, shape, weight, bias, eps)
    assert y.shape == x.shape and y.dtype == x.dtype, label
    assert torch.isfinite(y).all() or not torch.isfinite(ref).all(), f"{label}: non-finite output"
    base = eager.rms_norm(x.detach(), tuple(shape), weight, bias, eps)
    err, err_eager = max_err(y, ref), max_err(base, ref)
    bound = 2 * err_eager + ATOL[x.dtype]
    assert err <= bound, f"{label}: error {err:.3g} > 2 x eager {err_eager:.3g} + atol {ATOL[x.dtype]}"
    return err, err_eager


def make_inputs(rows, shape, dtype, *, scale=1.0, weight=True, bias=False, per_head=0, strided=False,
                weight_dtype=None, seed=0, requires_grad=False):
    """x of shape (rows, *head, *shape) with optional per-head params; ``strided`` slices a wider buffer
    so rows have a row stride larger than the row (no contiguous layout)."""
    g = torch.Generator().manual_seed(seed)
    lead = (rows, per_head) if per_head else (rows,)
    full = (*lead, *shape)
    if strided:
        wide = torch.randn(*lead[:-1], lead[-1], *shape[:-1], shape[-1] + 7, generator=g, dtype=torch.float64)
        x = (wide * scale).to(dtype)[..., 3 : 3 + shape[-1]]
    else:
        x = (torch.randn(full, generator=g, dtype=torch.float64) * scale).to(dtype)
    pshape = (per_head, *shape) if per_head else tuple(shape)
    wd = weight_dtype or dtype
    w = (1 + 0.5 * torch.randn(pshape, generator=g, dtype=torch.float64)).to(wd) if weight else None
    b = (0.5 * torch.randn(pshape, generator=g, dtype=torch.float64)).to(wd) if bias else None
    if requires_grad:
        x.requires_grad_(True)
        for p in (w, b):
            if p is not None:
                p.requires_grad_(True)
    return x, w, b
