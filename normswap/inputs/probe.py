"""A held-out probe for a model whose inputs were given by hand: new inputs of the same structure.

``patch`` verifies every model on inputs the analysis did not run on. A transformers model gets the
built-in probe (:func:`normswap.inputs.verification_probe`); a custom model, or any model given
``example_inputs``, gets :func:`held_out_like`: its example inputs redrawn from another seed, with the
same shapes, dtypes and devices, so the same forward accepts them, but other values. What is redrawn
and what is kept (masks, positions, sizes: metadata the model's structure depends on) is said in the
probe's ``source``.
"""

from __future__ import annotations

from typing import Any

import torch

from normswap.inputs import Probe

# kwarg names of integer inputs that describe the input rather than being data: redrawing them would
# build an input the model cannot run (a grid of another size) or one that means something else
_METADATA_WORDS = ("mask", "position", "pos_", "length", "size", "thw", "grid", "index", "idx", "offset", "shape",
                   "cache", "type_ids", "lang", "task", "segment", "num_")
HELD_OUT_SEED = 20251


def held_out_like(args: tuple, kwargs: dict[str, Any], seed: int = HELD_OUT_SEED) -> Probe | None:
    """``(args, kwargs)`` redrawn from ``seed``: a probe the analysis never saw, or None when nothing in
    them can be redrawn (no tensor of data: the probe would be the analysis inputs again).

    - integer tensors of data (token ids): uniform over the range the given ones span (``min..max``),
      so every id stays inside the vocabulary the given ones come from;
    - floating tensors of data: normal with the given tensor's mean and standard deviation;
    - kept as given: booleans, 0/1 tensors (masks), tensors of at most two distinct values (float masks,
      constant scales), non-finite ones, integer tensors that count up by one (positions), integer kwargs
      named like metadata (``*mask*``, ``position*``, ``*size*``, ``grid_thw``, ``*_idx``, ...), scalars
      and everything that is not a tensor.

    The probe's ``kwargs`` holds the positional args as ``"*0"``, ``"*1"``...: call it with
    :func:`call_args` to split them back."""
    gen = torch.Generator().manual_seed(seed)
    redrawn: list[str] = []
    kept: list[str] = []

    def redraw(name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.numel() <= 1 or value.is_complex():
            return value
        if _is_metadata(name, value):
            kept.append(name)
            return value
        if value.is_floating_point():
            data = value.detach().double()
            mean, std = float(data.mean()), float(data.std()) if data.numel() > 1 else 0.0
            fresh = torch.randn(value.shape, generator=gen, dtype=torch.float64) * (std or 1.0) + mean
        else:
            lo, hi = int(value.min()), int(value.max())
            fresh = torch.randint(lo, hi + 1, value.shape, generator=gen)
        redrawn.append(name)
        return fresh.to(device=value.device, dtype=value.dtype)

    new = {f"*{i}": redraw(f"argument {i}", a) for i, a in enumerate(args)}
    new.update({k: redraw(k, v) for k, v in kwargs.items()})
    if not redrawn:
        return None
    source = f"the example inputs redrawn from seed {seed} (same shapes; {', '.join(redrawn)} redrawn"
    source += f"; {', '.join(kept)} kept as given)" if kept else ")"
    return Probe(new, source)  # a given attention_mask is kept: the figures leave its padding out


def call_args(probe_kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of a probe made by :func:`held_out_like` (positional args stored as ``"*i"``),
    or ``((), kwargs)`` of any other probe."""
    args = tuple(v for k, v in sorted(((k, v) for k, v in probe_kwargs.items() if k.startswith("*")),
                                      key=lambda kv: int(kv[0][1:])))
    return args, {k: v for k, v in probe_kwargs.items() if not k.startswith("*")}


def _is_metadata(name: str, t: torch.Tensor) -> bool:
    """Whether ``t`` describes the input rather than being data (see :func:`held_out_like`)."""
    if t.dtype == torch.bool:
        return True
    flat = t.detach().reshape(-1)
    if t.is_floating_point():
        if not bool(torch.isfinite(flat).all()):
            return True
        return torch.unique(flat[: 4096]).numel() <= 2 and torch.unique(flat).numel() <= 2
    if any(word in name.lower() for word in _METADATA_WORDS):
        return True
    values = torch.unique(flat)
    if values.numel() <= 2 and bool(((values == 0) | (values == 1)).all()):
        return True  # a 0/1 mask
    rows = t.detach().reshape(-1, t.shape[-1]) if t.dim() else flat.reshape(1, -1)
    return rows.shape[-1] > 1 and bool((rows.diff(dim=-1) == 1).all())  # positions: 0, 1, 2, ...
