"""Where a bias-less key or value projection's share of a norm's β can go, proved on the traced graph.

A norm's β reaches each reader Linear ``W`` as the constant ``W β`` (``W(u + β) = W u + W β``). A
reader with a bias slot absorbs it there. Two kinds of reader without one still let β leave the
norm, exactly:

* **key projection**: keys meet queries only in the scores ``q_i · k_j``. Keys shifted by one
  vector ``b`` add ``q_i · b`` to every score of query ``i``, a per-row constant that softmax over
  the keys ignores. ``W_k β`` is *dropped*.
* **value projection**: output row ``i`` of attention is ``Σ_j p_ij v_j``. With ``Σ_j p_ij = 1``,
  values shifted by ``b`` shift every output row by ``b``, and the Linear that reads the
  attention output turns that into the constant ``W_o b``, which its bias absorbs. ``W_v β`` is
  *moved* (:class:`normswap.analysis.plan.BetaMove`).

Both facts hold only for the dataflow the trace shows, so the proofs walk forward from the
projection's output and accept nothing they cannot account for:

* up to the attention op: casts, views, transposes, splits, concatenations (a cache append),
  replayed on an index map of the projection's output features. The shift is the same vector
  for every token only if, at the attention op, each element's feature does not depend on the
  key position; the map says exactly that. A rotary embedding (a ``mul`` by position-dependent
  tables), a k-norm, padding or anything else is a stop.
* keys: ``scaled_dot_product_attention`` as the key, or a ``matmul``/``bmm``/``baddbmm`` whose
  second operand they are, whose scores then reach ``softmax``/``log_softmax`` over their last axis
  only through casts, scalar scales, row-keeping views, additions of tensors that do not depend on
  the keys (masks, ALiBi, relative position biases) and masked fills with a fill value of at most
  ``-1e4`` (which softmax maps to 0 whether or not the row is shifted). Soft-capping, clamping or a
  second use of the scores is a stop.
* values: ``scaled_dot_product_attention`` as the value with ``dropout_p == 0`` and no argument
  beyond the known ones (no sink logit), or a ``matmul``/``bmm`` whose first operand is a
  ``softmax`` over the key axis reached only through casts and dropout (eval mode), so every row
  sums to one. From there to one Linear with a bias, through casts and shape ops only (no scale, no
  gate); the index map at its input gives, per input feature, the value feature it carries.

A key/value cache filled from the projection is allowed: every cached key or value lacks the same
share, which is the point. A cache returned as a model output (``past_key_values``) then changes by
design, and the route reports it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.analysis.dataflow import ADD_OPS, IDENTITY_OPS, JOIN_OPS, PAD_OPS, SCALE_OPS, SHAPE_OPS, replay
from normswap.analysis.plan import KEY_DROP_WHY, VALUE_MOVE_WHY
from normswap.analysis.trace import Graph, ModuleCall, Op, ValueRef

SDPA = "scaled_dot_product_attention"
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
MATMUL_OPS = {"matmul", "__matmul__", "bmm"}
SOFTMAX_OPS = {"softmax", "_softmax", "special_softmax"}
SHIFT_INVARIANT_OPS = SOFTMAX_OPS | {"log_softmax", "_log_softmax"}
TEMPLATE_OPS = {"type_as", "expand_as", "view_as", "reshape_as"}  # the second argument gives a dtype/shape only
MASKED_FILL_OPS = {"masked_fill", "masked_fill_"}
ROW_VIEW_OPS = {"view", "reshape"}
MASK_LIMIT = -1e4  # a fill value at or below this has probability 0 after softmax in every float dtype
LINEAR_SLOTS = (0, "input", "hidden_states", "x")


@dataclass
class Route:
    """The fate of one reader's share ``W β``: ``dropped``, ``moved`` (into ``into``'s bias) or ``kept``."""

    how: str
    why: str
    into: str | None = None
    kind: str | None = None
    runs: list[tuple[int, int, int]] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)  # model outputs that change by design (caches)


@dataclass
class _Walk:
    """One forward walk from a projection's output, for one role (``key`` or ``value``)."""

    role: str
    states: dict[int, tuple[str, torch.Tensor | None]] = field(default_factory=dict)
    failure: str = ""
    in_role: bool = False  # reached an attention op in the walked role
    attention: int = 0  # attention ops reached in that role
    targets: dict[str, tuple[str, list[tuple[int, int, int]]]] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)


