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


def held_out_like(args: tuple, kwargs: dict[str, Any], seed: int = HELD_OUT_SEED,
                  keep_ids: set[int] | frozenset[int] = frozenset()) -> Probe | None:
    """``(args, kwargs)`` redrawn from ``seed``: a probe the analysis never saw, or None when nothing in
    them can be redrawn (no tensor of data: the probe would be the analysis inputs again).

    - integer tensors of data (token ids): uniform over the range the given ones span (``min..max``),
      so every id stays inside the vocabulary the given ones come from; positions holding an id of
      ``keep_ids`` (the model's special tokens: image placeholders, padding, bos/eos, from
      :func:`special_ids`) or an id repeated in runs (more than 5% of the tensor: a placeholder run of
      a vision-language prompt) keep it, and no redrawn position gets one;
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
            fresh = _redrawn_ids(value, keep_ids, gen)
            if fresh is None:
                kept.append(name)
                return value
        redrawn.append(name)
        return fresh.to(device=value.device, dtype=value.dtype)

    new = {f"*{i}": redraw(f"argument {i}", a) for i, a in enumerate(args)}
    new.update({k: redraw(k, v) for k, v in kwargs.items()})
    if not redrawn:
        return None
    source = f"the example inputs redrawn from seed {seed} (same shapes; {', '.join(redrawn)} redrawn"
    source += f"; {', '.join(kept)} kept as given)" if kept else ")"
    return Probe(new, source)  # a given attention_mask is kept: the figures leave its padding out


def _redrawn_ids(ids: torch.Tensor, keep_ids: set[int] | frozenset[int], gen: torch.Generator) -> torch.Tensor | None:
    """``ids`` with every position that holds no kept id redrawn (see :func:`held_out_like`), or None
    when no position can be."""
    flat = ids.detach().reshape(-1).cpu().long()
    values, counts = torch.unique(flat, return_counts=True)
    frequent = {int(v) for v, c in zip(values.tolist(), counts.tolist(), strict=True)
                if c > max(2, 0.05 * flat.numel())}
    keep = torch.tensor(sorted(set(keep_ids) | frequent), dtype=torch.long)
    fixed = torch.isin(flat, keep)
    free = flat[~fixed]
    if free.numel() == 0:
        return None
    lo, hi = int(free.min()), int(free.max())
    out = flat.clone()
    draw = torch.randint(lo, hi + 1, (free.numel(),), generator=gen)
    for _ in range(8):  # a drawn id that is a kept one is drawn again (kept ids mark structure)
        bad = torch.isin(draw, keep)
        if not bool(bad.any()):
            break
        draw[bad] = torch.randint(lo, hi + 1, (int(bad.sum()),), generator=gen)
    out[~fixed] = draw
    return out.reshape(ids.shape).to(device=ids.device, dtype=ids.dtype)


def special_ids(model: Any) -> set[int]:
    """The special token ids ``model``'s config and its sub-configs name (``*_token_id``, ``*_token_index``,
    ``*_token_ids``): ids that mark a prompt's structure, kept where a held-out probe redraws ids."""
    found: set[int] = set()
    seen: set[int] = set()

    def visit(cfg: Any) -> None:
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "to_dict"):
            return
        seen.add(id(cfg))
        for name, value in vars(cfg).items():
            if name.endswith(("_token_id", "_token_index", "_token_ids")):
                values = value if isinstance(value, (list, tuple)) else [value]
                found.update(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)
            elif hasattr(value, "to_dict"):
                visit(value)

    visit(getattr(model, "config", None))
    return found


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
