"""Deep copies of models whose code keeps closures over their own modules.

``copy.deepcopy`` copies modules, parameters and buffers, but hands back every function object as it
is (functions are atomic to ``copy``). A model that stores a closure over itself, as x-transformers
does for tied logits (``self.to_logits = lambda t: t @ self.token_emb.emb.weight.t()``), therefore
gets a copy whose forward still reads the *original's* modules. normswap analyses, edits and verifies
a working copy: with such a closure the copy's analysis never sees the tied read, its verification
compares against the unedited original weights and passes, and the commit then changes the user's
logits. :func:`deepcopy_module` rebinds those closures to the copied objects, so a copy computes
from its own weights as an ``nn.Module`` copy is expected to.
"""

from __future__ import annotations

import copy
import functools
import types
from typing import Any

from torch import nn


def deepcopy_module(model: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """``copy.deepcopy(model, memo)``, then every function the copy's modules hold as an attribute (alone,
    in a list, tuple or dict, or inside a ``functools.partial``) whose closure reaches an object that was
    copied is replaced by the same code closing over the copy of that object."""
    memo = {} if memo is None else memo
    work = copy.deepcopy(model, memo)
    rebound: dict[int, Any] = {}
    for module in work.modules():
        for attr, value in list(vars(module).items()):
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            new = _rebind(value, memo, rebound)
            if new is not value:
                vars(module)[attr] = new
    return work


def _rebind(value: Any, memo: dict[int, Any], rebound: dict[int, Any]) -> Any:
    """``value`` with its closures pointing at copies (itself when nothing in it needs to move)."""
    if isinstance(value, types.FunctionType):
        return _rebind_function(value, memo, rebound)
    if isinstance(value, functools.partial):
        func = _rebind(value.func, memo, rebound)
        return value if func is value.func else functools.partial(func, *value.args, **value.keywords)
    if isinstance(value, list):
        for i, item in enumerate(value):
            value[i] = _rebind(item, memo, rebound)
        return value
    if type(value) is tuple:
        items = tuple(_rebind(item, memo, rebound) for item in value)
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    if isinstance(value, dict):
        for key, item in list(value.items()):
            value[key] = _rebind(item, memo, rebound)
        return value
    return value


def _rebind_function(fn: types.FunctionType, memo: dict[int, Any], rebound: dict[int, Any]) -> Any:
    if id(fn) in rebound:
        return rebound[id(fn)]
    if not fn.__closure__:
        return fn
    rebound[id(fn)] = fn  # a closure that reaches itself (recursion) stops here
    cells, moved = [], False
    for cell in fn.__closure__:
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned after the function was made)
            cells.append(cell)
            continue
        target = memo.get(id(contents), contents) if not isinstance(contents, types.FunctionType) \
            else _rebind_function(contents, memo, rebound)
        moved |= target is not contents
        cells.append(types.CellType(target) if target is not contents else cell)
    if not moved:
        return fn
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
    new.__kwdefaults__, new.__dict__ = fn.__kwdefaults__, dict(fn.__dict__)
    new.__qualname__, new.__doc__ = fn.__qualname__, fn.__doc__
    rebound[id(fn)] = new
    return new
