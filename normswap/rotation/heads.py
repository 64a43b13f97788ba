"""Where attention's values turn per head: the value and output projections a per-head rotation folds into.

``rotate(..., online=True)`` (and ``rotate(model, "none", online=True)``) turns each head's values by a
Hadamard ``H̃`` folded into the weights only: the value projection's rows and bias, and the output projection's
input columns, per head (:func:`normswap.rotation.rotate._rotate_heads_`). The rotation finds those Linears here,
and :mod:`normswap.rotation.carry` finds them again (from the manifest's ``value_heads``) to keep an adapter put
on them in the original model's basis.
"""

from __future__ import annotations

import torch
from torch import nn

from normswap.rotation.hadamard import hadamard

VALUE_OUTPUT = (("v_proj", "o_proj"), ("v_proj", "out_proj"))  # separate value / output projections

__all__ = ["VALUE_OUTPUT", "config_head_dim", "value_output", "value_heads", "head_turn", "turn_heads"]


def config_head_dim(model: nn.Module) -> int | None:
    """The head size from the (first) transformers config in ``model``: ``head_dim`` or width / heads."""
    config = next((getattr(m, "config", None) for m in model.modules() if getattr(m, "config", None) is not None),
                  None)
    if config is None:
        return None
    config = getattr(config, "get_text_config", lambda: config)()
    hd = getattr(config, "head_dim", None)
    heads = getattr(config, "num_attention_heads", None)
    width = getattr(config, "hidden_size", None)
    return int(hd) if isinstance(hd, int) else (width // heads if width and heads else None)


def value_output(module: nn.Module, default: int | None) -> tuple[nn.Linear, nn.Linear, int] | None:
    """``(value projection, output projection, head size)`` of the attention module ``module`` where both are
    separate Linears over whole heads (``v_proj`` with ``o_proj`` / ``out_proj``, or BERT/ViT/DINOv2's
    ``{self|attention}.value`` with ``output.dense``), the head size the module's own ``head_dim`` /
    ``attention_head_size``, else ``default``; None where it is not such a module."""
    pairs = [(module, getattr(module, v_name, None), getattr(module, o_name, None)) for v_name, o_name in VALUE_OUTPUT]
    inner = getattr(module, "self", None) or getattr(module, "attention", None)
    out = getattr(module, "output", None)
    if isinstance(inner, nn.Module) and isinstance(out, nn.Module):
        pairs.append((inner, getattr(inner, "value", None), getattr(out, "dense", None)))
    for owner, v, o in pairs:
        hd = getattr(owner, "head_dim", None) or getattr(owner, "attention_head_size", None) or default
        if isinstance(v, nn.Linear) and isinstance(o, nn.Linear) and isinstance(hd, int) and hd > 0 \
                and v.out_features % hd == 0 and o.in_features % hd == 0:
            return v, o, hd
    return None


def value_heads(model: nn.Module) -> tuple[list[tuple[str, nn.Linear, nn.Linear]], int | None]:
    """Attention modules whose value and output projections are separate Linears over whole heads
    (:func:`value_output`), and the head size; none where the model mixes head sizes (one ``H̃`` size per model
    keeps the record simple)."""
    found, sizes = [], set()
    default = config_head_dim(model)
    for path, module in model.named_modules():
        pair = value_output(module, default)
        if pair is not None:
            found.append((path, pair[0], pair[1]))
            sizes.add(pair[2])
    if len(sizes) > 1:
        return [], None
    return found, next(iter(sizes), None)


def head_turn(head_dim: int) -> torch.Tensor:
    """The per-head ``H̃ = H/sqrt(head_dim)`` (float64) that the rotation folds into the values and output
    projection, and that an adapter there is turned by: one builder, so the two are the same matrix. The caller
    has checked that one of that order is built (:func:`normswap.rotation.hadamard.has_hadamard`)."""
    return hadamard(head_dim) / head_dim**0.5


def turn_heads(p: torch.Tensor, axis: int, r2: torch.Tensor) -> torch.Tensor:
    """``p`` with each block of ``r2``'s size along ``axis`` (one head's features) times ``r2``; differentiable."""
    moved = p.movedim(axis, -1)
    hd = r2.shape[0]
    blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // hd, hd) @ r2.to(p.dtype)
    return blocks.reshape(moved.shape).movedim(-1, axis)
