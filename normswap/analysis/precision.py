"""Hold a model's own downcasts at the working dtype while normswap runs its working copy.

normswap analyses and verifies a float64 copy of the model. Speech and CLIP code controls its
precision inside the model: a LayerNorm that computes in float32 (``super().forward(x.float())
.type(x.dtype)``), attention probabilities taken ``softmax(..., dtype=torch.float32)``, logits returned
``.float()``. In a float64 copy such a cast sends float32 activations into float64 parameters (the
run fails: "mixed dtype (CPU): expect parameter to have scalar type of Float"), or silently rounds the
outputs to float32, so that no comparison can tell a 1e-9 error from float32 rounding.

:class:`HoldCasts` is a ``TorchFunctionMode`` that, while active, turns every cast to a floating
dtype *of lower precision* than the working dtype into a cast to the working dtype:
``.float()``, ``.half()``, ``.bfloat16()``, ``.to(dtype)`` / ``.to(device, dtype)`` / ``.to(tensor)``,
``.type(dtype or "torch.FloatTensor")``, ``.type_as(tensor)``, and the ``dtype=`` argument of factories
and reductions (``torch.zeros(..., dtype=torch.float32)``, ``softmax(..., dtype=torch.float32)``).
Upcasts, integer and boolean targets, and reinterpreting views (``x.view(torch.int32)``) are left alone.
Nothing outlives the block: the model's modules and tensors are not changed, so outside the mode
the model computes exactly as its code says.

Cost: one Python call per torch function while active. ``api`` holds casts in the traced analysis
run (where the recorder already pays a Python call per op) and in the later forwards only of models
whose traced run had a cast to hold (:attr:`HoldCasts.held`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Casts whose target dtype is positional: ``x.to(torch.float32)``, ``x.to("cpu", torch.float32)``,
# ``torch.softmax(x, -1, torch.float32)``. Any other function is only rewritten through ``dtype=``.
_POSITIONAL = {"to", "type", "softmax", "log_softmax"}
_METHODS: dict[Callable[..., Any], torch.dtype] = {
    torch.Tensor.float: torch.float32,
    torch.Tensor.half: torch.float16,
    torch.Tensor.bfloat16: torch.bfloat16,
}
# reinterpreting a tensor's bytes (``x.view(torch.int32)``) is not a cast
_NOT_CASTS = {"view"}
_TYPE_NAMES = {torch.float64: "DoubleTensor", torch.float32: "FloatTensor", torch.float16: "HalfTensor",
               torch.bfloat16: "BFloat16Tensor"}
_NAMED_TYPES = {name: dtype for dtype, name in _TYPE_NAMES.items()}


def lowers(target: Any, working: torch.dtype) -> bool:
    """Is ``target`` a floating dtype of lower precision than ``working`` (a cast to hold)?"""
    return isinstance(target, torch.dtype) and target.is_floating_point and not target.is_complex \
        and torch.finfo(target).bits < torch.finfo(working).bits


def _type_name(name: str, working: torch.dtype) -> str | None:
    """``"torch.FloatTensor"`` (or ``"torch.cuda.HalfTensor"``) held at ``working``; None when not lower."""
    prefix, _, kind = name.rpartition(".")
    dtype = _NAMED_TYPES.get(kind)
    if dtype is None or not lowers(dtype, working) or working not in _TYPE_NAMES:
        return None
    return f"{prefix}.{_TYPE_NAMES[working]}" if prefix else _TYPE_NAMES[working]


def rewrite(func: Callable[..., Any], args: tuple, kwargs: dict,
            working: torch.dtype) -> tuple[Callable[..., Any], tuple, dict] | None:
    """``(func, args, kwargs)`` with every downcast below ``working`` turned into a cast to ``working``;
    None when the call casts nothing down (the common case: it then runs untouched)."""
    target = _METHODS.get(func)
    if target is not None:
        if not lowers(target, working) or not args or not isinstance(args[0], torch.Tensor):
            return None
        return torch.Tensor.to, (args[0], working), kwargs
    name = getattr(func, "__name__", "")
    if name in _NOT_CASTS:
        return None
    if name == "type_as" and len(args) == 2 and isinstance(args[1], torch.Tensor) and lowers(args[1].dtype, working):
        return torch.Tensor.to, (args[0], working), {}
    changed = False
    new_args = list(args)
    if name in _POSITIONAL:
        for i, a in enumerate(args[1:], start=1):
            if lowers(a, working):
                new_args[i] = working
                changed = True
            elif name == "to" and isinstance(a, torch.Tensor) and lowers(a.dtype, working):
                new_args[i:i + 1] = [a.device, working]  # x.to(other): other's device, the working dtype
                changed = True
                break
            elif name == "type" and isinstance(a, str) and _type_name(a, working) is not None:
                new_args[i] = _type_name(a, working)
                changed = True
    new_kwargs = kwargs
    if lowers(kwargs.get("dtype"), working):
        new_kwargs = dict(kwargs, dtype=working)
        changed = True
    if name == "to" and isinstance(kwargs.get("other"), torch.Tensor) and lowers(kwargs["other"].dtype, working):
        other = kwargs["other"]
        new_kwargs = {k: v for k, v in new_kwargs.items() if k != "other"}
        new_kwargs.update(device=other.device, dtype=working)
        changed = True
    return (func, tuple(new_args), new_kwargs) if changed else None


class HoldCasts(TorchFunctionMode):
    """While active, casts to a floating dtype below ``dtype`` cast to ``dtype`` instead (:func:`rewrite`).

    ``held`` counts the rewritten calls by function name, so a caller can tell whether the model
    casts inside at all (and say which casts it held)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.held: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        new = rewrite(func, args, kwargs, self.dtype)
        if new is not None:
            self.held[getattr(func, "__name__", str(func))] += 1
            func, args, kwargs = new
        return func(*args, **kwargs)


def describe(held: Mapping[str, int], limit: int = 4) -> str:
    """Held casts (:attr:`HoldCasts.held`) as a short phrase, most frequent first: ``float x12, to x4``."""
    names = [f"{n} x{c}" for n, c in Counter(held).most_common(limit)]
    return ", ".join(names) + (", ..." if len(held) > limit else "")


@contextlib.contextmanager
def holding(dtype: torch.dtype, enabled: bool = True) -> Iterator[HoldCasts | None]:
    """:class:`HoldCasts` at ``dtype`` for the block (nothing at all when not ``enabled``)."""
    if not enabled:
        yield None
        return
    with HoldCasts(dtype) as mode:
        yield mode
