"""Op tables and index-map replay on a traced graph, shared by the analysis and the attention proofs.

An *index map* is a float64 tensor shaped like a traced value whose entries say where each element
came from (a writer's output feature, a projection's output feature); NaN marks elements from
elsewhere. Replaying a shape-only op on maps instead of data tells, exactly, where every element
of the source lands, whatever mix of views, transposes, splits, flips, rolls, gathers and
concatenations the model uses.

Some ops do arithmetic across tokens but treat every channel alike: interpolating a position
grid, averaging or summing over tokens, average pooling, a convolution whose kernel is the same
for every channel. Written ``y[p', c] = Σ_p W[p', p] x[p, c]`` (one ``W`` for every channel ``c``),
they map a token that is zero-mean over the channels to one that is zero-mean again:
``mean_c y[p'] = Σ_p W[p', p] mean_c x[p] = 0``. :func:`channel_mixing` proves that form for one
traced op, numerically, in float64, on the op itself (no per-op knowledge of what it computes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from normswap.analysis.trace import Graph, Op, ValueRef

ADD_OPS = {"add", "__add__", "__radd__", "add_", "__iadd__", "sub", "__sub__", "__rsub__", "sub_", "__isub__"}
IDENTITY_OPS = {"to", "type", "float", "half", "bfloat16", "double", "type_as", "detach", "dropout",
                "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d",
                "contiguous", "clone"}
SHAPE_OPS = {"view", "reshape", "flatten", "unflatten", "permute", "transpose", "t", "T", "mT", "squeeze",
             "unsqueeze", "expand", "expand_as", "broadcast_to", "view_as", "reshape_as", "movedim", "moveaxis",
             "swapaxes", "swapdims",
             "__getitem__", "select", "narrow", "split", "chunk", "unbind", "tensor_split", "repeat",
             "index_select", "split_with_sizes",
             # element moves: every output element is one input element (exact on index maps)
             "flip", "fliplr", "flipud", "roll", "gather", "take_along_dim", "tile", "repeat_interleave"}
SCALE_OPS = {"mul", "__mul__", "__rmul__", "mul_", "__imul__", "div", "__truediv__", "div_", "__itruediv__",
             "neg", "__neg__"}
JOIN_OPS = {"cat", "concat", "concatenate", "stack"}
PAD_OPS = {"pad"}
ZERO_FILL_OPS = {"__setitem__", "masked_fill", "masked_fill_"}  # a pass-through when the fill is 0
# Ops that sum (or average) whole rows of a source into rows of ``self``, one weight per row shared by every
# feature: ``y = self ⊕ Σ w·source rows`` (message passing, a fused MoE's routed experts). Each maps to where
# it takes the source (position, keyword); ``self`` is its first argument. Proved per use by channel_mixing
# (with ``self`` zeroed), and only the linear reductions qualify (:func:`row_sum_parts`).
ROW_SUM_OPS = {"index_add": (3, "source"), "index_add_": (3, "source"), "scatter_add": (3, "src"),
               "scatter_add_": (3, "src"), "scatter_reduce": (3, "src"), "scatter_reduce_": (3, "src"),
               "index_put": (2, "values"), "index_put_": (2, "values")}
# Ops that may mix tokens with weights every channel shares; each use is proved by channel_mixing.
MIX_OPS = {"interpolate", "upsample", "upsample_nearest", "upsample_bilinear", "mean", "sum", "nanmean", "cumsum",
           "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
           "adaptive_avg_pool3d", "conv1d", "conv2d", "conv3d",
           # a matmul of data by data (a sparse or dense adjacency over tokens, attention weights over a stream)
           "mm", "matmul", "__matmul__", "__rmatmul__", "bmm", "einsum", "sparse_mm", "_sparse_mm", "spmm",
           "segment_reduce",  # sums or means over contiguous segments of rows (proved linear: max is not)
           *ROW_SUM_OPS}
# Ops that create a tensor of zeros from no data: a term that adds nothing (``torch.zeros_like(x).index_add(...)``).
ZERO_OPS = {"zeros", "zeros_like", "new_zeros", "full", "full_like", "new_full"}
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
            return maps[a.id].contiguous()  # an expanded map cannot take a ``view`` its traced tensor took
        if join:
            return torch.full(graph.values[a.id].shape, math.nan, dtype=torch.float64)
        return graph.values[a.id].tensor  # index tensors etc.

    if op.name in SHAPE_OPS and not (op.args and isinstance(op.args[0], ValueRef) and op.args[0].id in tracked):
        return None  # the tracked tensor is an index, not the data
    args = pytree.tree_map(sub, op.args)
    kwargs = pytree.tree_map(sub, op.kwargs)
    if op.name in PAD_OPS and pad_mode(op) == "constant":
        kwargs = dict(kwargs, value=math.nan, mode="constant")  # the padding comes from elsewhere
        if len(args) > 2:
            args = args[:2]
    # reflect / replicate / circular padding copies input elements: replayed as it is
    try:
        res = op.func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op we cannot replay is simply not a pass-through
        return None
    leaves = [r for r in pytree.tree_leaves(res) if isinstance(r, torch.Tensor)]
    if len(leaves) != len(op.outputs):
        return None
    return dict(zip(op.outputs, leaves, strict=True))


def pad_mode(op: Op) -> str:
    """The mode of a traced ``pad`` (``constant`` unless the call said otherwise)."""
    mode = op.kwargs.get("mode", op.args[2] if len(op.args) > 2 else "constant")
    return mode if isinstance(mode, str) else "constant"


def pad_value(op: Op) -> float:
    """The fill value of a traced constant ``pad`` (0 when the call gave none)."""
    value = op.kwargs.get("value", op.args[3] if len(op.args) > 3 else None)
    return 0.0 if value is None else value if isinstance(value, (int, float)) else math.nan


@dataclass(frozen=True)
class Mixing:
    """A traced op proved to be ``y[p', c] = Σ_p W[p', p] x[p, c]`` in its data input ``x``.

    ``in_axis``/``out_axis``: the channel axis of ``x`` and of ``y`` (same size; every other axis is a
    position). ``keeps_constants``: every output position's weights sum to 1 (a mean, an
    interpolation), so a vector added to every token (a norm's β) comes out unchanged.
    """

    in_axis: int
    out_axis: int
    keeps_constants: bool


def row_sum_parts(op: Op) -> tuple[int, int] | None:
    """``(self, source)`` value ids of a :data:`ROW_SUM_OPS` op that sums whole rows linearly (``index_add``,
    ``scatter_add``, ``scatter_reduce`` with ``sum``/``mean``, ``index_put`` with ``accumulate=True``), else None."""
    where = ROW_SUM_OPS.get(op.name)
    if where is None or not op.args or not isinstance(op.args[0], ValueRef):
        return None
    src = op.kwargs.get(where[1], op.args[where[0]] if len(op.args) > where[0] else None)
    if not isinstance(src, ValueRef) or src == op.args[0]:
        return None
    if op.name.startswith("scatter_reduce"):
        reduce = op.kwargs.get("reduce", op.args[4] if len(op.args) > 4 else None)
        if reduce not in ("sum", "mean"):
            return None  # prod, amax, amin: not linear
    if op.name.startswith("index_put") and not op.kwargs.get("accumulate", op.args[3] if len(op.args) > 3 else False):
        return None  # a plain write, not a sum
    return op.args[0].id, src.id


def is_zeros(op: Op) -> bool:
    """Does ``op`` create a tensor of zeros from no data (``torch.zeros_like(x)``, ``x.new_zeros(n, d)``)?"""
    if op.name not in ZERO_OPS or op.inputs:
        return False
    if op.name.endswith("zeros") or op.name == "zeros_like":
        return True
    at = 2 if op.name == "new_full" else 1  # full(size, v), full_like(x, v), x.new_full(size, v)
    fill = op.kwargs.get("fill_value", op.args[at] if len(op.args) > at else None)
    return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill == 0


def run_on(graph: Graph, op: Op, vid: int, x: torch.Tensor, zero: tuple[int, ...] = ()) -> object:
    """``op`` run again on float64 data ``x`` in place of value ``vid``, the values ``zero`` as zeros and every
    other argument as traced; for a row sum (:func:`row_sum_parts`) fed ``vid`` as its source, ``self`` as
    zeros too (its rows are the op's other term). None when it fails."""
    parts = row_sum_parts(op)
    if parts is not None and parts[1] == vid:
        zero = (*zero, parts[0])

    def arg(a: object) -> object:
        if isinstance(a, ValueRef) and a.id in zero and a.id != vid:
            return torch.zeros(graph.values[a.id].shape, dtype=x.dtype)
        return replay_arg(graph, a, vid, x)

    args, kwargs = pytree.tree_map(arg, (op.args, op.kwargs))
    try:
        with torch.no_grad():
            return op.func(*args, **kwargs)
    except Exception:  # noqa: BLE001 - not replayable on float64 data
        return None


def channel_mixing(graph: Graph, op: Op, vid: int) -> tuple[Mixing, ...]:
    """Prove, on the traced op in float64, that it mixes positions of ``vid`` with channel-shared weights.

    Returns every (input, output) channel-axis pair for which it holds (a mean over tokens is
    channel-shared along the features and along the batch alike; the index map decides which one
    carries the features), or ``()``.

    ``op`` (a :data:`MIX_OPS` name) is replayed with its data argument (``vid``, in any one position: an
    adjacency matmul takes it second, an ``einsum`` after its equation; a row sum as its source, with its
    ``self`` zeroed) replaced by random tensors and every other argument as traced. Checked, for a
    channel axis ``a`` of the input and ``b`` of the output of the same size:

    - linear: ``f(x1 + 2 x2) = f(x1) + 2 f(x2)`` and ``f(0) = 0`` (a bias or a fill value fails);
    - channels kept apart: ``f(x ⊙ v) = f(x) ⊙ v`` for a channel vector ``v`` with distinct entries
      (a linear map that commutes with such a diagonal map never sends one channel into another);
    - one ``W`` for all: ``f(roll(x, 1, a)) = roll(f(x), 1, b)`` (a cyclic shift links every channel
      to the next, so every channel's ``W`` equals its neighbour's).

    On random inputs a linear map that breaks an identity satisfies it with probability 0. A
    depthwise convolution with a kernel per channel, or a per-channel scale, fails the last check.
    """
    parts = row_sum_parts(op)
    if op.name not in MIX_OPS or len(op.outputs) != 1 \
            or (op.name in ROW_SUM_OPS and (parts is None or parts[1] != vid)) \
            or sum(isinstance(r, ValueRef) and r.id == vid for r in pytree.tree_leaves((op.args, op.kwargs))) != 1:
        return ()
    return shared_axes(graph, op, vid)


def weight_axes(graph: Graph, op: Op, weight: int, bias: int | None = None) -> tuple[Mixing, ...]:
    """Which axis of a contraction's weight operand becomes which axis of its output, proved on the op.

    The same identities as :func:`channel_mixing`, with the weight operand (value ``weight``) in the role of
    the data and the data operands as traced (a ``bias`` operand zeroed): a pair ``(a, b)`` holds when output
    position ``i`` along ``b`` is one linear function, the same for every ``i``, of the weight's slice ``i``
    along ``a`` alone. Centering the weight along ``a`` then centers the output along ``b``, whatever
    ``einsum``, ``@``, ``bmm``, ``F.linear`` or ``addmm`` spells the contraction.
    """
    if len(op.outputs) != 1 or sum(isinstance(r, ValueRef) and r.id == weight
                                   for r in pytree.tree_leaves((op.args, op.kwargs))) != 1:
        return ()
    return shared_axes(graph, op, weight, zero=() if bias is None else (bias,))


def shared_axes(graph: Graph, op: Op, vid: int, zero: tuple[int, ...] = ()) -> tuple[Mixing, ...]:
    """The (input axis of ``vid``, output axis) pairs along which ``op`` is linear in ``vid``, keeps the
    positions along that axis apart and applies one map to each (see :func:`channel_mixing`)."""
    in_shape, out_shape = graph.values[vid].shape, graph.values[op.outputs[0]].shape
    if not in_shape or not out_shape or not math.prod(in_shape) or not math.prod(out_shape):
        return ()
    dtype, tol = torch.float64, 1e-9
    traced = graph.values[vid].tensor.dtype

    def f(x: torch.Tensor) -> torch.Tensor | None:
        y = run_on(graph, op, vid, x, zero)
        ok = isinstance(y, torch.Tensor) and tuple(y.shape) == tuple(out_shape) and y.dtype == dtype
        return y if ok else None

    gen = torch.Generator().manual_seed(op.index)
    x1 = torch.randn(in_shape, generator=gen, dtype=torch.float64)
    x2 = torch.randn(in_shape, generator=gen, dtype=torch.float64)
    if f(x1) is None and traced in (torch.float32, torch.float16, torch.bfloat16):
        # an op with no float64 kernel here (``torch._grouped_mm``, a fused MoE's experts): proved in float32,
        # where an identity a linear map breaks still misses by O(1), far above float32 rounding
        dtype, tol = torch.float32, 1e-4
        x1, x2 = x1.float(), x2.float()
    y1, y2, y12, y0 = f(x1), f(x2), f(x1 + 2 * x2), f(torch.zeros_like(x1))
    if y1 is None or y2 is None or y12 is None or y0 is None:
        return ()
    scale = float(max(y1.abs().max(), y2.abs().max(), 1e-300))

    def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
        return a is not None and bool(((a - b).abs() <= tol * scale).all())

    if not same(y12, y1 + 2 * y2) or not same(y0, torch.zeros_like(y0)) or not bool((y1 != 0).any()):
        return ()
    ones = f(torch.ones_like(x1))
    keeps = ones is not None and bool(((ones - 1).abs() <= tol).all())
    found = []
    for a, d in enumerate(in_shape):
        if d < 2:
            continue
        for b, e in enumerate(out_shape):
            if e != d:
                continue
            v = 1 + torch.rand(d, generator=gen, dtype=torch.float64).to(dtype)
            va = v.reshape([d if i == a else 1 for i in range(len(in_shape))])
            vb = v.reshape([d if i == b else 1 for i in range(len(out_shape))])
            if same(f(x1 * va), y1 * vb) and same(f(x1.roll(1, a)), y1.roll(1, b)):
                found.append(Mixing(a, b, keeps))
    return tuple(found)


def replay_arg(graph: Graph, a: object, vid: int, x: torch.Tensor) -> object:
    """One argument of an op run again on data ``x`` (float64, or float32 where the op has no float64 kernel)
    in place of value ``vid``: other traced tensors as they were, floating ones in ``x``'s dtype (a conv's
    weight must match its input's dtype)."""
    if not isinstance(a, ValueRef):
        return a
    if a.id == vid:
        return x
    t = graph.values[a.id].tensor
    return t.to(x.dtype) if t.is_floating_point() else t