def _runs(row: torch.Tensor) -> list[tuple[int, int, int]]:
    """``row[i]`` = source feature of input feature ``i`` (NaN: none) as runs ``(i0, source0, count)``."""
    runs: list[tuple[int, int, int]] = []
    for i, x in enumerate(row.tolist()):
        if math.isnan(x):
            continue
        src = int(x)
        if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == src:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, src, 1))
    return runs


def _same_along(m: torch.Tensor, axis: int) -> bool:
    """No NaN, and every entry equal to the first one along ``axis``."""
    return m.dim() >= 2 and not bool(torch.isnan(m).any()) and bool((m == m.narrow(axis, 0, 1)).all())


class AttentionProofs:
    """Proves, per bias-less reader Linear of a norm, that its share of β can be dropped or moved."""

    def __init__(self, graph: Graph, *, by_input: dict[int, list[tuple[ModuleCall, int | str]]],
                 calls_per_path: dict[str, list[ModuleCall]], output_values: dict[int, str],
                 linear_kind: Callable[[nn.Module], str | None]) -> None:
        self.graph = graph
        self.by_input = by_input
        self.calls_per_path = calls_per_path
        self.output_values = output_values
        self.linear_kind = linear_kind

    def route(self, path: str) -> Route:
        """The route of reader ``path``'s share of β: the key proof first, then the value proof."""
        calls = self.calls_per_path.get(path, [])
        key = [self._walk(c, "key") for c in calls]
        if calls and all(not w.failure for w in key):
            return Route("dropped", KEY_DROP_WHY,
                         outputs=sorted({o for w in key for o in w.outputs}))
        value = [self._walk(c, "value") for c in calls]
        if len(calls) == 1 and not value[0].failure:
            [(into, (kind, runs))] = list(value[0].targets.items())
            return Route("moved", VALUE_MOVE_WHY,
                         into, kind, runs, sorted(value[0].outputs))
        if not calls:
            why = "never called"
        elif any(w.in_role for w in value) and not any(w.in_role for w in key):
            why = next(w.failure for w in value if w.failure) if len(calls) == 1 else "called more than once"
        else:
            why = next(w.failure for w in key if w.failure)
        return Route("kept", why)

    # ------------------------------------------------------------------ the walk
    def _walk(self, call: ModuleCall, role: str) -> _Walk:
        walk = _Walk(role)
        if len(call.outputs) != 1:
            walk.failure = "returns more than one tensor"
            return walk
        v0 = call.outputs[0]
        shape = self.graph.values[v0].shape
        if not shape:
            walk.failure = "returns a scalar"
            return walk
        view = [1] * len(shape)
        view[-1] = shape[-1]
        heap: list[int] = []
        queued: set[int] = set()

        def track(vid: int, kind: str, m: torch.Tensor | None) -> bool:
            walk.states[vid] = (kind, m)
            name = self.output_values.get(vid)
            if name is not None:
                if kind == "proj" and ("past_key_values" in name or "cache" in name.lower()):
                    walk.outputs.append(name)
                else:
                    what = {"proj": "its output", "scores": "the scores", "out": "the attention output"}[kind]
                    walk.failure = f"{what} is returned as model output `{name}`"
                    return False
            for i in self.graph.values[vid].consumers:
                if i not in queued:
                    queued.add(i)
                    heapq.heappush(heap, i)
            return True

        track(v0, "proj", torch.arange(shape[-1], dtype=torch.float64).reshape(view).expand(shape))
        while heap and not walk.failure:
            op = self.graph.ops[heapq.heappop(heap)]
            tracked = [i for i in dict.fromkeys(op.inputs) if i in walk.states]
            kinds = {walk.states[i][0] for i in tracked}
            if len(kinds) != 1:
                walk.failure = f"{self._where(op)} combines its output with what attention made of it"
                break
            step = {"proj": self._proj_step, "scores": self._scores_step, "out": self._out_step}[kinds.pop()]
            result = step(op, tracked, walk)
            if isinstance(result, str):
                walk.failure = result
                break
            for vid, (kind, m) in result.items():
                if not track(vid, kind, m):
                    break
        if not walk.failure:
            if walk.attention == 0:
                walk.failure = f"its output reaches no attention op as the {role}"
            elif role == "value" and len(walk.targets) != 1:
                walk.failure = "the attention output reaches no single Linear with a bias"
        return walk

    def _where(self, op: Op) -> str:
        path = "" if op.call is None else self.graph.calls[op.call].path
        return f"`{op.name}`" + (f" in `{path}`" if path else "")

    def _slots(self, op: Op, tracked: list[int]) -> set[int | str]:
        """Positions (positional index or kwarg name) where a tracked value is passed to ``op``."""
        slots: set[int | str] = set()
        for i, a in enumerate(op.args):
            if isinstance(a, ValueRef) and a.id in tracked:
                slots.add(i)
            elif not isinstance(a, ValueRef) and isinstance(a, (list, tuple)) and any(
                    isinstance(x, ValueRef) and x.id in tracked for x in a):
                slots.add(i)
        for k, a in op.kwargs.items():
            if isinstance(a, ValueRef) and a.id in tracked:
                slots.add(k)
        return slots

    # ------------------------------------------------------------------ projection output up to attention
    def _proj_step(self, op: Op, tracked: list[int], walk: _Walk):
        maps = {i: walk.states[i][1] for i in tracked}
        slots = self._slots(op, tracked)
        if op.name in TEMPLATE_OPS and slots == {1}:
            return {}  # used for its dtype or shape only
        if op.name in IDENTITY_OPS and slots == {0}:
            return {op.outputs[0]: ("proj", maps[tracked[0]])}
        if op.name in SHAPE_OPS or op.name in JOIN_OPS or op.name in PAD_OPS:
            res = replay(self.graph, op, maps, tracked)
            if res is None:
                return f"its output passes through {self._where(op)}, which cannot be replayed"
            return {v: ("proj", m) for v, m in res.items()}
        if op.name == SDPA:
            return self._sdpa(op, slots, maps, walk)
        if op.name in MATMUL_OPS or op.name == "baddbmm":
            return self._matmul(op, slots, maps, walk)
        return f"its output reaches {self._where(op)} before any attention"

    def _sdpa(self, op: Op, slots: set[int | str], maps: dict[int, torch.Tensor], walk: _Walk):
        names = {SDPA_PARAMS[s] if isinstance(s, int) and s < len(SDPA_PARAMS) else s for s in slots}
        if names != {walk.role}:
            return f"its output is the {'/'.join(sorted(map(str, names)))} of {self._where(op)}"
        walk.in_role = True
        extra = [k for k in op.kwargs if k not in SDPA_PARAMS]
        if extra or len(op.args) > len(SDPA_PARAMS):
            return f"{self._where(op)} has arguments beyond {', '.join(SDPA_PARAMS)} ({', '.join(extra) or 'more'})"
        operand = op.args[SDPA_PARAMS.index(walk.role)] if len(op.args) > SDPA_PARAMS.index(walk.role) \
            else op.kwargs[walk.role]
        m = maps[operand.id]
        if not _same_along(m, -2):
            return f"its {walk.role}s carry different features at different key positions in {self._where(op)}"
        walk.attention += 1
        if walk.role == "key":
            return {}
        dropout = op.args[4] if len(op.args) > 4 else op.kwargs.get("dropout_p", 0.0)
        if not isinstance(dropout, (int, float)) or dropout != 0:
            return f"{self._where(op)} drops attention weights (dropout_p={dropout})"
        out = op.outputs[0]
        out_shape = self.graph.values[out].shape
        base = m.narrow(-2, 0, 1)
        if len(out_shape) >= 3 and base.dim() >= 3 and base.shape[-3] != out_shape[-3]:
            gqa = op.args[7] if len(op.args) > 7 else op.kwargs.get("enable_gqa", False)
            if gqa is not True or out_shape[-3] % base.shape[-3]:
                return f"{self._where(op)}: value heads do not match the output heads"
            base = base.repeat_interleave(out_shape[-3] // base.shape[-3], dim=-3)
        try:
            return {out: ("out", base.broadcast_to(out_shape))}
        except RuntimeError:
            return f"{self._where(op)}: the output does not line up with the values"

    def _matmul(self, op: Op, slots: set[int | str], maps: dict[int, torch.Tensor], walk: _Walk):
        operand_slot = 2 if op.name == "baddbmm" else 1
        if slots == {0}:
            return f"its output is the first operand of {self._where(op)} (queries or attention weights)"
        if slots != {operand_slot} or (op.name == "baddbmm" and walk.role == "value"):
            return f"its output enters {self._where(op)} in a way the proof does not cover"
        m = maps[op.args[operand_slot].id]
        out = op.outputs[0]
        # which operand it is shows in the map: keys enter transposed (features along -2, key positions
        # along -1), values as they are (key positions along -2, features along -1)
        as_key, as_value = _same_along(m, -1), _same_along(m, -2) and op.name != "baddbmm"
        if walk.role == "key":
            if as_value and not as_key:
                return f"its output is the value operand of {self._where(op)}"
            walk.in_role = True
            if not as_key:
                return f"its keys carry different features at different key positions in {self._where(op)}"
            walk.attention += 1
            return {out: ("scores", None)}
        if as_key and not as_value:
            return f"its output is the key operand of {self._where(op)}"
        walk.in_role = True
        if not as_value:
            return f"its values carry different features at different key positions in {self._where(op)}"
        why = self._row_stochastic(op.args[0])
        if why:
            return f"{self._where(op)}: {why}"
        walk.attention += 1
        try:
            return {out: ("out", m.narrow(-2, 0, 1).broadcast_to(self.graph.values[out].shape))}
        except RuntimeError:
            return f"{self._where(op)}: the output does not line up with the values"

    def _row_stochastic(self, ref: object) -> str:
        """'' if ``ref`` is a softmax over its last axis, reached through casts/dropout only."""
        if not isinstance(ref, ValueRef):
            return "the attention weights are not a tensor"
        value = self.graph.values[ref.id]
        while True:
            op = self.graph.producer(value)
            if op is None:
                return "the attention weights come from outside the traced forward"
            if op.name in IDENTITY_OPS and op.args and isinstance(op.args[0], ValueRef):
                value = self.graph.values[op.args[0].id]
                continue
            if op.name not in SOFTMAX_OPS:
                return f"the attention weights come from `{op.name}`, not a softmax (rows may not sum to 1)"
            dim = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim")
            if not isinstance(dim, int) or dim % len(value.shape) != len(value.shape) - 1:
                return "the attention weights are a softmax over another axis"
            sums = self.graph.values[ref.id].tensor.double().sum(-1)
            if not bool(torch.allclose(sums, torch.ones_like(sums), atol=1e-4)):
                return "the attention weights' rows do not sum to 1"
            return ""

    # ------------------------------------------------------------------ keys: scores up to the softmax
    def _scores_step(self, op: Op, tracked: list[int], walk: _Walk):
        slots = self._slots(op, tracked)
        others = [a for i, a in enumerate(op.args) if i not in slots]
        shape = self.graph.values[tracked[0]].shape
        out_shape = self.graph.values[op.outputs[0]].shape if op.outputs else ()
        if op.name in IDENTITY_OPS and slots == {0}:
            return {op.outputs[0]: ("scores", None)}
        if op.name in ROW_VIEW_OPS and slots == {0} and out_shape[-1:] == shape[-1:]:
            return {op.outputs[0]: ("scores", None)}  # rows stay rows
        if op.name in SCALE_OPS and len(slots) == 1 and (op.name in ("neg", "__neg__") or (
                len(others) == 1 and self._row_constant(others[0])
                and (slots == {0} or not op.name.startswith(("div", "__truediv", "__itruediv"))))):
            return {op.outputs[0]: ("scores", None)}
        if op.name in ADD_OPS and len(slots) == 1 and slots <= {0, 1} and out_shape[-1:] == shape[-1:]:
            return {op.outputs[0]: ("scores", None)}  # a mask, ALiBi or a position bias: not from the keys
        if op.name in MASKED_FILL_OPS and slots == {0} and len(op.args) >= 3 and self._masked(op.args[2]):
            return {op.outputs[0]: ("scores", None)}
        if op.name == "where" and len(op.args) == 3 and slots in ({1}, {2}) \
                and self._masked(op.args[3 - next(iter(slots))]):
            return {op.outputs[0]: ("scores", None)}
        if op.name in SHIFT_INVARIANT_OPS and slots == {0}:
            dim = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim")
            if isinstance(dim, int) and dim % len(shape) == len(shape) - 1:
                return {}  # the shift is gone
            return f"{self._where(op)} normalises the scores over another axis than the keys"
        return f"the scores pass through {self._where(op)} before the softmax"

    def _row_constant(self, a: object) -> bool:
        """A number, or a tensor constant along the key axis (size 1 there)."""
        if isinstance(a, ValueRef):
            shape = self.graph.values[a.id].shape
            return math.prod(shape) == 1 or (len(shape) > 0 and shape[-1] == 1)
        return isinstance(a, (int, float)) and not isinstance(a, bool)

    def _masked(self, a: object) -> bool:
        """A fill value (number or traced tensor) that softmax turns into probability 0."""
        if isinstance(a, ValueRef):
            t = self.graph.values[a.id].tensor
            return t.is_floating_point() and t.numel() > 0 and bool((t.double() <= MASK_LIMIT).all())
        return isinstance(a, (int, float)) and not isinstance(a, bool) and a <= MASK_LIMIT

    # ------------------------------------------------------------------ values: attention output to a Linear
    def _out_step(self, op: Op, tracked: list[int], walk: _Walk):
        vid = tracked[0]
        for call, slot in self.by_input.get(vid, []):
            if slot in LINEAR_SLOTS and self.linear_kind(call.module) and call.start_op <= op.index < call.end_op:
                return self._into(call, walk.states[vid][1], walk)
        maps = {i: walk.states[i][1] for i in tracked}
        slots = self._slots(op, tracked)
        if op.name in IDENTITY_OPS and slots == {0}:
            return {op.outputs[0]: ("out", maps[vid])}
        if op.name in SHAPE_OPS or op.name in JOIN_OPS:
            res = replay(self.graph, op, maps, tracked)
            if res is not None:
                return {v: ("out", m) for v, m in res.items()}
        return f"the attention output passes through {self._where(op)} before a Linear"

    def _into(self, call: ModuleCall, m: torch.Tensor, walk: _Walk):
        module = call.module
        kind = self.linear_kind(module)
        width = module.in_features if kind == "linear" else module.weight.shape[0]
        if getattr(module, "bias", None) is None:
            return f"`{call.path}` reads the attention output but has no bias slot"
        if len(self.calls_per_path.get(call.path, [])) != 1:
            return f"`{call.path}` is called more than once"
        if m.shape[-1] != width:
            return f"`{call.path}` reads the attention output along another axis"
        rows = torch.nan_to_num(m.reshape(-1, width), nan=-1.0)
        if not bool((rows == rows[:1]).all()):
            return f"the tokens reaching `{call.path}` carry different value features"
        row = m.reshape(-1, width)[0]
        if bool(torch.isnan(row).all()):
            return f"`{call.path}` reads none of the values"
        walk.targets[call.path] = (kind, _runs(row))
        return {}
