"""Record one eager forward pass as a dataflow graph of torch-level ops and module calls.

Why not ``torch.export``: it fails on data-dependent Python in custom models, is slow on large
ones, and decomposes modules we need to see whole. Recording every torch function call under a
``TorchFunctionMode`` works on any model that runs eagerly, and per-module forward hooks give the
module boundaries (who produced a tensor, who consumed it) that the analysis needs.

The graph is in SSA form: every tensor an op returns becomes a new :class:`Value`, in-place ops
included (``x += y`` yields a new value bound to the same tensor object), so "who wrote what"
stays unambiguous. All recorded tensors are kept alive for the graph's lifetime, so Python object
ids cannot be reused while tracing. A value's ``tensor`` is the live object, so an in-place op
after it changes what it holds; the inputs and outputs of the modules the walker identifies from
their data (``snapshot``) are copied when they return and, where the model changed them in place
later (``x = patch_embedding(img); x += pos``), the value holds that copy.

An argument an op reads for its dtype, device or shape only (``attn_weights.type_as(attn)``,
``x.new_zeros(...)``, ``torch.zeros_like(x)``) is kept in the op's ``args`` but is not one of its
``inputs``, and the op is not among that value's ``consumers``: it reads no value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from normswap.analysis.linears import (
    CONTRACTION_BIAS,
    CONTRACTION_OPS,
    LAYOUT_OPS,
    FunctionalLinear,
    LinearView,
    ParamContraction,
    linear_module_kind,
)
from normswap.analysis.precision import HoldCasts


@dataclass
class Value:
    """One version of one tensor."""

    id: int
    shape: tuple[int, ...]
    tensor: torch.Tensor
    producer: int | None = None  # index into Graph.ops
    source: str = "op"  # op | param | buffer | input | external
    name: str | None = None  # parameter / buffer / input name
    consumers: list[int] = field(default_factory=list)  # op indices


@dataclass(frozen=True)
class ValueRef:
    """Placeholder for a Value inside a recorded op's args."""

    id: int


@dataclass
class Op:
    index: int
    name: str
    func: Callable[..., Any]
    args: tuple[Any, ...]  # pytree with ValueRef leaves for tensors
    kwargs: dict[str, Any]
    inputs: list[int]  # Value ids, flattened order
    outputs: list[int]  # Value ids, flattened order of the result
    out_spec: Any  # pytree spec of the result (to rebuild it when replaying)
    call: int | None  # innermost ModuleCall id active when the op ran


@dataclass
class ModuleCall:
    id: int
    path: str
    module: nn.Module
    parent: int | None
    args: list[int | None]  # Value id per positional arg (None: not a tensor)
    kwargs: dict[str, int]  # Value id per tensor kwarg
    outputs: list[int] = field(default_factory=list)
    start_op: int = 0
    end_op: int = 0
    # a Linear the model's code applied to parameters itself (``module`` is a LinearView, ``path`` its
    # name): one op, no module call, so no hook can sit on it
    functional: bool = False
    # how the call returned its result when not one tensor (``(x, None)``: I-BERT's IntLayerNorm), in
    # normswap.nn.call_args' ``Returns`` form; a norm's replacement returns the same structure
    returns: dict[str, Any] = field(default_factory=dict)

    def first_input(self) -> int | None:
        """Value id of the first tensor argument (positional first, then keyword): a norm's input."""
        for vid in self.args:
            if vid is not None:
                return vid
        return next(iter(self.kwargs.values()), None)


