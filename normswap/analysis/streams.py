"""Dataflow analysis: for each LayerNorm, who writes the stream it reads and who reads its output.

One generic mechanism for every model (no per-architecture adapters):

1. **Writers.** Walk back from a norm's input through residual adds, shape-only ops, casts, dropout,
   scalar scales, and token mixes whose weights every channel shares (an interpolated position grid,
   a mean over tokens: ``Σ_p W[p', p] x[p]`` keeps zero-mean tokens zero-mean; proved per traced op
   by :func:`normswap.analysis.dataflow.channel_mixing`, so the verdict does not depend on the input shape
   that decided whether the model interpolates). Each leaf is a *term* of the stream: a Linear /
   HF Conv1D / Embedding / Conv output, a raw Parameter (cls token, position table), or something
   that cannot be centered by weight surgery (a norm output = Post-LN, a non-linearity, a model
   input, a regenerated buffer).
2. **Can a writer be centered?** Propagate an *index map* forward from the writer: a float64 tensor
   holding, per element, which output feature (or parameter element) it came from. Shape ops are
   replayed on it. Where it lands in a norm's input we learn which features form each normalised
   row (the whole output for a residual stream, one head's block for a per-head q/k norm). Through a
   channel-shared token mix, every output token is a combination of input tokens that must all hold
   the same group of features; the output map is that group (:meth:`Analyzer._mix`). Where it
   lands anywhere else we learn which features something *other* than a norm reads. Centering is
   function-preserving iff every affected row is a full norm row of *one token* of the writer's
   output (a second map carries token ids: centering shifts each token by its own mean, and a
   LayerNorm row is invariant to one shift only, so a Swin patch merging's rows of 4 tokens are not;
   :meth:`Analyzer._token_groups`) and nothing else reads those features.
3. **Centering ops.** A term that cannot be centered by surgery gets one centering op at the
   earliest module boundary downstream of it whose value flows only into norm rows. If there is
   none (Post-LN: the stream is also read by attention), the norm is *approximate*.
4. **Readers.** Walk forward from the norm output through shape ops, casts and token means
   (channel-shared weights summing to 1: a reader after a mean still sees ``γ ⊙ mean(u) + β``).
   Linear / Conv1D readers that see the norm's features unpermuted can absorb β (into their bias) and γ.

This module answers those questions (:class:`Analyzer`); :mod:`normswap.analysis.planner` asks them for every
norm and turns the answers into the plan.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils import _pytree as pytree

from normswap.analysis.attention import AttentionProofs
from normswap.analysis.dataflow import (
    ADD_OPS,
    IDENTITY_OPS,
    JOIN_OPS,
    MIX_OPS,
    PAD_OPS,
    READER_OPS,
    SCALE_OPS,
    SHAPE_OPS,
    ZERO_FILL_OPS,
    Mixing,
    channel_mixing,
    is_zeros,
    pad_mode,
    pad_value,
    replay,
    row_sum_parts,
    run_on,
    weight_axes,
)
from normswap.analysis.linears import LAYOUT_OPS, LinearView, ParamContraction, linear_module_kind
from normswap.analysis.plan import (
    CenterHook,
    MeanCarry,
    Untie,
    WriterEdit,
)
from normswap.analysis.trace import Graph, ModuleCall, Op, Value, ValueRef, layout_coords
from normswap.analysis.walker import NormSite


def writer_kind(module: nn.Module | LinearView | ParamContraction) -> str | None:
    if isinstance(module, ParamContraction):
        return "contraction"  # a parameter through layout ops into einsum / @ / bmm / F.linear (linears.py)
    linear = linear_module_kind(module)
    if linear is not None:
        return linear
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and module.groups == 1:
        return "conv"  # grouped/depthwise convs do not mix channels: centering their weights centers nothing
    return None


def _linear_kind(module: nn.Module) -> str | None:
    """``linear`` / ``conv1d`` for the Linear-like modules whose input features β/γ can fold into."""
    kind = writer_kind(module)
    return kind if kind in ("linear", "conv1d") else None


# (param attr, axis of output features) per writer kind
_WRITER_PARAMS = {
    "linear": (("weight", 0), ("bias", 0)),
    "conv1d": (("weight", 1), ("bias", 0)),
    "embedding": (("weight", 1),),
    "conv": (("weight", 0), ("bias", 0)),
}
# a contraction's output axis is proved per call (Analyzer._contraction_centering); -1 is where its output
# reaches (which model outputs an edit changes: any axis's map reaches the same values)
OUTPUT_AXIS = {"linear": -1, "conv1d": -1, "embedding": -1, "conv": 1, "contraction": -1}


@dataclass
class Term:
    """One leaf of a stream: where part of a norm's input comes from."""

    value: int
    kind: str  # module | param | norm | op | input | buffer | external
    label: str  # human-readable origin
    module_path: str | None = None
    call: int | None = None


@dataclass
class Reach:
    """Where an index map propagated from one value ended up."""

    site_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # site call id -> map at its input
    blockers: list[tuple[str, set[int]]] = field(default_factory=list)  # (what, features it reads)
    outputs: list[str] = field(default_factory=list)
    mapped: dict[int, torch.Tensor] = field(default_factory=dict)  # every value reached
    conflict: str | None = None
    token_width: int = 0  # > 0: the maps hold ``token * token_width + feature`` (Analyzer.reach(tokens=True))
    # flat element ids summed with each other (a table added to a slice of itself): centering along one axis of
    # the parameter keeps each sum centered only where both lie at the same place along that axis
    sums: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class _TokenIds:
    """Fresh token ids for a token-tracking reach: each output token of a channel-shared mix is a new one."""

    def __init__(self, width: int, first: int) -> None:
        self.width, self.next = width, first

    def fresh(self, count: int) -> int:
        base, self.next = self.next, self.next + count
        return base


# adds whose result is exactly the sum of their two operands (no ``alpha``): a residual sum
_PLAIN_ADDS = frozenset({"add", "__add__", "__radd__", "add_", "__iadd__"})


