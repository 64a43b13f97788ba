"""Op tables and index-map replay on a traced graph, shared by the analysis and the attention proofs.

An *index map* is a float64 tensor shaped like a traced value whose entries say where each element
came from (a writer's output feature, a projection's output feature); NaN marks elements from
elsewhere. Replaying a shape-only op on maps instead of data tells, exactly, where every element
of the source lands, whatever mix of views, transposes, splits and concatenations the model uses.
"""

from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

from normswap.trace import Graph, Op, ValueRef

ADD_OPS = {"add", "__add__", "__radd__", "add_", "__iadd__", "sub", "__sub__", "__rsub__", "sub_", "__isub__"}
IDENTITY_OPS = {"to", "type", "float", "half", "bfloat16", "double", "type_as", "detach", "dropout",
                "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d",
                "contiguous", "clone"}
SHAPE_OPS = {"view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "squeeze", "unsqueeze",
             "expand", "expand_as", "view_as", "reshape_as", "movedim", "moveaxis", "swapaxes", "swapdims",
             "__getitem__", "select", "narrow", "split", "chunk", "unbind", "tensor_split", "repeat",
             "index_select", "split_with_sizes"}
SCALE_OPS = {"mul", "__mul__", "__rmul__", "mul_", "__imul__", "div", "__truediv__", "div_", "__itruediv__",
             "neg", "__neg__"}
JOIN_OPS = {"cat", "concat", "concatenate", "stack"}
PAD_OPS = {"pad"}
# Readers may only be reached through ops that keep the feature axis last and unmixed.
READER_OPS = IDENTITY_OPS | {"view", "reshape", "__getitem__", "select", "narrow", "squeeze", "unsqueeze",
                             "index_select", "expand", "split", "chunk", "unbind", "flatten"}


def replay(graph: Graph, op: Op, maps: dict[int, torch.Tensor], tracked: list[int]) -> dict[int, torch.Tensor] | None:
    """Index maps of the outputs of a shape, join or pad ``op`` (``None``: not replayable as one).

    Tracked inputs (keys of ``maps``) are replaced by their maps; untracked members of a join and
    the padding become NaN; any other untracked tensor (an index) keeps its traced value. A shape
    op must have the tracked tensor as its data argument, not as an index.
    """
    join = op.name in JOIN_OPS

    def sub(a: object) -> object:
        if not isinstance(a, ValueRef):
            return a
        if a.id in maps:
            return maps[a.id]
        if join:
            return torch.full(graph.values[a.id].shape, math.nan, dtype=torch.float64)
        return graph.values[a.id].tensor  # index tensors etc.

    if op.name in SHAPE_OPS and not (op.args and isinstance(op.args[0], ValueRef) and op.args[0].id in tracked):
        return None  # the tracked tensor is an index, not the data
    args = pytree.tree_map(sub, op.args)
    kwargs = pytree.tree_map(sub, op.kwargs)
    if op.name in PAD_OPS:
        kwargs = dict(kwargs, value=math.nan, mode="constant")
        if len(args) > 2:
            args = args[:2]
    try:
        res = op.func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op we cannot replay is simply not a pass-through
        return None
    leaves = [r for r in pytree.tree_leaves(res) if isinstance(r, torch.Tensor)]
    if len(leaves) != len(op.outputs):
        return None
    return dict(zip(op.outputs, leaves, strict=True))