@dataclass
class Graph:
    values: dict[int, Value] = field(default_factory=dict)
    ops: list[Op] = field(default_factory=list)
    calls: list[ModuleCall] = field(default_factory=list)
    outputs: list[tuple[str, int]] = field(default_factory=list)  # (output path, Value id)
    output_object: Any = None
    held_casts: dict[str, int] = field(default_factory=dict)  # downcasts held at the working dtype, by op name
    draws_random: bool = False  # the traced forward drew random numbers (set by its caller: pipeline._run_trace)

    def calls_of(self, path: str) -> list[ModuleCall]:
        return [c for c in self.calls if c.path == path]

    def producer(self, value: Value) -> Op | None:
        return None if value.producer is None else self.ops[value.producer]

    def call_by_output(self) -> dict[int, list[ModuleCall]]:
        """Value id -> module calls that returned it (outermost last)."""
        index: dict[int, list[ModuleCall]] = {}
        for call in self.calls:
            for vid in call.outputs:
                index.setdefault(vid, []).append(call)
        return index

    def call_by_input(self) -> dict[int, list[tuple[ModuleCall, int | str]]]:
        """Value id -> (module call, positional index or kwarg name) that received it."""
        index: dict[int, list[tuple[ModuleCall, int | str]]] = {}
        for call in self.calls:
            for i, vid in enumerate(call.args):
                if vid is not None:
                    index.setdefault(vid, []).append((call, i))
            for key, vid in call.kwargs.items():
                index.setdefault(vid, []).append((call, key))
        return index

    def ancestors_calls(self, call_id: int | None) -> Iterator[ModuleCall]:
        while call_id is not None:
            call = self.calls[call_id]
            yield call
            call_id = call.parent


_INPLACE_NO_RETURN = {"__setitem__"}
# Casts and moves that return their very input when there is nothing to do (``x.to(x.dtype)``,
# ``.float()`` of a float32 tensor, every cast held by normswap.analysis.precision). Not recorded then: a new
# value for the same object would look like an in-place write, and the model's later reads of ``x``
# would seem to come out of the cast (out of a norm, for Whisper's ``super().forward(x.float())``).
_NOOP_WHEN_SAME = {"to", "type", "type_as", "float", "double", "half", "bfloat16", "contiguous", "cpu", "cuda"}
# Arguments an op reads for their dtype, device or shape only (positions, keyword names): not data inputs.
METADATA_ARGS: dict[str, tuple[int | str, ...]] = {
    "type_as": (1, "other"), "to": (1, "other"),  # x.to(other): other's dtype and device
    "expand_as": (1, "other"), "view_as": (1, "other"), "reshape_as": (1, "other"),
    **{f"new_{k}": (0,) for k in ("zeros", "ones", "empty", "full", "tensor", "empty_strided")},
    **{f"{k}_like": (0, "input") for k in ("zeros", "ones", "empty", "full", "rand", "randn", "randint")},
}

# Python-level torch functions recorded as the ops they run rather than as one opaque op: inside
# ``multi_head_attention_forward`` are the q/k/v and output projections (``F.linear`` on
# ``in_proj_weight`` and ``out_proj.weight``), writers and readers of the streams around attention.
OPENED = (F.multi_head_attention_forward,)
# ops that apply a weight matrix to the last axis of their data argument: (data arg, weight arg,
# bias arg or None, weight stored as x @ W takes it (``[in, out]``) rather than as nn.Linear does)
LINEAR_OPS = {"linear": (0, 1, 2, False), "matmul": (0, 1, None, True), "__matmul__": (0, 1, None, True),
              "mm": (0, 1, None, True), "addmm": (1, 2, 0, True)}


# ops whose module call the walker may identify as a norm by what it computes (``layer_norm`` itself, or the
# statistics of one written in ops: ``x.mean(-1)``, ``x.var(-1)``, ``torch.rsqrt``): that call's input and
# output are snapshotted like a named candidate's
NORM_STAT_OPS = frozenset({"layer_norm", "mean", "var", "var_mean", "std", "std_mean", "rsqrt", "sqrt"})


