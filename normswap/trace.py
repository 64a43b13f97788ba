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
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from normswap.precision import HoldCasts
from normswap.verify import flatten_outputs


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
# ``.float()`` of a float32 tensor, every cast held by normswap.precision). Not recorded then: a new
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


class _Recorder(TorchFunctionMode):
    def __init__(self, graph: Graph, params: dict[int, str], buffers: dict[int, str]) -> None:
        super().__init__()
        self.graph = graph
        self.params = params
        self.buffers = buffers
        self.binding: dict[int, int] = {}  # id(tensor object) -> current Value id
        self.keep: list[torch.Tensor] = []
        self.call_stack: list[int] = []
        self.snapshot_paths: set[str] = set()
        self.direct_ln: set[int] = set()  # calls inside which `layer_norm` itself ran
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
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
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
        if name == "layer_norm" and call is not None:
            self.direct_ln.add(call)
        self.graph.ops.append(Op(index, name, func, ref_args, ref_kwargs, inputs, outputs, out_spec, call))
        for vid in set(inputs):
            self.graph.values[vid].consumers.append(index)
        return result

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
        hold: a :class:`normswap.precision.HoldCasts` mode to run above the recorder, so that the graph
            records the casts as they ran (held at the working dtype); its counts go to ``held_casts``.
    """
    graph = Graph()
    params = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(id(p), name)
    buffers = {}
    for name, b in model.named_buffers(remove_duplicate=False):
        buffers.setdefault(id(b), name)
    recorder = _Recorder(graph, params, buffers)
    recorder.snapshot_paths = set(snapshot)
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


def _named_inputs(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    named = [(f"arg{i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    named += [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return named
