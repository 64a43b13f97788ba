"""The RMSNorm that replaces a norm whose ``forward`` takes more than its input, or returns more than its output.

Graph libraries call their norms as ``norm(h, batch=batch)``; custom code passes masks or sizes the
norm ignores. The walker converts such a norm only where its traced output is the per-row formula of
its input alone (the extra arguments change nothing), and then the replacement must accept the same
call. Some norms also return a tuple: I-BERT's ``IntLayerNorm`` is called as ``norm(x, scaling_factor)``
and returns ``(normalised, None)``; the replacement returns the same structure, rebuilt from a
description the trace recorded (:data:`Returns`, kept in the plan and the checkpoint manifest).

A subclass, so :class:`normswap.nn.rmsnorm.RMSNorm`'s own one-tensor ``forward`` (the decode hot
path) keeps its cost; only these norms pay one extra Python call.

:func:`argument_slot` finds a traced argument in a later call that passes it the other way (by name
instead of position, or back), for the centering and rotation hooks installed on a module's inputs.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.nn.rmsnorm import RMSNorm

# What a norm returned, as recorded by the trace: ``{}`` for the normalised tensor alone, else
# ``{"type": "tuple" | "list", "items": [...]}`` where each item is ``"output"`` (the normalised
# tensor), ``"None"``, ``"arg N"`` (its N-th positional argument, passed through) or ``"kwarg NAME"``.
Returns = dict[str, Any]


def reproducible(returns: Returns) -> bool:
    """Can :class:`RMSNormTakingArgs` return this structure? Only a tuple/list of the output, Nones and
    the call's own arguments; anything else is computed by the norm and no RMSNorm can give it."""
    if not returns:
        return True
    items = returns.get("items", [])
    return (returns.get("type") in ("tuple", "list") and bool(items) and items[0] == "output"
            and all(i == "None" or i.startswith(("arg ", "kwarg ")) for i in items[1:]))


class RMSNormTakingArgs(RMSNorm):
    """:class:`~normswap.nn.rmsnorm.RMSNorm` that accepts, and ignores, the arguments after its input,
    and returns what the norm it replaces returned (``returns``: see :data:`Returns`)."""

    def __init__(self, *args: Any, returns: Returns | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if returns and not reproducible(returns):
            raise ValueError(f"RMSNormTakingArgs cannot return {returns!r}")
        self.returns: Returns = dict(returns or {})

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(hidden_states)
        if not self.returns:
            return out
        call_args = (hidden_states, *args)
        items = [out if i == "output" else None if i == "None"
                 else call_args[int(i[4:])] if i.startswith("arg ") else kwargs.get(i[6:])
                 for i in self.returns["items"]]
        return items if self.returns["type"] == "list" else tuple(items)

    def extra_repr(self) -> str:
        base = super().extra_repr()
        if not self.returns:
            return base
        items = ", ".join(self.returns["items"])
        return f"{base}, returns={'[' + items + ']' if self.returns['type'] == 'list' else '(' + items + ')'}"


def normalised(output: Any) -> torch.Tensor:
    """The normalised tensor in what a norm returned: the output itself, or the first item of the
    tuple/list a norm like I-BERT's returns (``(x, None)``). For hooks on norms of either kind."""
    return output if isinstance(output, torch.Tensor) else output[0]


def with_normalised(output: Any, y: torch.Tensor) -> Any:
    """``output`` with its normalised tensor replaced by ``y``, in the same structure."""
    if isinstance(output, torch.Tensor):
        return y
    return type(output)([y, *output[1:]])


@functools.cache
def _positional_names(forward: Callable) -> tuple[str, ...]:
    """The names of ``forward``'s parameters that a caller may pass by position, in order (``self``
    already bound); empty when the signature cannot be read."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def argument_slot(module: nn.Module, args: tuple, kwargs: dict, arg: int | str) -> int | str:
    """Where the argument the trace recorded as ``arg`` (a position, or a keyword's name) is in this call.

    The trace records the slot as the traced call passed it, but a later caller may pass the same
    argument the other way (traced as ``model(hidden_states=x)``, called as ``model(x)``): the module's
    ``forward`` signature maps a name to its position and back. Raises :class:`NormswapError` when this
    call does not pass it at all: the centering op would then be skipped and the converted norms would
    read an uncentred stream, silently wrong."""
    if isinstance(arg, int) and arg < len(args):
        return arg
    if isinstance(arg, str) and arg in kwargs:
        return arg
    names = _positional_names(type(module).forward)[1:]  # the unbound forward: its first name is self
    if isinstance(arg, int) and arg < len(names) and names[arg] in kwargs:
        return names[arg]
    if isinstance(arg, str) and arg in names and names.index(arg) < len(args):
        return names.index(arg)
    what = f"argument {arg}" if isinstance(arg, int) else f"`{arg}`"
    raise NormswapError(
        f"{type(module).__name__}.forward was converted with an op (centering or rotation) on its input {what}, which "
        "this call "
        "does not pass; pass it (the converted norms need that stream centred to stay exact)")