class _Recorder(TorchFunctionMode):
    def __init__(self, graph: Graph, params: dict[int, str], buffers: dict[int, str],
                 modules: dict[str, nn.Module] | None = None) -> None:
        super().__init__()
        self.graph = graph
        self.params = params
        self.buffers = buffers
        self.binding: dict[int, int] = {}  # id(tensor object) -> current Value id
        self.keep: list[torch.Tensor] = []
        self.call_stack: list[int] = []
        self.modules = modules or {}
        self.by_storage: dict[int, list[nn.Parameter]] = {}  # parameters by the address of their storage
        self.named: dict[int, nn.Parameter] = {}
        for module in self.modules.values():
            for p in module._parameters.values():
                if p is not None and id(p) in params and id(p) not in self.named:
                    self.named[id(p)] = p
                    if p.numel():
                        self.by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(p)
        self.above: TorchFunctionMode | None = None  # a mode that runs above this one (record's ``hold``)
        self.snapshot_paths: set[str] = set()
        self.direct_ln: set[int] = set()  # calls inside which `layer_norm` or a norm's statistic ran
        self.snapshots: dict[int, tuple[int, torch.Tensor]] = {}  # Value id -> (version, copy)

    # -- values ---------------------------------------------------------------------------------
    def _new_value(self, t: torch.Tensor, producer: int | None, source: str, name: str | None = None) -> int:
        vid = len(self.graph.values)
        self.graph.values[vid] = Value(vid, tuple(t.shape), t, producer, source, name)
        self.binding[id(t)] = vid
        self.keep.append(t)
        return vid

    def value_of(self, t: torch.Tensor) -> int:
        vid = self.binding.get(id(t))
        if vid is not None:
            return vid
        if id(t) in self.params:
            return self._new_value(t, None, "param", self.params[id(t)])
        if id(t) in self.buffers:
            return self._new_value(t, None, "buffer", self.buffers[id(t)])
        return self._new_value(t, None, "external")

    # -- ops ------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in OPENED:
            return self._run_opened(func, args, kwargs)
        result = func(*args, **kwargs)
        name = _op_name(func)
        if name in _NOOP_WHEN_SAME and args and result is args[0]:
            return result  # nothing happened to the value
        out_leaves, out_spec = pytree.tree_flatten(result)
        out_tensors = [t for t in out_leaves if isinstance(t, torch.Tensor)]
        if name in _INPLACE_NO_RETURN and args and isinstance(args[0], torch.Tensor):
            out_tensors = [args[0]]
            out_leaves, out_spec = pytree.tree_flatten(args[0])
        if not out_tensors:
            return result  # shape queries, .item(), ...: no dataflow

        inputs: list[int] = []

        def ref(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                vid = self.value_of(x)
                inputs.append(vid)
                return ValueRef(vid)
            return x

        def meta_ref(x: Any) -> Any:  # read for its dtype/device/shape: no data input
            return ValueRef(self.value_of(x)) if isinstance(x, torch.Tensor) else x

        meta = METADATA_ARGS.get(name, ())
        ref_args = tuple(pytree.tree_map(meta_ref if i in meta else ref, a) for i, a in enumerate(args))
        ref_kwargs = {k: pytree.tree_map(meta_ref if k in meta else ref, v) for k, v in kwargs.items()}
        index = len(self.graph.ops)
        outputs = [self._new_value(t, index, "op") for t in out_tensors]
        call = self.call_stack[-1] if self.call_stack else None
        applied = self._functional_linear(name, args, kwargs) if len(outputs) == 1 else None
        data_id = ref_args[LINEAR_OPS[name][0]].id if applied is not None else None
        if applied is None and len(outputs) == 1 and name in CONTRACTION_OPS:
            applied, data_id = self._param_contraction(name, index, ref_args, ref_kwargs)
        if applied is not None:
            path, module = applied
            fcall = ModuleCall(len(self.graph.calls), path, module, call, [data_id], {}, outputs=outputs,
                               start_op=index, end_op=index + 1, functional=True)
            self.graph.calls.append(fcall)
            call = fcall.id
        if name in NORM_STAT_OPS and call is not None:  # a norm written in ops: the walker identifies it
            self.direct_ln.add(call)
        self.graph.ops.append(Op(index, name, func, ref_args, ref_kwargs, inputs, outputs, out_spec, call))
        for vid in set(inputs):
            self.graph.values[vid].consumers.append(index)
        return result

    def _run_opened(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run an :data:`OPENED` function with this mode active inside it, so its ops are recorded.

        The mode is off while it handles a call (PyTorch pops it), so the function runs under it again;
        its own first ``has_torch_function`` test, which would hand the call straight back here, is
        answered "no" once (the module's global, restored right after). Every op inside dispatches
        to this mode as usual."""
        module = sys.modules[func.__module__]
        real = module.has_torch_function
        pending = [True]

        def first_says_no(*a: Any) -> bool:
            if pending[0]:
                pending[0] = False
                return False
            return real(*a)

        module.has_torch_function = first_says_no
        try:  # the modes above this one (precision.HoldCasts) are off too while it handles a call
            with self, self.above if self.above is not None else contextlib.nullcontext():
                return func(*args, **kwargs)
        finally:
            module.has_torch_function = real

    def _param_part(self, t: Any) -> tuple[nn.Parameter, tuple[int, int] | None, bool] | None:
        """``(parameter, rows, transposed)`` when ``t`` is a parameter, a block of its rows along the
        first axis, or its transpose (``p.T``); None otherwise."""
        if not isinstance(t, torch.Tensor) or t.dim() not in (1, 2) or not t.numel():
            return None
        if id(t) in self.named:
            return self.named[id(t)], None, False
        for p in self.by_storage.get(t.untyped_storage().data_ptr(), []):
            if p.dim() != t.dim():
                continue
            offset = t.storage_offset() - p.storage_offset()
            if t.dim() == 2 and tuple(t.shape) == tuple(p.shape)[::-1] and t.stride() == p.stride()[::-1] \
                    and offset == 0:
                return p, None, True
            step = p.stride(0)
            if tuple(t.shape[1:]) == tuple(p.shape[1:]) and t.stride() == p.stride() and step > 0 \
                    and offset % step == 0 and 0 <= offset // step and offset // step + t.shape[0] <= p.shape[0]:
                lo = offset // step
                return p, (lo, lo + t.shape[0]), False
        return None

    def _functional_linear(self, name: str, args: tuple, kwargs: dict) -> tuple[str, nn.Module | LinearView] | None:
        """``(path, module)`` of a linear op the model's code applies to parameters itself, outside the
        ``forward`` of the Linear-like module that owns them, or None.

        Where the op computes exactly what a Linear-like module would (its whole weight, its bias),
        that module stands for it (``nn.MultiheadAttention``'s ``out_proj``); otherwise a
        :class:`LinearView` (``in_proj_weight``, rows of it, ``x @ emb.weight.T``)."""
        form = LINEAR_OPS.get(name)
        if form is None or kwargs:
            return None
        data_at, weight_at, bias_at, as_x_w = form
        if len(args) <= max(data_at, weight_at) or not isinstance(args[data_at], torch.Tensor):
            return None
        found = self._param_part(args[weight_at])
        if found is None:
            found = self._laid_out_part(args[weight_at])
        if found is None or found[0].dim() != 2:
            return None
        weight, rows, swapped = found
        if rows == (0, weight.shape[0]):
            rows = None  # a view of the whole parameter (``W.mT.mT``)
        transposed = as_x_w != swapped  # stored [in, out]: applied as x @ W
        if rows is not None and (swapped or transposed):
            return None  # rows of its input axis, not its output's: a ParamContraction (_param_contraction)
        wname = self.params[id(weight)]
        owner_path = wname.rpartition(".")[0]
        owner = self.modules.get(owner_path)
        if owner is None:
            return None
        if self.call_stack:  # inside a Linear's own forward (nn.Linear calls F.linear): a module call already
            inner = self.graph.calls[self.call_stack[-1]].module
            if linear_module_kind(inner) is not None and any(q is weight for q in inner._parameters.values()):
                return None
        in_axis = 0 if transposed else 1
        if args[data_at].dim() < 1 or args[data_at].shape[-1] != weight.shape[in_axis]:
            return None
        bias, bias_rows = None, None
        b = args[bias_at] if bias_at is not None and len(args) > bias_at else None
        if b is not None:
            part = self._param_part(b)
            if part is None or part[0].dim() != 1 or part[2]:
                return None
            bname = self.params[id(part[0])]
            if bname.rpartition(".")[0] != owner_path:
                return None  # a bias from another module: not one linear map of one owner
            bias, bias_rows = bname, part[1]
        kind = linear_module_kind(owner)
        if kind is not None and getattr(owner, "weight", None) is weight and rows is None and bias_rows is None \
                and transposed == (kind == "conv1d") \
                and (bias is None) == (owner._parameters.get("bias") is None):
            return owner_path, owner
        spec = FunctionalLinear(wname, rows, transposed, bias, bias_rows)
        return spec.name, LinearView(spec, weight, None if bias is None else self.named[id(part[0])], owner)

    def _layout_source(self, vid: int) -> int | None:
        """The parameter value that value ``vid`` is, laid out another way (through :data:`LAYOUT_OPS` only,
        each taking it as its data argument; other tensor arguments are integer indices), or None."""
        for _ in range(64):
            value = self.graph.values[vid]
            if value.source == "param":
                return vid
            if value.producer is None:
                return None
            op = self.graph.ops[value.producer]
            if op.name not in LAYOUT_OPS or not op.args or not isinstance(op.args[0], ValueRef) or len(op.outputs) != 1:
                return None
            others = [r for r in pytree.tree_leaves((op.args[1:], op.kwargs)) if isinstance(r, ValueRef)]
            if any(self.graph.values[r.id].tensor.is_floating_point() for r in others):
                return None
            vid = op.args[0].id
        return None

    def _laid_out_part(self, t: Any) -> tuple[nn.Parameter, None, bool] | None:
        """``(parameter, None, transposed)`` when ``t`` holds a 2-D parameter's elements in their own order or
        transposed, reached through layout ops that copied them (``W.T.contiguous()``, ``W.to(dtype)``): read
        off :func:`layout_coords`; None otherwise."""
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or id(t) not in self.binding:
            return None
        vid = self.binding[id(t)]
        source = self._layout_source(vid)
        if source is None or self.graph.values[source].tensor.dim() != 2:
            return None
        coords = layout_coords(self.graph, source, vid)
        param = self.graph.values[source].tensor
        if coords is None or id(param) not in self.named:
            return None
        rows, cols = (torch.arange(n, dtype=torch.float64) for n in param.shape)
        if tuple(t.shape) == tuple(param.shape) and torch.equal(coords[0], rows[:, None].expand(t.shape)) \
                and torch.equal(coords[1], cols[None, :].expand(t.shape)):
            return self.named[id(param)], None, False
        if tuple(t.shape) == tuple(param.shape)[::-1] and torch.equal(coords[0], rows[None, :].expand(t.shape)) \
                and torch.equal(coords[1], cols[:, None].expand(t.shape)):
            return self.named[id(param)], None, True
        return None

    def _param_contraction(self, name: str, index: int, ref_args: tuple, ref_kwargs: dict
                           ) -> tuple[tuple[str, ParamContraction] | None, int | None]:
        """``((path, ParamContraction), data value id)`` for a contraction one of whose operands is a stored
        parameter through layout ops and whose other operands are not, outside the ``forward`` of a
        Linear-like module owning that parameter; ``(None, None)`` otherwise."""
        bias_at = CONTRACTION_BIAS.get(name)
        bias_ref = None
        if bias_at is not None:
            bias_ref = ref_kwargs.get(bias_at[1], ref_args[bias_at[0]] if len(ref_args) > bias_at[0] else None)
        operands = [r for r in pytree.tree_leaves((ref_args, ref_kwargs))
                    if isinstance(r, ValueRef) and r != bias_ref and self.graph.values[r.id].tensor.is_floating_point()]
        sources = [self._layout_source(r.id) for r in operands]
        weights = [(r, s) for r, s in zip(operands, sources, strict=True) if s is not None]
        data = [r for r, s in zip(operands, sources, strict=True) if s is None]
        if len(weights) != 1 or not data:
            return None, None
        (wref, wsrc), param = weights[0], self.graph.values[weights[0][1]]
        owner_path = (param.name or "").rpartition(".")[0]
        if self.call_stack:  # inside a Linear's own forward: that module call is the writer
            inner = self.graph.calls[self.call_stack[-1]].module
            if linear_module_kind(inner) is not None and any(q is param.tensor for q in inner._parameters.values()):
                return None, None
        bias, bias_src = None, None
        if isinstance(bias_ref, ValueRef):
            bias_src = self._layout_source(bias_ref.id)
            if bias_src is None:
                return None, None  # a computed bias: not one stored parameter
            bias = self.graph.values[bias_src].name
        label = {"__matmul__": "matmul", "__rmatmul__": "matmul"}.get(name, name)
        path = f"{label}({param.name})"
        module = ParamContraction(path, param.name or "", owner_path, index, wref.id, wsrc, bias,
                                  bias_ref.id if bias is not None else None, bias_src)
        return (path, module), data[0].id

    # -- module hooks ---------------------------------------------------------------------------
    def pre_hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            arg_ids = [self.value_of(a) if isinstance(a, torch.Tensor) else None for a in args]
            kw_ids = {k: self.value_of(v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
            call = ModuleCall(len(self.graph.calls), path, module,
                              self.call_stack[-1] if self.call_stack else None, arg_ids, kw_ids,
                              start_op=len(self.graph.ops))
            self.graph.calls.append(call)
            self.call_stack.append(call.id)

        return hook

    def post_hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            call = self.graph.calls[self.call_stack.pop()]
            assert call.path == path, (call.path, path)
            call.end_op = len(self.graph.ops)
            leaves = pytree.tree_leaves(output)
            call.outputs = [self.value_of(t) for t in leaves if isinstance(t, torch.Tensor)]
            if not isinstance(output, torch.Tensor):
                call.returns = return_form(output, args, kwargs)
            if path in self.snapshot_paths or call.id in self.direct_ln:
                tensors = [v for v in [*call.args, *call.kwargs.values()] if v is not None]
                for vid in [*tensors[:2], *call.outputs[:1]]:
                    self.snapshot(vid)

        return hook

    def snapshot(self, vid: int) -> None:
        """Copy what value ``vid`` holds now, in case the model changes its tensor in place later."""
        if vid in self.snapshots:
            return
        t = self.graph.values[vid].tensor
        with torch._C.DisableTorchFunction():  # our own copy: not an op of the model
            try:
                version = t._version
            except RuntimeError:  # an inference tensor has no version counter, and cannot be changed in place
                return
            self.snapshots[vid] = (version, t.detach().clone())

    def restore_snapshots(self) -> None:
        """Values whose tensor was changed in place after their snapshot hold the snapshot instead."""
        with torch._C.DisableTorchFunction():
            for vid, (version, copy) in self.snapshots.items():
                if self.graph.values[vid].tensor._version != version:
                    self.graph.values[vid].tensor = copy
        self.snapshots.clear()


def record(model: nn.Module, args: tuple, kwargs: dict, *, snapshot: Collection[str] = (),
           hold: HoldCasts | None = None) -> Graph:
    """Run ``model(*args, **kwargs)`` once under no_grad and return its dataflow graph.

    Args:
        snapshot: module paths whose calls' tensor inputs and first output keep the values they had
            when the call returned (the norm candidates the walker identifies from their data); every
            module inside which ``layer_norm`` ran is added.
        hold: a :class:`normswap.analysis.precision.HoldCasts` mode to run above the recorder, so that the graph
            records the casts as they ran (held at the working dtype); its counts go to ``held_casts``.
    """
    graph = Graph()
    params = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(id(p), name)
    buffers = {}
    for name, b in model.named_buffers(remove_duplicate=False):
        buffers.setdefault(id(b), name)
    recorder = _Recorder(graph, params, buffers, dict(model.named_modules()))
    recorder.snapshot_paths = set(snapshot)
    recorder.above = hold
    for name, t in _named_inputs(args, kwargs):
        recorder._new_value(t, None, "input", name)
    handles = []
    try:
        for path, module in model.named_modules():  # a shared module is hooked once, by its first path
            handles.append(module.register_forward_pre_hook(recorder.pre_hook(path), with_kwargs=True))
            handles.append(module.register_forward_hook(recorder.post_hook(path), with_kwargs=True))
        with torch.no_grad(), recorder, hold if hold is not None else contextlib.nullcontext():
            output = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    recorder.restore_snapshots()
    if hold is not None:
        graph.held_casts = dict(hold.held)
    graph.output_object = output
    # same key paths as verification uses, so Plan.changed_outputs names what verify compares
    graph.outputs = [(path, recorder.value_of(t)) for path, t in flatten_outputs(output)]
    graph._keep = recorder.keep  # type: ignore[attr-defined]
    return graph


# casts and copies: the same elements in the same places (a coordinate map passes them unchanged)
_SAME_ELEMENTS = {"to", "type", "type_as", "float", "double", "half", "bfloat16", "detach", "contiguous", "clone"}


def layout_coords(graph: Graph, source: int, operand: int) -> list[torch.Tensor] | None:
    """Where each element of value ``operand`` sits in the stored parameter value ``source`` it was laid out
    from (``operand`` reached from ``source`` through layout ops, each taking it as its first argument): per
    axis of the parameter, a float64 tensor shaped like ``operand`` holding that coordinate.

    Each axis's coordinates start as an expanded ``arange`` (no copy of a parameter-sized tensor) and go
    through the recorded ops, so the maps cost what the operand costs: a fused MoE's 3-D experts
    tensor read one expert at a time never has a map of its own size. Casts and copies pass the maps as
    they are (a cast to half precision would round coordinates). None when an op does not replay."""
    chain, vid = [], operand
    while vid != source:
        value = graph.values[vid]
        if value.producer is None:
            return None
        op = graph.ops[value.producer]
        if not op.args or not isinstance(op.args[0], ValueRef):
            return None
        chain.append(op)
        vid = op.args[0].id
    shape = graph.values[source].shape
    out = []
    with torch._C.DisableTorchFunction():  # our own replay, not ops of the model
        for axis, n in enumerate(shape):
            view = [n if i == axis else 1 for i in range(len(shape))]
            m = torch.arange(n, dtype=torch.float64).reshape(view).expand(shape)
            for op in reversed(chain):
                if op.name in _SAME_ELEMENTS:
                    continue
                rest = pytree.tree_map(lambda a: graph.values[a.id].tensor if isinstance(a, ValueRef) else a,
                                       (op.args[1:], op.kwargs))
                try:
                    try:
                        m = op.func(m, *rest[0], **rest[1])
                    except RuntimeError:  # a view an expanded tensor cannot take: on a copy
                        m = op.func(m.contiguous(), *rest[0], **rest[1])
                except Exception:  # noqa: BLE001 - not replayable on a map: no coordinates
                    return None
                if not isinstance(m, torch.Tensor):
                    return None
            if tuple(m.shape) != graph.values[operand].shape:
                return None
            out.append(m)
    return out


def _op_name(func: Callable[..., Any]) -> str:
    """The name an op is recorded under: ``x.T`` and ``x.mT`` (attribute reads, dispatched as the
    descriptor's ``__get__``) by their attribute names."""
    name = getattr(func, "__name__", str(func))
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _named_inputs(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    named = [(f"arg{i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    named += [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return named


def return_form(output: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """How a module call returned something other than one tensor: a tuple/list whose items are
    ``"output"`` (the first item, a tensor it computed), ``"None"``, ``"arg N"``/``"kwarg NAME"`` (an
    argument returned as it came in, by identity), ``"computed tensor"`` or ``"other"``; any other result
    is ``{"type": <its class name>}``."""
    if not isinstance(output, (tuple, list)) or type(output) not in (tuple, list):
        return {"type": type(output).__name__}

    def item(i: int, v: Any) -> str:
        if v is None:
            return "None"
        for n, a in enumerate(args):
            if v is a:
                return f"arg {n}"
        for k, a in kwargs.items():
            if v is a:
                return f"kwarg {k}"
        if isinstance(v, torch.Tensor):
            return "output" if i == 0 else "computed tensor"
        return "other"

    return {"type": type(output).__name__, "items": [item(i, v) for i, v in enumerate(output)]}


def flatten_outputs(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a model's output (tensors, dicts, tuples, lists, dataclasses, nested), with its path
    (``logits``, ``past_key_values[0][1]``, ``hidden`` of a custom model's ``@dataclass`` output)."""
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, torch.Tensor):
        out.append((prefix or "output", obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out += flatten_outputs(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            out += flatten_outputs(v, f"{prefix}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # else verification would compare nothing
        for f in dataclasses.fields(obj):
            out += flatten_outputs(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name)
    return out