class Analyzer:
    def __init__(self, model: nn.Module, graph: Graph, sites: list[NormSite], *, untie: bool | None,
                 fold_gamma: bool, fold_beta: bool = True) -> None:
        self.model = model
        self.graph = graph
        self.sites = {s.path: s for s in sites}
        self.untie = untie  # None: keep ties of writers (a centering op instead); readers untie where they need it
        self.fold_gamma = fold_gamma
        self.fold_beta = fold_beta
        self.bias_slots = False  # bias-less Linear readers may get a bias for β (planner.analyse sets it)
        self.modules: dict[str, nn.Module | LinearView] = dict(model.named_modules())
        for c in graph.calls:  # Linear maps the model's code applies to parameters itself (normswap.analysis.linears)
            if c.functional and isinstance(c.module, (LinearView, ParamContraction)):
                self.modules.setdefault(c.path, c.module)
        self.by_output = graph.call_by_output()
        self.by_input = graph.call_by_input()
        self.site_calls = [c for c in graph.calls if c.path in self.sites]
        self.site_call_ids = {c.id for c in self.site_calls}
        self.site_input = {c.id: c.first_input() for c in self.site_calls}
        self.site_output = {c.id: (c.outputs[0] if c.outputs else None) for c in self.site_calls}
        self.input_to_sites: dict[int, list[ModuleCall]] = {}
        for c in self.site_calls:
            if self.site_input[c.id] is not None:
                self.input_to_sites.setdefault(self.site_input[c.id], []).append(c)
        # every path a value is returned at: a model may return one tensor twice (SAM 2's Hiera returns its
        # last stage as ``last_hidden_state`` and as ``intermediate_hidden_states[3]``), and each copy is changed
        self.output_paths: dict[int, list[str]] = {}
        for path, vid in graph.outputs:
            self.output_paths.setdefault(vid, []).append(path)
        self.output_values = {vid: paths[-1] for vid, paths in self.output_paths.items()}  # one name per value
        self.calls_per_path: dict[str, list[ModuleCall]] = {}
        for c in graph.calls:
            self.calls_per_path.setdefault(c.path, []).append(c)
        self._leaf_memo: dict[int, list[Term]] = {}
        self.stream_writers: set[str] = set()  # module paths that write some norm's input stream
        self._reach_memo: dict[tuple[int, str], Reach] = {}
        self._norm_dep_memo: dict[int, bool] = {}
        # mul op -> (λ param, writer path, scaled value, offset: the effective λ is param + offset)
        self.layer_scales: dict[int, tuple[str, str, int, float]] = {}
        self.param_owners: dict[int, list[tuple[str, str]]] = {}
        for mpath, module in model.named_modules(remove_duplicate=False):
            for attr, p in module._parameters.items():
                if p is not None:
                    self.param_owners.setdefault(id(p), []).append((mpath, attr))
        self.param_values: dict[int, list[Value]] = {}
        for v in graph.values.values():
            if v.source == "param":
                self.param_values.setdefault(id(v.tensor), []).append(v)
        self.param_name = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.param_name.setdefault(id(p), name)
        self.attention = AttentionProofs(graph, by_input=self.by_input, calls_per_path=self.calls_per_path,
                                         output_values=self.output_values, linear_kind=_linear_kind)
        self.cache_outputs: set[str] = set()  # key/value caches changed by a dropped or moved β share
        self._mixing_memo: dict[tuple[int, int], tuple[Mixing, ...]] = {}
        # norm rows -> their feature groups (:meth:`_remembered`): keyed on the row map's memory, dtype, shape,
        # strides and version, the tensor kept with the entry (so that memory is no other tensor's while it lives)
        self._groups_memo: dict[tuple, tuple[torch.Tensor, set[tuple[int, ...]], str]] = {}

    # ------------------------------------------------------------------ helpers
    def _call_of_op(self, op: Op) -> str:
        return "" if op.call is None else self.graph.calls[op.call].path

    def _inside(self, op_index: int, call: ModuleCall) -> bool:
        return call.start_op <= op_index < call.end_op

    def mixing(self, op: Op, vid: int) -> tuple[Mixing, ...]:
        """How ``op`` is proved to mix positions of ``vid`` with channel-shared weights (:func:`channel_mixing`)."""
        key = (op.index, vid)
        if key not in self._mixing_memo:
            self._mixing_memo[key] = channel_mixing(self.graph, op, vid) if op.name in MIX_OPS else ()
        return self._mixing_memo[key]

    def _site_output_call(self, vid: int) -> ModuleCall | None:
        for call in self.by_output.get(vid, []):
            if call.id in self.site_call_ids:
                return call
        return None

    def _writer_call(self, vid: int) -> ModuleCall | None:
        calls = [c for c in self.by_output.get(vid, []) if writer_kind(c.module)]
        return calls[0] if calls else None  # innermost

    # ------------------------------------------------------------------ 1. writers (backward)
    def leaves(self, vid: int) -> list[Term]:
        if vid in self._leaf_memo:
            return self._leaf_memo[vid]
        self._leaf_memo[vid] = []  # cycle guard
        value = self.graph.values[vid]
        terms = self._leaves(value)
        seen, unique = set(), []
        for t in terms:
            if t.value not in seen:
                seen.add(t.value)
                unique.append(t)
        self._leaf_memo[vid] = unique
        return unique

    def _leaves(self, value: Value) -> list[Term]:
        site_call = self._site_output_call(value.id)
        if site_call is not None:
            return [Term(value.id, "norm", f"`{site_call.path}` output", site_call.path, site_call.id)]
        wcall = self._writer_call(value.id)
        if wcall is not None:
            return [Term(value.id, "module", f"`{wcall.path}` ({type(wcall.module).__name__})", wcall.path,
                         wcall.id)]
        if value.source == "param":
            return [Term(value.id, "param", f"parameter `{value.name}`", self._embedding_owner(value))]
        op = self.graph.producer(value)
        if op is not None and is_zeros(op):
            return []  # a tensor of zeros the forward creates (``torch.zeros_like(x).index_add(...)``): adds nothing
        if op is None:
            kind = value.source
            label = {"input": f"model input `{value.name}`", "buffer": f"buffer `{value.name}`"}.get(
                kind, "a tensor created outside the traced forward")
            return [Term(value.id, kind, label)]
        tensor_args = [a for a in pytree.tree_leaves((op.args, op.kwargs)) if isinstance(a, ValueRef)]
        if op.name in ADD_OPS and len(op.args) >= 2 and isinstance(op.args[0], ValueRef) \
                and isinstance(op.args[1], ValueRef):
            return self.leaves(op.args[0].id) + self.leaves(op.args[1].id)
        scaled = self._layer_scale(op)
        if scaled is not None:
            return self.leaves(scaled)
        parts = row_sum_parts(op)
        if parts is not None and self.mixing(op, parts[1]):  # self ⊕ rows of the source summed into its rows
            return self.leaves(parts[0]) + self.leaves(parts[1])
        if op.name in MIX_OPS:
            mixed = self._mixed_operand(op)
            if mixed is not None:
                return self.leaves(mixed)
        elif self._passthrough_back(op):
            if op.name in JOIN_OPS:
                out = []
                for ref in tensor_args:
                    out += self.leaves(ref.id)
                return out
            return self.leaves(op.args[0].id) if isinstance(op.args[0], ValueRef) else \
                self.leaves(tensor_args[0].id)
        where = self._call_of_op(op)
        return [Term(value.id, "op", f"`{op.name}`" + (f" in `{where}`" if where else ""), where or None)]

    def _embedding_owner(self, value: Value) -> str | None:
        """The Embedding whose table ``value`` is, when the model reads the table directly.

        CLIP-vision and SigLIP call their position Embedding at the configured resolution and
        interpolate its ``weight`` at any other: the same writer either way, so the plan names it the
        same (as the module) and centers the same rows.
        """
        owners = self.param_owners.get(id(value.tensor), [])
        if len(owners) != 1 or owners[0][1] != "weight" or writer_kind(self.modules[owners[0][0]]) != "embedding":
            return None
        return owners[0][0]

    def _layer_scale(self, op: Op) -> int | None:
        """LayerScale (BEiT, Data2Vec-vision, DINOv2): ``λ ⊙ writer(x)`` with a per-feature parameter λ.

        λ folds into the writer's output rows (``W ← diag(λ) W``, ``b ← λ ⊙ b``) and is set to 1, after
        which the writer is centered like any other. Recognised when the product's other factor is
        the output of one Linear/Conv1D call (through identity ops, and through shape ops that keep its
        features on the last axis unmixed: ``nn.MultiheadAttention``'s ``view`` and ``transpose`` after
        its output projection, as in open_clip; each value read once) and λ is used by this product
        alone, as it is or plus a constant (x-transformers' ``gamma + float(unit_offset)``: the
        effective λ is ``param + offset``, and the param is set to ``1 − offset``). Returns the scaled
        value's id (recorded in ``self.layer_scales``).
        """
        if op.index in self.layer_scales:
            return self.layer_scales[op.index][2]
        if op.name not in ("mul", "__mul__", "__rmul__", "mul_", "__imul__") or len(op.args) != 2 \
                or op.kwargs or not all(isinstance(a, ValueRef) for a in op.args):
            return None
        a, b = (self.graph.values[r.id] for r in op.args)
        (param, offset), other = self._scale_param(a), b
        if param is None:
            (param, offset), other = self._scale_param(b), a
        if param is None or other.source == "param" or not other.shape or param.shape[-1:] != other.shape[-1:] \
                or math.prod(param.shape) != param.shape[-1]:
            return None
        if len(self.param_owners.get(id(param.tensor), [])) != 1:
            return None  # λ shared between modules
        v = other
        while True:  # back through dropout, casts and feature-keeping shape ops to the writer call
            if len(v.consumers) != 1:
                return None
            wcall = self._writer_call(v.id)
            if wcall is not None:
                break
            prod = self.graph.producer(v)
            if prod is None or not prod.args or not isinstance(prod.args[0], ValueRef) or len(prod.outputs) != 1:
                return None
            if prod.name not in IDENTITY_OPS and not (
                    prod.name in SHAPE_OPS and self._keeps_features(prod, prod.args[0].id, other.shape[-1])):
                return None
            v = self.graph.values[prod.args[0].id]
        kind = writer_kind(wcall.module)
        if kind not in ("linear", "conv1d") or len(self.calls_per_path.get(wcall.path, [])) != 1:
            return None
        self.layer_scales[op.index] = (param.name, wcall.path, other.id, offset)
        return other.id

    def _scale_param(self, value: Value) -> tuple[Value | None, float]:
        """``(λ, offset)`` when ``value`` is a parameter read only here, or such a parameter plus a constant
        computed for this product alone (``gamma + 1.0``); ``(None, 0.0)`` otherwise."""
        if value.source == "param":
            return (value, 0.0) if len(value.consumers) == 1 else (None, 0.0)
        prod = self.graph.producer(value)
        if prod is None or prod.name not in ("add", "__add__", "__radd__") or len(value.consumers) != 1 \
                or prod.kwargs or len(prod.args) != 2:
            return None, 0.0
        refs = [x for x in prod.args if isinstance(x, ValueRef)]
        consts = [x for x in prod.args if isinstance(x, (int, float)) and not isinstance(x, bool)]
        if len(refs) != 1 or len(consts) != 1:
            return None, 0.0
        param = self.graph.values[refs[0].id]
        if param.source != "param" or len(param.consumers) != 1:
            return None, 0.0
        return param, float(consts[0])

    def _zero_fill(self, op: Op, vid: int) -> bool:
        """``x[index] = 0`` or ``x.masked_fill(mask, 0)`` on ``vid`` (Wav2Vec2 zeroes padded frames).

        The filled elements are a constant 0: whole rows of them are zero-mean, part of a row is not,
        which the index map tells at each norm (the filled elements come from elsewhere: NaN).
        """
        if op.name not in ZERO_FILL_OPS or len(op.args) != 3 or op.kwargs or op.args[0] != ValueRef(vid):
            return False
        refs = [r for r in pytree.tree_leaves(op.args[1:]) if isinstance(r, ValueRef)]
        if any(r.id == vid for r in refs):
            return False
        value = op.args[2]
        if isinstance(value, ValueRef):
            t = self.graph.values[value.id].tensor
            return t.numel() == 1 and not bool(t.any())
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0

    def _passthrough_back(self, op: Op) -> bool:
        if op.args and isinstance(op.args[0], ValueRef) and self._zero_fill(op, op.args[0].id):
            return True
        if op.name in PAD_OPS:  # a nonzero fill is a constant term of the stream, not zero-mean
            return pad_mode(op) != "constant" or pad_value(op) == 0
        if op.name in IDENTITY_OPS or op.name in JOIN_OPS:
            return True
        if op.name in MIX_OPS:  # token mixing with channel-shared weights keeps zero-mean tokens zero-mean
            return self._mixed_operand(op) is not None
        if op.name in SHAPE_OPS:
            return isinstance(op.args[0], ValueRef) if op.args else False
        if op.name in SCALE_OPS:
            return self._scale_ok(op, op.args[0].id if op.args and isinstance(op.args[0], ValueRef) else -1)
        return False

    def _mixed_operand(self, op: Op) -> int | None:
        """The operand a :data:`MIX_OPS` op is proved to mix with channel-shared weights (:meth:`mixing`), or None.

        A matmul of data by data is linear in each operand: ``A @ x`` mixes the rows of ``x`` (its features
        kept, last in and out) and also, read the other way, the columns of ``A``. The stream is the
        operand whose last axis is the output's last axis; with one candidate, that one."""
        refs = [r for r in pytree.tree_leaves((op.args, op.kwargs)) if isinstance(r, ValueRef)
                and self.graph.values[r.id].tensor.is_floating_point()]
        proved = {r.id: self.mixing(op, r.id) for r in refs}
        proved = {v: m for v, m in proved.items() if m}
        if len(proved) > 1:
            out_last = len(self.graph.values[op.outputs[0]].shape) - 1
            proved = {v: m for v, m in proved.items()
                      if any(x.in_axis == len(self.graph.values[v].shape) - 1 and x.out_axis == out_last for x in m)}
        return next(iter(proved)) if len(proved) == 1 else None

    def _scale_ok(self, op: Op, tracked: int) -> bool:
        """A multiply/divide by something constant along the features keeps zero-mean rows zero-mean."""
        if op.name in ("neg", "__neg__"):
            return True
        others = [a for a in op.args if not (isinstance(a, ValueRef) and a.id == tracked)]
        if len(others) != 1 and op.name not in ("neg",):
            return False
        if op.name in ("div", "__truediv__", "div_", "__itruediv__") and not (
                isinstance(op.args[0], ValueRef) and op.args[0].id == tracked):
            return False
        other = others[0]
        if isinstance(other, ValueRef):
            shape = self.graph.values[other.id].shape
            return math.prod(shape) == 1 or (len(shape) > 0 and shape[-1] == 1)
        return isinstance(other, (int, float)) and not isinstance(other, bool)

    def _scale_spans_rows(self, op: Op, tracked: int, m: torch.Tensor, flat: tuple[int, ...] | None,
                          token_ids: _TokenIds | None) -> bool:
        """Is the factor of a scale op one number per whole row of features? :meth:`_scale_ok` checks it is
        constant along the last axis; where the map's features lie along several axes (a message viewed
        ``[edges, heads, head_dim]``), a factor per head (``[edges, heads, 1]``) scales each head's block
        by its own number, and a centered row would not stay centered: the factor must be constant along
        every axis the features vary along."""
        other = next((a for a in op.args if isinstance(a, ValueRef) and a.id != tracked), None)
        if other is None or flat is not None or m.dim() < 2:
            return True
        shape = self.graph.values[other.id].shape
        features = m if token_ids is None else torch.remainder(m, token_ids.width)
        for axis in range(m.dim() - 1):
            k = axis - m.dim() + len(shape)  # the factor's axis aligned from the right
            if k < 0 or shape[k] == 1 or m.shape[axis] < 2:
                continue
            first = features.narrow(axis, 0, 1)
            differs = (features != first) & ~torch.isnan(features) & ~torch.isnan(first)
            if bool(differs.any()):
                return False
        return True

    # ------------------------------------------------------------------ 2. forward index maps
    def reach(self, vid: int, axis: int | None, tokens: bool = False) -> Reach:
        """Propagate an index map from ``vid``: features along ``axis`` (``None``: flat element ids).

        ``tokens`` (with an ``axis``): each element's map value also says which token of ``vid`` (which
        position along the other axes) it came from, as ``token * width + feature`` (``width``: the size
        of ``axis``). Every op moves these maps exactly as it moves feature maps, except a channel-shared
        token mix, whose output tokens (combinations of whole input tokens) each get a fresh token id.
        :meth:`_token_groups` reads them: each norm row must hold one token alone.
        """
        key = (vid, str(axis) + ("/tokens" if tokens else ""))
        if key in self._reach_memo:
            return self._reach_memo[key]
        value = self.graph.values[vid]
        shape = value.shape
        token_ids = None
        if axis is None:
            start = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
        else:
            ax = axis % len(shape)
            view = [1] * len(shape)
            view[ax] = shape[ax]
            start = torch.arange(shape[ax], dtype=torch.float64).reshape(view).expand(shape)
            if tokens:
                positions = [n for i, n in enumerate(shape) if i != ax]
                token = torch.arange(math.prod(positions), dtype=torch.float64).reshape(positions).unsqueeze(ax)
                start = (token * shape[ax] + start).contiguous()  # broadcasting may pick other strides: views fail
                token_ids = _TokenIds(shape[ax], math.prod(positions))
        result = Reach(token_width=token_ids.width if token_ids is not None else 0)
        maps = {vid: start}
        heap: list[int] = []
        queued: set[int] = set()

        def visit(v: int) -> None:
            result.mapped[v] = maps[v]
            result.outputs.extend(self.output_paths.get(v, ()))
            for call in self.input_to_sites.get(v, []):
                result.site_rows[call.id] = maps[v]
            for op_index in self.graph.values[v].consumers:
                if op_index not in queued:
                    queued.add(op_index)
                    heapq.heappush(heap, op_index)

        visit(vid)
        while heap:
            op = self.graph.ops[heapq.heappop(heap)]
            tracked = [i for i in set(op.inputs) if i in maps]
            # ops inside a norm the map already reached are that norm's business
            if any(self._inside(op.index, self.graph.calls[c.id])
                   for t in tracked for c in self.input_to_sites.get(t, [])):
                continue
            outs = self._propagate(op, tracked, maps, shape if axis is None else None, token_ids, result.sums)
            if outs is None:
                feats: set[int] = set()
                for t in tracked:
                    m = maps[t] if token_ids is None else torch.remainder(maps[t], token_ids.width)
                    feats |= set(torch.unique(m[~torch.isnan(m)]).long().tolist())
                where = self._call_of_op(op)
                result.blockers.append((f"`{op.name}`" + (f" in `{where}`" if where else ""), feats))
                continue
            if isinstance(outs, str):
                result.conflict = outs
                continue
            for out_vid, m in outs.items():
                if out_vid in maps:
                    both = ~torch.isnan(maps[out_vid]) & ~torch.isnan(m)
                    if maps[out_vid].shape != m.shape or not torch.equal(maps[out_vid][both], m[both]):
                        result.conflict = f"`{op.name}` mixes a writer's output with itself"
                        continue
                    m = torch.where(torch.isnan(m), maps[out_vid], m)
                maps[out_vid] = m
                visit(out_vid)
        self._reach_memo[key] = result
        return result

    def _propagate(self, op: Op, tracked: list[int], maps: dict[int, torch.Tensor],
                   flat: tuple[int, ...] | None = None, token_ids: _TokenIds | None = None,
                   sums: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        """Index maps for ``op``'s outputs, ``None`` if the op is not a pass-through.

        ``flat``: the maps hold flat element ids of a value of this shape (else feature ids).
        ``token_ids``: the maps hold token and feature ids (:meth:`reach` with ``tokens``).
        ``sums``: where flat element ids are summed with each other, the pairs are recorded here.
        """
        out_shape = self.graph.values[op.outputs[0]].shape if op.outputs else ()
        if op.name in ADD_OPS:
            refs = [a for a in op.args[:2]]
            if not all(isinstance(a, ValueRef) for a in refs):
                return None
            ms = [maps[a.id].broadcast_to(out_shape) for a in refs if a.id in maps]
            m = self._sum_maps(ms, flat, token_ids, sums)
            return m if isinstance(m, str) else {op.outputs[0]: m}
        parts = row_sum_parts(op)
        if parts is not None:  # ``self`` keeps its place; the source's rows are a channel-shared mix (_mix)
            ms = [maps[parts[0]]] if parts[0] in tracked else []
            if parts[1] in tracked:
                mixed = self._mix(op, parts[1], maps[parts[1]], flat, token_ids)
                if mixed is None:
                    return None
                ms.append(mixed[op.outputs[0]])
            if not ms or len(op.outputs) != 1 or any(m.shape != out_shape for m in ms):
                return None
            m = self._sum_maps(ms, flat, token_ids, sums)
            return m if isinstance(m, str) else {op.outputs[0]: m}
        if op.name in IDENTITY_OPS:
            if not (op.args and isinstance(op.args[0], ValueRef) and op.args[0].id in tracked):
                return None
            return {op.outputs[0]: maps[op.args[0].id]}
        if op.index in self.layer_scales and len(tracked) == 1 and tracked[0] == self.layer_scales[op.index][2]:
            return {op.outputs[0]: maps[tracked[0]].broadcast_to(out_shape)}  # λ is folded and set to 1
        if op.name in SCALE_OPS:
            t = tracked[0]
            if len(tracked) != 1 or not self._scale_ok(op, t) \
                    or not self._scale_spans_rows(op, t, maps[t], flat, token_ids):
                return None
            return {op.outputs[0]: maps[t].broadcast_to(out_shape)}
        if op.name in SHAPE_OPS or op.name in JOIN_OPS or op.name in PAD_OPS:
            return replay(self.graph, op, maps, tracked)
        if op.name in MIX_OPS and len(tracked) == 1:
            return self._mix(op, tracked[0], maps[tracked[0]], flat, token_ids)
        if len(tracked) == 1 and self._zero_fill(op, tracked[0]):
            index = pytree.tree_map(lambda r: self.graph.values[r.id].tensor if isinstance(r, ValueRef) else r,
                                    op.args[1])
            m = maps[tracked[0]].clone()
            try:
                if op.name == "__setitem__":
                    m[index] = math.nan
                else:
                    m = m.masked_fill(index, math.nan)
            except Exception:  # noqa: BLE001 - an index the map cannot take: not a pass-through
                return None
            return {op.outputs[0]: m}
        return None

    @staticmethod
    def _sum_maps(ms: list[torch.Tensor], flat: tuple[int, ...] | None, token_ids: _TokenIds | None,
                  sums: list[tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor | str:
        """The index map of a sum of two tracked terms (an add, a row sum's ``self`` and source).

        Where only one holds an element, it is that one's. Where both do, the element is a sum of two
        elements of the tracked value, which keeps centering when both are the same feature (each summed
        row is then zero-mean, and a norm row of such sums was shifted by one amount): feature maps must
        agree there; token maps must agree on the feature, and each distinct pair of summed tokens is a
        token of its own (one combination of whole tokens, like a channel-shared mix's output); flat
        element ids of a parameter keep the first's ids, and the pairs go to ``sums``, checked once the
        axis the norm rows lie along is known (:meth:`param_centering`)."""
        if len(ms) == 1:
            return ms[0]
        a, b = ms
        both = ~torch.isnan(a) & ~torch.isnan(b)
        m = torch.where(torch.isnan(a), b, a)
        if not bool(both.any()):
            return m
        if flat is not None:
            if sums is not None:
                sums.append((a[both], b[both]))
            return m
        if token_ids is None:
            return m if torch.equal(a[both], b[both]) else "sums different features of a writer's output"
        width = token_ids.width
        fa, fb = torch.remainder(a[both], width), torch.remainder(b[both], width)
        if not torch.equal(fa, fb):
            return "sums different features of a writer's output"
        ta = torch.div(a[both], width, rounding_mode="floor")
        tb = torch.div(b[both], width, rounding_mode="floor")
        pairs, inverse = torch.unique(torch.stack([ta, tb], 1), dim=0, return_inverse=True)
        base = token_ids.fresh(len(pairs))
        m = m.clone()
        m[both] = (inverse.double() + base) * width + fa
        return m

    def _mix(self, op: Op, vid: int, m: torch.Tensor, flat: tuple[int, ...] | None,
             token_ids: _TokenIds | None = None) -> dict[int, torch.Tensor] | None:
        """Index map through an op that mixes positions with channel-shared weights (:meth:`mixing`).

        Each output token is ``Σ_p W[p', p] x[p]`` over input tokens ``x[p]`` (vectors along the channel
        axis). If every input token the map covers is *the same group of features* channel by channel,
        then each output token is a combination of copies of that group: zero-mean whenever the group
        is centered. So the output map is that group (one representative token), broadcast to every
        output position some covered token reaches. "The same group" means: identical feature ids
        (feature maps), or, for flat element ids of a parameter (``flat``: its shape), rows of the
        parameter along one common axis with identical coordinates along it, channel by channel (so
        centering that axis centers every one of them). Anything else (a per-head mix of different
        features, tokens permuted differently) is not a pass-through. With ``token_ids`` the group is
        judged on the feature ids alone, and every output token gets a token id of its own: it is one
        combination of whole tokens, zero-mean as a whole, however many input tokens it sums.
        """
        mixes = self.mixing(op, vid)
        if mixes and bool(torch.isnan(m).all()):  # none of the term reaches this op (a slice left it out)
            return {op.outputs[0]: torch.full(self.graph.values[op.outputs[0]].shape, math.nan, dtype=torch.float64)}
        features = m if token_ids is None else torch.remainder(m, token_ids.width)  # NaN stays NaN
        for mix in mixes:  # the channel axis is the one the map's tokens agree on
            rep = self._mixed_group(features, mix.in_axis, flat)
            if rep is None:
                continue
            # where some covered input element contributes: a random combination is nonzero there (a.s.)
            gen = torch.Generator().manual_seed(op.index)
            probe = torch.randn(m.shape, generator=gen, dtype=torch.float64) * (~torch.isnan(m)).double()
            reached = self._replay_data(op, vid, probe)
            if reached is None:
                return None
            view = [rep.numel() if i == mix.out_axis else 1 for i in range(reached.dim())]
            out = rep.reshape(view).expand(reached.shape)
            if token_ids is not None:
                positions = [n for i, n in enumerate(reached.shape) if i != mix.out_axis]
                token = torch.arange(math.prod(positions), dtype=torch.float64).reshape(positions)
                out = ((token.unsqueeze(mix.out_axis) + token_ids.fresh(token.numel())) * token_ids.width
                       + out).contiguous()
            return {op.outputs[0]: torch.where(reached != 0, out, torch.full((), math.nan, dtype=torch.float64))}
        return self._mix_joint(op, vid, m, features, mixes, flat, token_ids)

    def _mix_joint(self, op: Op, vid: int, m: torch.Tensor, features: torch.Tensor, mixes: tuple,
                   flat: tuple[int, ...] | None, token_ids: _TokenIds | None) -> dict[int, torch.Tensor] | None:
        """:meth:`_mix` where a token's features lie along several trailing axes at once (a message of
        ``heads × head_dim`` scattered into nodes: torch_geometric's ``TransformerConv``). The op was proved
        channel-shared along each of those axes alone (kept apart and one map, per axis); the diagonal
        scalings and cyclic shifts along each axis then generate every diagonal and a transitive group of
        shifts on their product, so the op applies one map to every channel of the joint axis: the
        trailing block is one channel axis, judged as :meth:`_mix` judges one."""
        n_in, out_shape = m.dim(), self.graph.values[op.outputs[0]].shape
        pairs = {(x.in_axis, x.out_axis) for x in mixes}
        ins = sorted(a for a, _ in pairs)
        k = len(ins)
        if k < 2 or ins != list(range(n_in - k, n_in)) or len(out_shape) < k:
            return None
        n_out = len(out_shape)
        if any((a, n_out - n_in + a) not in pairs for a in ins) \
                or tuple(m.shape[-k:]) != tuple(out_shape[-k:]):
            return None
        block = tuple(m.shape[-k:])
        rep = self._mixed_group(features.flatten(n_in - k), n_in - k, flat)
        if rep is None:
            return None
        gen = torch.Generator().manual_seed(op.index)
        probe = torch.randn(m.shape, generator=gen, dtype=torch.float64) * (~torch.isnan(m)).double()
        reached = self._replay_data(op, vid, probe)
        if reached is None or tuple(reached.shape) != tuple(out_shape):
            return None
        out = rep.reshape(block).expand(reached.shape)
        if token_ids is not None:
            positions = list(reached.shape[:-k])
            token = torch.arange(math.prod(positions), dtype=torch.float64).reshape(positions + [1] * k)
            out = ((token + token_ids.fresh(math.prod(positions))) * token_ids.width + out).contiguous()
        return {op.outputs[0]: torch.where(reached != 0, out, torch.full((), math.nan, dtype=torch.float64))}

    @staticmethod
    def _mixed_group(m: torch.Tensor, axis: int, flat: tuple[int, ...] | None) -> torch.Tensor | None:
        """The one group of features every covered token of ``m`` holds along ``axis`` (see :meth:`_mix`)."""
        d = m.shape[axis]
        rows = m.movedim(axis, -1).reshape(-1, d)
        labelled = ~torch.isnan(rows)
        covered = labelled.any(1)
        if not bool(covered.any()):
            return None
        rows, labelled = rows[covered], labelled[covered]
        pattern = labelled[0]
        if not bool((labelled == pattern).all()):
            return None  # tokens cover different channels
        rep = rows[0]
        ids = rows[:, pattern]
        if flat is None:
            return rep if bool((ids == rep[pattern]).all()) else None
        coords = torch.stack(torch.unravel_index(ids.long(), flat), dim=0)  # (axes, tokens, channels)
        varies = (coords != coords[:, :, :1]).any(dim=2)  # (axes, tokens)
        axes = varies.any(dim=1).nonzero().flatten().tolist()
        if len(axes) != 1 or not bool(varies[axes[0]].all()) \
                or not bool((coords[axes[0]] == coords[axes[0], :1]).all()):
            return None
        return rep

    def _replay_data(self, op: Op, vid: int, x: torch.Tensor) -> torch.Tensor | None:
        """``op`` run again with ``x`` in place of value ``vid`` and every other argument as traced (a row
        sum's ``self`` as zeros: :func:`normswap.analysis.dataflow.run_on`)."""
        y = run_on(self.graph, op, vid, x)
        return y if isinstance(y, torch.Tensor) else None

    # ------------------------------------------------------------------ rows -> centering blocks
    def _groups(self, reach: Reach, tokens: Callable[[], Reach] | None = None
                ) -> tuple[set[tuple[int, ...]], str | None]:
        """The groups of features that must each be centered (one per distinct norm row), or why none.

        ``tokens``: the same reach with token ids (:meth:`reach` with ``tokens=True``), for a writer's
        output or a value a centering op would center: the rows are read there, and each must hold one
        token alone (:meth:`_token_groups`). Without it (a raw parameter's flat element ids, which say
        where each element sits), a row must not repeat an element.
        """
        groups: set[tuple[int, ...]] = set()
        if tokens is not None:
            by_token = tokens() if reach.site_rows else reach
            for call_id in reach.site_rows:
                path = self.graph.calls[call_id].path
                found, why = self._row_groups(call_id, math.prod(self.sites[path].normalized_shape), by_token,
                                              path)
                if why:
                    return groups, why
                groups |= found
            return groups, None
        for call_id, m in reach.site_rows.items():
            site = self.sites[self.graph.calls[call_id].path]
            found, why = self._remembered(("flat", math.prod(site.normalized_shape)), m)
            if why:
                return groups, why.format(path=site.path)
            groups |= found
        return groups, None

    def _remembered(self, what: tuple, m: torch.Tensor) -> tuple[set[tuple[int, ...]], str]:
        """:meth:`_flat_groups` (``what``: ``("flat", width)``) or :meth:`_rows_token_groups` (``("tokens",
        width, token_width)``) of the row map ``m``, remembered (see :meth:`_row_groups` for why and for the key);
        a refusal names the norm as ``{path}``. The caller gets a set of its own."""
        key = (m.data_ptr(), m.dtype, tuple(m.shape), m.stride(), m._version, *what)
        hit = self._groups_memo.get(key)
        if hit is None:
            hit = (m, *(self._flat_groups(m, what[1]) if what[0] == "flat" else self._rows_token_groups(m, *what[1:])))
            self._groups_memo[key] = hit
        return set(hit[1]), hit[2]

    @staticmethod
    def _flat_groups(m: torch.Tensor, width: int) -> tuple[set[tuple[int, ...]], str]:
        """The groups of a norm's rows of a raw parameter's flat element ids (:meth:`_groups`), or why none (a
        refusal names the norm as ``{path}``): a row must not repeat an element."""
        groups: set[tuple[int, ...]] = set()
        rows = m.reshape(-1, width)
        first = rows[0]
        if not bool(torch.isnan(first).any()) and bool((rows == first).all()):
            row = first.long().tolist()  # the usual residual stream: every row the same features
            if len(set(row)) != len(row):
                return set(), "repeats features within a row of `{path}`"
            return {tuple(sorted(row))}, ""
        nan = torch.isnan(rows)
        full, empty = ~nan.any(1), nan.all(1)
        if not bool((full | empty).all()):
            return set(), "fills only part of a row of `{path}`"
        rows = rows[full]
        if rows.numel() == 0:
            return set(), ""
        rows = torch.unique(torch.sort(rows, dim=1).values, dim=0).long()
        for row in rows.tolist():
            if len(set(row)) != len(row):
                return set(), "repeats features within a row of `{path}`"
            groups.add(tuple(row))
        return groups, ""

    def _row_groups(self, call_id: int, width: int, tokens: Reach, path: str) -> tuple[set[tuple[int, ...]], str]:
        """:meth:`_token_groups`, remembered per row map.

        Placing centering ops (``writer_centering='op'``/``'auto'``, stem ops) asks :meth:`hook_problem` of
        hundreds of candidate values, and each reaches every later norm of its stream; the residual stream's
        map reaches those norms as one tensor (adds and identity ops pass it on unchanged), so the same rows
        would be read again for each norm and each candidate (DINOv2-small: 5,250 reads of 50 tensors, most
        of ``convert --writer-centering auto``'s time). The answer depends on the rows' values, the row width
        and the token width only (the path is only named in a refusal). The key is where the values live:
        the map's memory address, dtype, shape and strides (a broadcast view of the same map, which each
        add makes, is the same rows), and its ``_version``, which any in-place write through any view bumps.
        The entry keeps the tensor, so its memory is not freed and given to another tensor while the entry
        lives: an address in the key is the same memory, holding the same values unless the version moved.
        """
        m = None if tokens.conflict else tokens.site_rows.get(call_id)
        if m is None:
            return self._token_groups(call_id, width, tokens, path)
        found, why = self._remembered(("tokens", width, tokens.token_width), m)
        return found, why.format(path=path)

    @staticmethod
    def _token_groups(call_id: int, width: int, tokens: Reach, path: str = ""
                      ) -> tuple[set[tuple[int, ...]], str]:
        """The feature groups of norm ``call_id``'s rows, and why centering per token would change it ('').

        Centering a writer subtracts, from each of its tokens (each position of its output), the mean
        over each group of features: a shift that differs from token to token. LayerNorm is invariant
        to one shift per row, not one per part of a row. So each norm row must hold one token alone,
        every feature of its group the same number of times (the shift is then one number for the whole
        row, and the centered row is zero-mean). A row made of several whole tokens, each zero-mean
        after centering, is zero-mean too, but it was shifted by a different amount per token, and its
        LayerNorm output changed: Swin's patch merging (4 tokens in a row of 4C, by ``torch.cat`` of
        strided slices or a space-to-depth reshape) is such a norm. A row holding each feature once but
        taken from several tokens (a channel shift between tokens) is another. Read on the index map
        ``token * width + feature`` of ``tokens``; a channel-shared token mix makes each of its output
        tokens a token of its own (one shift for the whole token: a combination of per-token shifts).
        """
        m = None if tokens.conflict else tokens.site_rows.get(call_id)
        if m is None:
            return set(), f"is not tracked token by token into the rows of `{path}`"
        groups, why = Analyzer._rows_token_groups(m, width, tokens.token_width)
        return groups, why.format(path=path)

    @staticmethod
    def _rows_token_groups(m: torch.Tensor, width: int, token_width: int) -> tuple[set[tuple[int, ...]], str]:
        """:meth:`_token_groups` on the row map ``m`` itself; a refusal names the norm as ``{path}``."""
        rows = m.reshape(-1, width)
        nan = torch.isnan(rows)
        full = ~nan.any(1)
        if not bool((full | nan.all(1)).all()):
            return set(), "fills only part of a row of `{path}`"
        rows = rows[full]
        if rows.numel() == 0:
            return set(), ""
        token = torch.div(rows, token_width, rounding_mode="floor")
        if not bool((token == token[:, :1]).all()):
            return set(), ("puts several tokens in one row of `{path}` (centering shifts each token by its own "
                           "amount; LayerNorm is invariant to one shift per row)")
        features = rows - token * token_width
        if bool((features == features[0]).all()):  # the usual residual stream: every row the same features
            patterns = features[:1].long()
        else:
            patterns = torch.unique(torch.sort(features, dim=1).values, dim=0).long()
        patterns = torch.sort(patterns, dim=1).values
        if not bool((patterns[:, 1:] == patterns[:, :-1]).any()):
            return {tuple(row) for row in patterns.tolist()}, ""
        groups: set[tuple[int, ...]] = set()
        for row in patterns.tolist():  # one token twice over (x and x concatenated) is fine
            counts = {f: row.count(f) for f in set(row)}
            if len(set(counts.values())) != 1:
                return set(), "repeats some features of a token more often than others in a row of `{path}`"
            groups.add(tuple(sorted(counts)))
        return groups, ""

    @staticmethod
    def _blocks_along(groups: set[tuple[int, ...]], size: int) -> tuple[list[tuple[int, int]] | None, str | None]:
        blocks = set()
        for g in groups:
            lo, hi = g[0], g[-1] + 1
            if hi - lo != len(g):
                return None, "centers a non-contiguous set of features"
            blocks.add((lo, hi))
        ordered = sorted(blocks)
        for (_, a1), (b0, _) in zip(ordered, ordered[1:], strict=False):
            if b0 < a1:
                return None, "is read by norms over overlapping feature blocks"
        if ordered == [(0, size)]:
            return None, None
        return ordered, None

    def module_centering(self, path: str) -> tuple[list[WriterEdit], list[Untie], str | None]:
        """Weight edits that make every output of writer module ``path`` zero-mean per norm row."""
        module = self.modules[path]
        kind = writer_kind(module)
        if kind == "contraction":
            return self._contraction_centering(path)
        calls = self.calls_per_path.get(path, [])
        all_groups: set[tuple[int, ...]] = set()
        blockers: list[tuple[str, set[int]]] = []  # (what reads the output, which features it reads)
        for call in calls:
            if len(call.outputs) != 1:
                return [], [], "returns more than one tensor"
            reach = self.reach(call.outputs[0], OUTPUT_AXIS[kind])
            if reach.conflict:
                return [], [], reach.conflict
            blockers += reach.blockers
            bad_outputs = [o for o in reach.outputs if "hidden_state" not in o]
            if bad_outputs:
                return [], [], f"output is also returned as `{bad_outputs[0]}`"
            groups, why = self._groups(reach, lambda c=call: self.reach(c.outputs[0], OUTPUT_AXIS[kind], tokens=True))
            if why:
                return [], [], why
            all_groups |= groups
        if not all_groups:  # name where its rows stop (a per-head factor, a reader), so the user can find it
            return [], [], "reaches no norm" + (f" (its rows stop at {blockers[0][0]}, which does not carry a "
                                                "centered row on unchanged)" if blockers else "")
        size = module.weight.shape[_WRITER_PARAMS[kind][0][1]]
        blocks, why = self._blocks_along(all_groups, size)
        if why:
            return [], [], why
        covered = set(range(size)) if blocks is None else {i for lo, hi in blocks for i in range(lo, hi)}
        what = next((w for w, feats in blockers if feats & covered), None)
        if what is not None:
            return [], [], f"output also read by {what} (not a norm)"
        if isinstance(module, LinearView):
            return self._view_centering(path, module, blocks)
        edits, unties = [], []
        for attr, axis in _WRITER_PARAMS[kind]:
            p = module._parameters.get(attr)
            if p is None:
                continue
            why = self.sharing_problem(p, path)
            if why is not None:
                if why == "tied" and self.untie:
                    for owner, oattr in self.param_owners[id(p)]:
                        if self.modules.get(owner) is not module and owner not in self.stream_writers \
                                and owner in self.calls_per_path:  # an owner never called shares the edit
                            unties.append(Untie(owner, oattr, self.param_name[id(p)], p.numel()))
                else:
                    kept = "weight is tied to another module (the tie is kept; untie=True centers it by weights)"
                    return [], [], (kept if why == "tied" else why)
            edits.append(WriterEdit(f"{path}.{attr}", axis, blocks, path, kind))
        return edits, unties, None

    def _contraction_centering(self, path: str) -> tuple[list[WriterEdit], list[Untie], str | None]:
        """Writer edits for a :class:`~normswap.analysis.linears.ParamContraction` (every call of it).

        Per call: which axis of the weight operand becomes which output axis is proved on the op
        (:func:`~normswap.analysis.dataflow.weight_axes`); the output axis whose index map lands in whole norm
        rows (one token each, nothing else reading them) is the writer's feature axis, exactly as for a
        Linear; the weight operand's axis is then followed back through the layout ops to one axis of the
        stored parameter (:meth:`_stored_axis`), and the bias, broadcast onto the output, likewise. Every call
        must ask for the same edits (a fused MoE's experts: one parameter, one axis)."""
        found: dict[str, tuple[int, list[tuple[int, int]] | None]] = {}
        any_norm = False
        for call in self.calls_per_path.get(path, []):
            pc: ParamContraction = call.module
            op, out = self.graph.ops[pc.op_index], call.outputs[0]
            out_shape = self.graph.values[out].shape
            why, chosen = "keeps no axis of its weight apart in its output", None
            for pair in sorted(weight_axes(self.graph, op, pc.weight_operand, pc.bias_operand),
                               key=lambda x: -x.out_axis):  # features last, usually
                reach = self.reach(out, pair.out_axis)
                problem = reach.conflict or ("" if reach.site_rows else "reaches no norm")
                if not problem and [o for o in reach.outputs if "hidden_state" not in o]:
                    problem = f"output is also returned as `{reach.outputs[0]}`"
                groups: set[tuple[int, ...]] = set()
                if not problem:
                    groups, problem = self._groups(
                        reach, lambda o=out, a=pair.out_axis: self.reach(o, a, tokens=True))
                blocks = None
                if not problem:
                    blocks, problem = self._blocks_along(groups, out_shape[pair.out_axis])
                if not problem:
                    covered = set(range(out_shape[pair.out_axis])) if blocks is None else \
                        {i for lo, hi in blocks for i in range(lo, hi)}
                    what = next((w for w, feats in reach.blockers if feats & covered), None)
                    problem = f"output also read by {what} (not a norm)" if what else ""
                if problem:
                    why = problem if why.startswith("keeps no axis") or why == "reaches no norm" else why
                    continue
                chosen = (pair, blocks)
                break
            if chosen is None:
                if why == "reaches no norm":
                    continue
                return [], [], why
            any_norm = True
            pair, blocks = chosen
            parts = [(pc.weight, pc.weight_value, pc.weight_operand, pair.in_axis)]
            if pc.bias is not None and pc.bias_value is not None and pc.bias_operand is not None:
                parts.append((pc.bias, pc.bias_value, pc.bias_operand, None))
            for name, source, operand, axis in parts:
                coords = layout_coords(self.graph, source, operand)
                if coords is None:
                    return [], [], f"`{name}` is not followed to the op"
                if axis is None:  # the bias: as broadcast onto the output
                    try:
                        coords = [c.broadcast_to(out_shape) for c in coords]
                    except RuntimeError:
                        return [], [], f"bias `{name}` does not broadcast onto the output"
                    axis = pair.out_axis
                stored = self._stored_axis(coords, axis, blocks, self.graph.values[source].shape)
                if isinstance(stored, str):
                    return [], [], f"`{name}`: {stored}"
                if found.setdefault(name, stored) != stored:
                    return [], [], f"calls center `{name}` differently"
                sharing = self._contraction_sharing(source, path)
                if sharing:
                    return [], [], sharing
        if not any_norm:
            return [], [], "reaches no norm"
        return [WriterEdit(name, axis, blocks, path, "contraction") for name, (axis, blocks) in found.items()], [], None

    @staticmethod
    def _stored_axis(coords: list[torch.Tensor], axis: int, blocks: list[tuple[int, int]] | None,
                     shape: tuple[int, ...]) -> tuple[int, list[tuple[int, int]] | None] | str:
        """``(axis, blocks)`` of a stored parameter of ``shape`` that centering an operand along ``axis``
        (per ``blocks``) amounts to, read from ``coords`` (per parameter axis, each operand element's
        coordinate: :func:`~normswap.analysis.trace.layout_coords`); or why there is none. Along the operand's
        axis the elements must step along one axis of the parameter, in the same order at every other
        position; each block must land on a contiguous block there."""
        n = coords[0].shape[axis]
        varying = []
        for d, c in enumerate(coords):
            rows = c.movedim(axis, -1).reshape(-1, n)
            if bool((rows != rows[:, :1]).any()):
                varying.append((d, rows))
        if len(varying) != 1:
            return "the output features do not lie along one axis of the stored parameter"
        axes, order = [varying[0][0]], varying[0][1]
        if not bool((order == order[:1]).all()):
            return "the output features lie along the parameter in different orders"
        order_list = order[0].long().tolist()
        stored = []
        for lo, hi in blocks or [(0, n)]:
            idx = sorted(order_list[lo:hi])
            if idx != list(range(idx[0], idx[-1] + 1)):
                return "a block of output features is not a block of the stored parameter"
            stored.append((idx[0], idx[-1] + 1))
        return axes[0], (None if stored == [(0, shape[axes[0]])] else sorted(stored))

    def _contraction_sharing(self, source: int, path: str) -> str:
        """Why centering the parameter read as value ``source`` would change something other than the
        calls of contraction ``path`` ('' when nothing else reads it: every use is a layout op on the way to
        one of those calls, or computes nothing that is used)."""
        calls = {c.start_op for c in self.calls_per_path.get(path, [])}
        value = self.graph.values[source]
        stack = [v.id for v in self.param_values.get(id(value.tensor), [value])]
        seen: set[int] = set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            for i in self.graph.values[v].consumers:
                op = self.graph.ops[i]
                if i in calls:
                    continue
                if op.name in LAYOUT_OPS and op.args and op.args[0] == ValueRef(v):
                    stack.extend(op.outputs)
                    continue
                if not self._dead(op):
                    where = self._call_of_op(op)
                    return f"`{value.name}` is also read by `{op.name}`" + (f" in `{where}`" if where else "")
        return ""

    def _view_centering(self, path: str, view: LinearView, blocks: list[tuple[int, int]] | None
                        ) -> tuple[list[WriterEdit], list[Untie], str | None]:
        """Writer edits for a functional linear: its weight's and bias's output rows, only the rows it uses
        (``blocks`` are relative to them). Its parameters cannot be untied (the model's code reads them)."""
        edits = []
        for p, name, rows, axis in ((view.weight_param, view.spec.weight, view.spec.rows, view.out_axis),
                                    (view.bias_param, view.spec.bias, view.spec.bias_rows, 0)):
            if p is None:
                continue
            why = self.sharing_problem(p, path)
            if why is not None:
                return [], [], "weight is also used elsewhere (read directly by the model's code: no untie)" \
                    if why == "tied" else why
            lo = rows[0] if rows else 0
            if blocks is not None:
                where = [(a + lo, b + lo) for a, b in blocks]
            else:
                where = None if rows is None else [rows]
            edits.append(WriterEdit(name, axis, where, path, view.kind))
        return edits, [], None

    def weight_param(self, path: str) -> torch.nn.Parameter:
        """The whole weight parameter of a Linear-like reader or writer (a module, or a functional linear)."""
        module = self.modules[path]
        return module.weight_param if isinstance(module, LinearView) else module.weight

    def weight_sharers(self, path: str) -> list[str]:
        """The other modules that own reader ``path``'s weight (a head tied to the input embedding, a
        weight shared across layers): an edit of that weight would change them too. A
        :class:`LinearView`'s weight belongs to the module whose code applies it, not to another."""
        module = self.modules[path]
        owner = self.modules.get(module.spec.owner) if isinstance(module, LinearView) else module
        return sorted({o for o, _ in self.param_owners.get(id(self.weight_param(path)), [])
                       if self.modules.get(o) is not owner})

    def sharing_problem(self, p: torch.nn.Parameter, path: str) -> str | None:
        """'tied' if another (non-writer) module owns ``p``; a reason if raw ops use it elsewhere."""
        owners = self.param_owners.get(id(p), [])
        module = self.modules[path]
        if isinstance(module, LinearView):  # its parameters belong to the module whose code applies them
            module = self.modules.get(module.spec.owner, module)
        others = [o for o, _ in owners if self.modules.get(o) is not module]
        if any(o not in self.stream_writers and o in self.calls_per_path for o in others):
            return "tied"
        # raw uses of the parameter outside any owner's call
        pvals = self.param_values.get(id(p), [])
        owner_paths = {o for o, _ in owners}
        for v in pvals:
            for op_index in v.consumers:
                op = self.graph.ops[op_index]
                stack = {c.path for c in self.graph.ancestors_calls(op.call)}
                if not stack & owner_paths and not self._dead(op):
                    where = self._call_of_op(op)
                    return (f"weight also read directly by the model's code (`{op.name}` in "
                            + (f"`{where}`)" if where else "its forward)"))
        return None

    def _dead(self, op: Op, depth: int = 0) -> bool:
        """Is nothing computed from ``op``'s outputs? (CLIP reads ``position_embedding.weight.unsqueeze(0)``
        for its shape alone, then calls the Embedding: that use sees no edit.)"""
        if depth > 8 or any(v in self.output_values for v in op.outputs):
            return False
        return all(self._dead(self.graph.ops[i], depth + 1) for v in op.outputs for i in self.graph.values[v].consumers)

    def param_centering(self, term: Term) -> tuple[list[WriterEdit], str | None]:
        value = self.graph.values[term.value]
        reach = self.reach(term.value, None)
        if reach.conflict:
            return [], reach.conflict
        if reach.blockers:
            return [], f"also read by {reach.blockers[0][0]} (not a norm)"
        bad_outputs = [o for o in reach.outputs if "hidden_state" not in o]
        if bad_outputs:
            return [], f"also returned as `{bad_outputs[0]}`"
        groups, why = self._groups(reach)
        if why:
            return [], why
        shape = value.shape
        axes = set()
        coords_per_group = []
        for g in groups:
            coords = torch.stack(torch.unravel_index(torch.tensor(g), shape), dim=1)
            varying = [d for d in range(len(shape)) if len(torch.unique(coords[:, d])) > 1]
            if len(varying) != 1:
                return [], "norm rows do not lie along one axis of the parameter"
            axes.add(varying[0])
            coords_per_group.append(tuple(sorted(set(coords[:, varying[0]].tolist()))))
        if len(axes) != 1:
            return [], "norm rows lie along different axes of the parameter"
        axis = axes.pop()
        blocks, why = self._blocks_along(set(coords_per_group), shape[axis])
        if why:
            return [], why
        for first, second in reach.sums:  # elements summed with each other: the same feature, or no edit
            if not torch.equal(torch.unravel_index(first.long(), shape)[axis],
                               torch.unravel_index(second.long(), shape)[axis]):
                return [], "is summed with itself at other features"
        if term.module_path is not None and axis == 1:  # an Embedding's table, its rows centered: its own edit
            return [WriterEdit(value.name, axis, blocks, term.module_path, "embedding")], None
        return [WriterEdit(value.name, axis, blocks, "", "param")], None

    # ------------------------------------------------------------------ 3. centering ops
    def depends_on_norm(self, vid: int) -> bool:
        """Is this value computed from some LayerNorm's output? (Then a centering op here is per norm.)

        A norm-output term is judged by the norm's own input: BLOOM's embedding LayerNorm starts the
        stream (its input depends on no norm), a Post-LN norm's output does not.
        """
        call = self._site_output_call(vid)
        if call is not None:
            vid = self.site_input.get(call.id)
            if vid is None:
                return False
        memo = self._norm_dep_memo
        # post-order: a value's answer is its producer's inputs' answers, each memoised once known. Only a value
        # whose answer is known is memoised (a value merely visited on the way to some norm is not computed from
        # it: marking every visited value True leaked a later question's answer from an earlier one's search)
        stack: list[tuple[int, bool]] = [(vid, False)]
        open_: set[int] = set()  # values whose inputs are being answered (cycle guard)
        while stack:
            v, inputs_done = stack.pop()
            op = self.graph.producer(self.graph.values[v])
            if inputs_done:
                open_.discard(v)
                memo[v] = any(memo.get(i, False) for i in op.inputs)
                continue
            if v in memo or v in open_:
                continue
            if self._site_output_call(v) is not None:
                memo[v] = True
                continue
            if op is None:
                memo[v] = False
                continue
            open_.add(v)
            stack.append((v, True))
            stack.extend((i, False) for i in op.inputs if i not in memo)
        return memo[vid]

    def hook_candidates(self, term: Term, at_norms: bool = False) -> list[tuple[int, CenterHook]]:
        """Module boundaries downstream of ``term`` where one centering op could sit.

        ``at_norms``: a norm's own input counts too (per-norm centering, opt-in).
        """
        reach = self.reach(term.value, -1)
        cands = []
        for vid in sorted(reach.mapped, key=lambda v: (self.graph.values[v].producer or -1)):
            # a norm's own output before the module around it: its op then re-rounds once in half precision
            for call in sorted(self.by_output.get(vid, []), key=lambda c: c.id not in self.site_call_ids):
                if len(self.calls_per_path[call.path]) == 1 and call.outputs == [vid] and not call.functional:
                    cands.append((vid, CenterHook(call.path, "output", None)))
            for call, slot in self.by_input.get(vid, []):
                own = call.id in self.site_call_ids  # a norm's own input: own_input_reach judges it, shared or not
                if (own and not at_norms) or (len(self.calls_per_path[call.path]) != 1 and not own) \
                        or call.functional:
                    continue
                consumers = self.graph.values[vid].consumers
                # a norm's own input takes an op whoever else reads the value: the op changes only what
                # that norm reads (the planner judges it by own_input_reach, not by the value's reach)
                if call.id in self.site_call_ids or all(self._inside(i, call) for i in consumers):
                    cands.append((vid, CenterHook(call.path, "input", slot)))
            residual = self._residual_sum(vid)
            if residual is not None:
                cands.append((vid, residual))
        return cands

    def _residual_sum(self, vid: int) -> CenterHook | None:
        """A centering op on ``vid`` when it is no module boundary but a residual sum ``a + M(a)`` inside some
        forward: module ``M`` (called once) reads ``a`` and returns the other addend, which nothing else reads.
        The op is installed on ``M`` (its first output minus the mean of input ``a`` plus that output), so
        ``M`` itself still reads ``a`` as it was. ModernBERT's first layer (``attn_norm = Identity``, the
        attention reads the raw stream) centers its stream there, after the attention and before
        ``mlp_norm``: every norm after it is then exact within the one-op-per-stream policy, where an op at
        the layer's output would leave ``mlp_norm`` out."""
        op = self.graph.producer(self.graph.values[vid])
        if op is None or op.name not in _PLAIN_ADDS or op.kwargs or len(op.args) != 2 \
                or not all(isinstance(a, ValueRef) for a in op.args):
            return None
        for a, b in ((op.args[0].id, op.args[1].id), (op.args[1].id, op.args[0].id)):
            if self.graph.values[a].shape != self.graph.values[b].shape or self.graph.values[b].consumers != [op.index]:
                continue
            for call in self._identity_producers(b):
                if call.functional or len(self.calls_per_path[call.path]) != 1:
                    continue
                slot = next((i for i, v in enumerate(call.args) if v == a), None)
                if slot is None:
                    slot = next((k for k, v in call.kwargs.items() if v == a), None)
                if slot is not None:
                    return CenterHook(call.path, "residual", slot)
        return None

    def _identity_producers(self, vid: int) -> list[ModuleCall]:
        """The module calls whose first output becomes ``vid`` unchanged: those returning ``vid`` itself, then
        those returning a value that reaches ``vid`` only through identity ops (eval-mode dropout, casts,
        ``contiguous``) of the same shape, each read once. A residual branch written ``x + drop(M(x, ...))``
        (rtdl's FT-Transformer) is then a residual sum of ``M`` just as ``x + M(x)`` is: a change to ``M``'s
        output reaches the sum as it is."""
        calls = []
        while True:
            calls.extend(c for c in self.by_output.get(vid, []) if c.outputs and c.outputs[0] == vid)
            op = self.graph.producer(self.graph.values[vid])
            if op is None or op.name not in IDENTITY_OPS or len(op.outputs) != 1 or not op.args \
                    or not isinstance(op.args[0], ValueRef):
                return calls
            src = op.args[0].id
            if len(self.graph.values[src].consumers) != 1 \
                    or self.graph.values[src].shape != self.graph.values[vid].shape:
                return calls
            vid = src

    def own_input_reach(self, vid: int, call: ModuleCall) -> Reach | None:
        """The reach of an op on norm ``call``'s own input argument (a pre-hook on the norm): it changes
        what that norm reads and nothing else, however many others read the value (the residual stream
        of a Pre-LN block does), so it is exact wherever the norm normalises the last axis alone. Its
        ``mapped`` is empty: the value itself is not centered for anyone else. None where the norm reduces
        over more than the last axis (one mean per row would not be its mean), or ``vid`` is not what this
        call reads.

        A norm called more than once (ALBERT's layer, shared across depth) takes it too: the op then runs at
        every call, and at each it removes a mean the norm removes anyway (``LN(x − mean(x)) = LN(x)``), so a
        call that needed no op is unchanged and every call that did is exact. Each call that needs it places
        it, keyed by its own input; the surgery installs one op on the module (``install_hook`` is idempotent).
        Refusing it left such a norm approximate where ``per_norm_centering`` with ``mean_carry=False`` (the
        Post-LN option set of ``--quantizer``) took away the MLP carry the defaults make it exact with."""
        site = self.sites.get(call.path)
        if site is None or len(site.normalized_shape) != 1:
            return None
        if len(self.calls_per_path[call.path]) != 1 and self.site_input.get(call.id) != vid:
            return None  # another call's input: that call places its own
        shape = self.graph.values[vid].shape
        if not shape:
            return None
        rows = torch.arange(shape[-1], dtype=torch.float64).expand(shape)
        return Reach(site_rows={call.id: rows})

    def behind(self, vid: int, stops: set[int], norm_inputs: set[int] | None = None) -> bool:
        """Does every path from value ``vid`` to a norm's input pass through one of the values ``stops``?

        ``norm_inputs``: only paths to these values count (default: the input of every norm). A plain
        walk over the graph (every consumer, every output: more paths than the index maps follow, so a
        ``True`` is never optimistic); ``False`` as soon as such an input is reached past ``stops``.
        """
        targets = self.input_to_sites if norm_inputs is None else norm_inputs
        stack, seen = [vid], set()
        while stack:
            v = stack.pop()
            if v in stops or v in seen:
                continue
            seen.add(v)
            if v in targets:
                return False
            for op_index in self.graph.values[v].consumers:
                stack.extend(self.graph.ops[op_index].outputs)
        return True

    def hook_valid(self, vid: int) -> Reach | None:
        """The reach of value ``vid`` if one centering op there (over its last axis) makes every norm row
        it reaches zero-mean and changes nothing else, else None (:meth:`hook_problem` says why)."""
        return None if self.hook_problem(vid) else self.reach(vid, -1)

    def hook_problem(self, vid: int) -> str:
        """Why a centering op on value ``vid`` would not be exact ('' when it would)."""
        reach = self.reach(vid, -1)
        if reach.conflict:
            return reach.conflict
        if reach.blockers:
            return f"is also read by {reach.blockers[0][0]} (not a norm)"
        bad_outputs = [o for o in reach.outputs if "hidden_state" not in o]
        if bad_outputs:
            return f"is also returned as `{bad_outputs[0]}`"
        groups, why = self._groups(reach, lambda: self.reach(vid, -1, tokens=True))
        if why:
            return why
        if groups != {tuple(range(self.graph.values[vid].shape[-1]))}:
            return "reaches norm rows that hold only part of its features"
        return ""

    # ------------------------------------------------------------------ 3b. an MLP carries a Post-LN mean
    def _row_preserving(self, op: Op, vid: int) -> bool:
        """An identity op on ``vid``, or a view/reshape that keeps every row of features intact."""
        if not op.args or op.args[0] != ValueRef(vid) or len(op.outputs) != 1:
            return False
        if op.name in IDENTITY_OPS:
            return True
        shape_in, shape_out = self.graph.values[vid].shape, self.graph.values[op.outputs[0]].shape
        return op.name in ("view", "reshape", "flatten", "unflatten") and bool(shape_in) and bool(shape_out) \
            and shape_in[-1] == shape_out[-1]

    def _back_identity(self, vid: int, *, single: bool) -> int:
        """Walk back through identity ops and row-keeping reshapes; ``single``: only values read once."""
        while True:
            op = self.graph.producer(self.graph.values[vid])
            if op is None or not op.args or not isinstance(op.args[0], ValueRef) \
                    or not self._row_preserving(op, op.args[0].id):
                return vid
            if single and len(self.graph.values[op.args[0].id].consumers) != 1:
                return vid
            vid = op.args[0].id

    def _plain_sum(self, vid: int, target: int) -> bool:
        """Does ``vid`` reach ``target`` once, with coefficient 1, through adds and identity ops only?"""
        paths, stack = 0, [vid]
        while stack:
            v = stack.pop()
            if v == target:
                paths += 1
                continue
            for i in self.graph.values[v].consumers:
                op = self.graph.ops[i]
                if len(op.outputs) != 1:
                    continue
                plain_add = op.name in ("add", "__add__", "__radd__", "add_", "__iadd__") and not op.kwargs
                if plain_add or self._row_preserving(op, v):
                    stack.append(op.outputs[0])
        return paths == 1

    def _odd_split(self, run: object, width: int) -> bool:
        """Is ``run`` elementwise with ``act(t) - act(-t) = t`` (checked in float64 on random and large t)?"""
        gen = torch.Generator().manual_seed(0)
        t = torch.cat([torch.randn(3, width + 8, generator=gen, dtype=torch.float64) * 4,
                       torch.linspace(-40, 40, width + 8, dtype=torch.float64)[None]])
        try:
            with torch.no_grad():
                pos, neg, part = run(t), run(-t), run(t[:, :width])
        except Exception:  # noqa: BLE001 - not callable on a wider tensor: not elementwise
            return False
        if not all(isinstance(x, torch.Tensor) and x.shape == y.shape for x, y in ((pos, t), (neg, t))):
            return False
        return bool(torch.allclose(pos - neg, t, rtol=1e-12, atol=1e-12)
                    and torch.equal(pos[:, :width], part))

    def _activation(self, a: int) -> tuple[int, str, object] | None:
        """The elementwise activation that produced value ``a``: (its input, label, replay function).

        Its input must be read by the activation alone (one op, or ops inside one module call).
        """
        op = self.graph.producer(self.graph.values[a])
        refs = [] if op is None else [x for x in pytree.tree_leaves((op.args, op.kwargs)) if isinstance(x, ValueRef)]
        if op is not None and len(refs) == 1 and len(op.outputs) == 1:
            ref = refs[0]

            def replay(t: torch.Tensor, op: Op = op, ref: ValueRef = ref) -> torch.Tensor:
                args, kwargs = pytree.tree_map(lambda x: t if x == ref else x, (op.args, op.kwargs))
                return op.func(*args, **kwargs)
            if self._odd_split(replay, self.graph.values[ref.id].shape[-1]) \
                    and self.graph.values[ref.id].consumers == [op.index]:
                return ref.id, f"`{op.name}`", replay
        for call in self.by_output.get(a, []):  # an activation module made of several ops (GELU-tanh, quick-GELU)
            vid = call.first_input()
            if vid is None or writer_kind(call.module) or call.outputs != [a] or len(call.args) + len(call.kwargs) != 1:
                continue
            if len(self.calls_per_path.get(call.path, [])) != 1 and any(p for p in call.module.parameters()):
                continue
            inside = all(self._inside(i, call) for i in self.graph.values[vid].consumers)
            if inside and self._odd_split(call.module, self.graph.values[vid].shape[-1]):
                return vid, f"`{call.path}` ({type(call.module).__name__})", call.module
        return None

    def mean_carry(self, site_call: ModuleCall, norm_term: Term, terms: list[Term],
                   module_ok: dict[str, str | None], shared_calls: int = 1, multiple: int = 8) -> MeanCarry | None:
        """An MLP of this stream that can cancel ``norm_term``'s mean (see :class:`MeanCarry`), or None.

        Needed: the stream is ``h + down(act(up(h)))`` plus centerable terms, with ``h`` the norm
        output entering once and unscaled, ``up``/``down`` Linears called once per call of the norm
        (``shared_calls``: more than one for a layer shared across depth), ``act`` elementwise and
        odd-split, each intermediate read only by the next step, and ``down`` centerable. The widened
        width is the next multiple of ``multiple`` with room for the carry's :attr:`MeanCarry.NEURONS` neurons.
        """
        site = self.sites[site_call.path]
        target = self.site_input[site_call.id]
        d = self.graph.values[norm_term.value].shape[-1] if self.graph.values[norm_term.value].shape else 0
        if len(site.normalized_shape) != 1 or site.normalized_shape[0] != d or target is None \
                or not self._plain_sum(norm_term.value, target):
            return None
        for t in terms:
            if t.kind != "module" or module_ok.get(t.module_path) is not None:
                continue
            down = self.modules[t.module_path]
            if not isinstance(down, nn.Linear) or down.out_features != d or t.call is None \
                    or len(self.calls_per_path.get(t.module_path, [])) != shared_calls \
                    or not self._plain_sum(t.value, target):
                continue
            dcall = self.graph.calls[t.call]
            a = dcall.first_input()
            if a is None or len(dcall.args) + len(dcall.kwargs) != 1:
                continue
            a = self._back_identity(a, single=True)
            if len(self.graph.values[a].consumers) != 1:
                continue
            act = self._activation(a)
            if act is None:
                continue
            u, label, _ = act  # read by the activation alone (checked there)
            if self._back_identity(u, single=True) != u:
                u = self._back_identity(u, single=True)  # dropout/cast between: each read once
                if len(self.graph.values[u].consumers) != 1:
                    continue
            ucall = next((c for c in self.by_output.get(u, []) if isinstance(c.module, nn.Linear)), None)
            if ucall is None or len(self.calls_per_path.get(ucall.path, [])) != shared_calls \
                    or ucall.module.in_features != d \
                    or ucall.module.out_features != down.in_features or len(ucall.args) + len(ucall.kwargs) != 1:
                continue
            h = ucall.first_input()
            if h is None or self._back_identity(h, single=False) != norm_term.value:
                continue
            hidden = down.in_features
            added = -(-(hidden + MeanCarry.NEURONS) // multiple) * multiple - hidden
            # the scale comes from down's columns as the surgery writes them (centered, in float64), as
            # the streamed rewrite computes it (checkpoint.rewrite), so both write and record the same
            w = down.weight.detach().double()
            scale = MeanCarry.scale_for(w - w.mean(0, keepdim=True), ucall.module.weight.detach().double())
            return MeanCarry(site_call.path, norm_term.module_path or norm_term.label, ucall.path, t.module_path,
                             d, hidden, added, label, scale)
        return None

    # ------------------------------------------------------------------ 4. readers
    def _mean_like(self, op: Op, vid: int) -> bool:
        """Does ``op`` average tokens of ``vid`` (features last, in and out) with weights summing to 1?

        Then a reader past it still sees ``γ ⊙ mix(u) + β``: β and γ fold into it as if it read the
        norm directly, and an orthogonal turn of the features commutes with the mix.
        """
        last_in, last_out = len(self.graph.values[vid].shape) - 1, len(self.graph.values[op.outputs[0]].shape) - 1
        return any(mix.keeps_constants and mix.in_axis == last_in and mix.out_axis == last_out
                   for mix in self.mixing(op, vid))

    def _keeps_features(self, op: Op, vid: int, width: int) -> bool:
        """Does shape op ``op`` keep the features of ``vid`` (its last axis) as the last axis of every
        output, whole and in order? Decided by replaying it on an index map of the features, so any
        view, transpose or permute that leaves the feature axis alone qualifies, whatever it does to
        the others."""
        shape = self.graph.values[vid].shape
        if not shape or shape[-1] != width:
            return False
        feats = torch.arange(width, dtype=torch.float64).expand(shape)
        outs = replay(self.graph, op, {vid: feats}, [vid])
        if outs is None:
            return False
        order = torch.arange(width, dtype=torch.float64)
        return all(m.dim() > 0 and m.shape[-1] == width and bool((m == order).all()) for m in outs.values())

    def norm_output(self, call: ModuleCall) -> int | None:
        """The value id a norm call's readers read: a site call's recorded output (None when it has
        none), else the call's one output, or None for a call with several outputs (no single tensor
        to follow). :meth:`readers` and the residual-writer search start from it."""
        if call.id in self.site_output:
            return self.site_output[call.id]
        return call.outputs[0] if len(call.outputs) == 1 else None

    def readers(self, call: ModuleCall) -> tuple[list[ModuleCall], list[str]]:
        """(Linear/Conv1D reader calls, descriptions of other readers) of one norm call."""
        out_vid = self.norm_output(call)
        if out_vid is None:
            return [], ["no tensor output"]
        width = self.graph.values[out_vid].shape[-1]
        foldable, other = [], []
        stack = [out_vid]
        seen = set()
        while stack:
            vid = stack.pop()
            if vid in seen:
                continue
            seen.add(vid)
            if vid in self.output_values:
                other.append(f"model output `{self.output_values[vid]}`")
            readers_here = {c.id for c, slot in self.by_input.get(vid, [])
                            if slot in (0, "input", "hidden_states", "x") and writer_kind(c.module) in
                            ("linear", "conv1d") and self.graph.values[vid].shape[-1] == width}
            for op_index in self.graph.values[vid].consumers:
                op = self.graph.ops[op_index]
                owner = next((c for c in self.graph.ancestors_calls(op.call) if c.id in readers_here), None)
                if owner is not None:
                    foldable.append(owner)
                    continue
                if op.name in READER_OPS and op.args and isinstance(op.args[0], ValueRef) \
                        and op.args[0].id == vid:
                    outs = [o for o in op.outputs if self.graph.values[o].shape[-1:] == (width,)]
                    if len(outs) == len(op.outputs):
                        stack.extend(outs)
                        continue
                if op.name in SHAPE_OPS and self._keeps_features(op, vid, width):
                    stack.extend(op.outputs)  # a transpose or permute of the other axes (batch_first)
                    continue
                if self._mean_like(op, vid):
                    stack.append(op.outputs[0])
                    continue
                where = self._call_of_op(op)
                other.append(f"`{op.name}`" + (f" in `{where}`" if where else ""))
        unique = {c.id: c for c in foldable}
        return list(unique.values()), sorted(set(other))


_NO_DATA_INPLACE = {"requires_grad_", "share_memory_", "retain_grad", "detach_"}  # flags, not values


def mutated_parameters(graph: Graph) -> list[tuple[str, str]]:
    """(parameter name, op) for every parameter an in-place op changed during the traced forward."""
    found = []
    for op in graph.ops:
        if op.name in _NO_DATA_INPLACE:
            continue
        inplace = op.name.endswith("_") and not op.name.endswith("__") or op.name in (
            "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")
        target = op.args[0] if op.args else None
        if inplace and isinstance(target, ValueRef) and graph.values[target.id].source == "param":
            found.append((graph.values[target.id].name, op.name))
    return found
