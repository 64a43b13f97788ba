"""Online Hadamards that survive engines which replace ``nn.Linear`` modules, and a guard where they do not.

An online Hadamard before a Linear (``rotate(..., online=True)``, ``rotate(model, "none", online=True)``,
``convert --online-hadamard``) is a forward pre-hook plus ``normswap_hadamard*`` buffers and
``_normswap_hadamard*`` attributes on the Linear itself, whose weight holds the op's transpose. Engines that
swap ``nn.Linear`` for their own module (bitsandbytes' ``Linear4bit`` / ``Linear8bitLt``, HQQ's ``HQQLinear``,
optimum-quanto's ``QLinear``, transformers' ``from_pretrained(..., quantization_config=...)``, which swaps
before the weights load) keep the turned weight and drop the op: a model with wrong outputs and no error.

What this module does about it:

* :func:`record` keeps, on the model (``model._normswap_online_ops``: ``{module path: HeldOp}``), each
  op's hook object, buffers and attributes: the rotation and the loader call it once the ops are installed.
  A few hundred bytes per op; nothing per call.
* :func:`carry_online_ops` puts each op back on whatever module now sits at its path (the engine's module
  computes the same ``x @ Wᵀ + b`` with the weight rounded, so the op before it is the same op). Loading a
  native checkpoint does this itself when a ``quantization_config`` swapped the Linears (:func:`after_load`,
  with the op's values read from the checkpoint, since the swap left them no module to load into); users who
  swap modules themselves after loading call it.
* :func:`check_online_ops` refuses, in one line naming the module, a model where a module that should hold
  an op does not. ``normswap.save`` and ``save_pretrained`` call it before writing anything; and the model's
  :class:`OpsGuard` (a forward pre-hook registered by :func:`record`) runs it before a call whenever a module
  on the way to an op is no longer the instance recorded there: a swap by ``setattr`` or into ``_modules``,
  with or without another reference to the old module, a deep copy's swap, a swap before or after
  ``torch.compile`` (Dynamo evaluates the comparison while tracing). Per call otherwise: one tuple comparison
  (``benchmarks/online_guard_cost.py``).
* PEFT adapter layers that wrap a Linear holding an op merge their update turned into the op's basis
  (:func:`turned_delta`, installed by torch's global module-registration hook as PEFT assigns its layer), so
  ``merge_and_unload`` keeps the model exact; DoRA is refused at merge. An adapter layer assigned in place of a
  reader of an op shared after a norm first moves that op onto each of the norm's readers
  (:func:`split_shared_op`), so the adapter reads the input before the op there too. An adapter layer on a value
  or attention output projection that holds the per-head ``H̃`` of the values (:class:`HeadTurn`, no op) is
  turned to act in the original basis (LoRA's branch, LoHa's / LoKr's update, the merge), or refused as it is
  attached.

Ops after a norm (``OnlineHadamardOutput``, a forward hook on the norm) are carried and checked the same way;
engines do not swap norms, so in practice they stay where they are. The op itself (its math) is
:class:`normswap.rotation.rotate.OnlineHadamard`'s; this module copies whatever buffers and attributes it keeps
under the ``normswap_hadamard`` / ``_normswap_hadamard`` prefixes, so it carries any form of the op.
"""

from __future__ import annotations

import copy
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.compiler import is_dynamo_compiling

from normswap.analysis.plan import ADAPTER_BASES_FILE, ADAPTER_VECTOR_FIELDS, REFUSE_ROTATED, Plan, plan_of
from normswap.errors import NormswapError
from normswap.rotation.heads import config_head_dim, head_turn, turn_heads, value_output

HANDLE = "_normswap_online"  # the op's RemovableHandle on its module (rotate.py's _install_online sets it)
BUFFER_PREFIX = "normswap_hadamard"  # the op's buffers: the small Hadamard factor, the signs, ...
ATTR_PREFIX = "_normswap_hadamard"  # its plain attributes (the Sylvester factor built from the widths)
REGISTRY = "_normswap_online_ops"  # on the model: {module path: HeldOp}
READER = "_normswap_shared_reader"  # on a Linear reader of an op shared after a norm: SharedReader
HEADS = "_normswap_value_heads"  # on a value / output projection whose weight holds the per-head turn: HeadTurn
HEAD_HOOK = "_normswap_head_turn"  # on an adapter's lora_B / lora_A Linear: the turn hook's handle
BASIS = "_normswap_adapter_basis"  # on a Linear the conversion edited (its folds, its centered rows): AdapterBasis
BASIS_HOOK = "_normswap_basis_hook"  # on an adapter's lora_A / lora_B Linear: the basis hook's handle

__all__ = ["HeldOp", "record", "held_ops", "carry_online_ops", "check_online_ops", "missing_online_ops",
           "after_load", "lost_line", "Refuse", "OpsGuard", "MergeInOpBasis", "turned_delta", "WatchedModules",
           "SharedReader", "split_shared_op", "HeadTurn", "TurnedHeadsDelta", "AdapterBasis", "mark_bases"]


@dataclass
class HeldOp:
    """One online Hadamard as its module held it: enough to put it on another module.

    ``output``: a forward hook on the module's output (a norm's op shared by its readers), else a pre-hook on
    its input. ``hook``: the hook object itself (it keeps per-device copies of its constant factor).
    ``buffers`` / ``attrs``: the module's ``normswap_hadamard*`` buffers and ``_normswap_hadamard*`` attributes,
    by name (buffers on the meta device until the checkpoint's values are loaded). ``live``: that module's own
    buffer dictionary, so that :meth:`current` reads the values as they are now: ``model.float()``, ``.half()``,
    ``.to(device)`` and ``load_state_dict(..., assign=True)`` put new tensors there, and a carry after them must
    install those, not the ones recorded at the rotation."""

    output: bool
    hook: Callable
    with_kwargs: bool = False
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    live: dict[str, torch.Tensor] | None = None

    def current(self) -> dict[str, torch.Tensor]:
        """The op's buffers as the module it was recorded from holds them now (where it still does), else as
        recorded."""
        live = self.live or {}
        return {n: live[n] if isinstance(live.get(n), torch.Tensor) else b for n, b in self.buffers.items()}


def holds_op(module: nn.Module) -> bool:
    """Whether ``module`` itself runs an online Hadamard: it has the op's handle and the hook is registered on
    it (a module whose ``__dict__`` an engine copied keeps the handle; the hook must still be its own)."""
    handle = module.__dict__.get(HANDLE)
    return handle is not None and (handle.id in module._forward_pre_hooks or handle.id in module._forward_hooks)


def _runs_op(module: nn.Module, held: HeldOp | None = None) -> bool:
    """The op runs when ``module`` is called: on ``module`` itself, or on a module inside it (a wrapper that
    calls the original Linear as a child, as PEFT's LoRA layers call their ``base_layer``). With ``held``, also
    where the recorded hook object was registered by other code that carried it (a benchmark's swap)."""
    return bool(_running_in(module, held))


def _running_in(module: nn.Module, held: HeldOp | None = None) -> list[str]:
    """The paths (relative to ``module``, ``""`` for itself) of the modules at or inside it that run the op."""
    found = []
    for sub, m in module.named_modules():
        if holds_op(m) or (held is not None and _registered(m, held) and all(hasattr(m, b) for b in held.buffers)):
            found.append(sub)
    return found


def _registered(module: nn.Module, held: HeldOp) -> list[int]:
    """The ids under which ``held``'s hook object is registered on ``module`` (an engine that copies a module's
    hooks onto its own, as torch.ao's ``swap_module`` does, registers it without the op's buffers)."""
    return [k for d in (module._forward_pre_hooks, module._forward_hooks) for k, h in d.items() if h is held.hook]


def _held(module: nn.Module) -> HeldOp:
    handle = module.__dict__[HANDLE]
    output = handle.id in module._forward_hooks
    hooks = module._forward_hooks if output else module._forward_pre_hooks
    kwargs = module._forward_hooks_with_kwargs if output else module._forward_pre_hooks_with_kwargs
    return HeldOp(output=output, hook=hooks[handle.id], with_kwargs=handle.id in kwargs,
                  buffers={n: b for n, b in module.named_buffers(recurse=False) if n.startswith(BUFFER_PREFIX)},
                  attrs={k: v for k, v in vars(module).items() if k.startswith(ATTR_PREFIX)}, live=module._buffers)


def held_ops(model: nn.Module) -> dict[str, HeldOp]:
    """``{module path: HeldOp}`` recorded on ``model`` (empty when it has no online op)."""
    return model.__dict__.get(REGISTRY) or {}


def record(model: nn.Module) -> dict[str, HeldOp]:
    """Record every online Hadamard ``model`` runs now (``{module path: HeldOp}``, kept on the model), and
    watch each op's module: if it is freed while ``model`` lives (an engine replaced it), ``model``'s next
    forward call checks its ops once (:func:`check_online_ops`). Ops recorded earlier whose module has lost
    them keep their record, so that :func:`carry_online_ops` can still put them back. Returns the record."""
    ops = dict(held_ops(model))
    for path, module in model.named_modules():
        if holds_op(module):
            ops[path] = _held(module)
            if hasattr(ops[path].hook, "transform"):  # the op names its module if run without its values
                ops[path].hook.path = path
    if ops:
        model.__dict__[REGISTRY] = ops
        _mark_readers(model, ops)
        _mark_heads(model)
        _guard(model).watch(model)
        _listen()
    return ops


def _shared_entries(model: nn.Module) -> Iterator[dict]:
    """The manifest's shared ops (``{"norm", "readers", "width"}``, one op after a norm for all its readers)."""
    for r in getattr(plan_of(model), "rotations", None) or []:
        yield from r.get("online_outputs", [])


def _mark_readers(model: nn.Module, ops: dict[str, HeldOp]) -> None:
    """Mark each Linear reader of a shared op that runs (:class:`SharedReader`), so that an adapter layer
    assigned in its place moves the op onto the readers first (:func:`_on_register`)."""
    for o in _shared_entries(model):
        if o["norm"] in ops:
            for path in o["readers"]:
                reader = _at(model, path)
                if reader is not None:
                    reader.__dict__[READER] = SharedReader(model, o["norm"])


class SharedReader:
    """On a Linear reader of an op shared after a norm: the model and the norm's path, so that the op can be
    split onto the readers (:func:`split_shared_op`) when an adapter wraps this reader. The model is held weakly
    (a reader does not keep a model alive); a deep copy of the model maps it to the copy, a copy of the reader
    alone keeps the original's model, and pickling keeps the model by reference."""

    def __init__(self, model: nn.Module, norm: str) -> None:
        self.model, self.norm = weakref.ref(model), norm

    def __deepcopy__(self, memo: dict) -> SharedReader:
        model = self.model()
        copy = SharedReader.__new__(SharedReader)
        copy.model = weakref.ref(memo.get(id(model), model)) if model is not None else self.model
        copy.norm = self.norm
        return copy

    def __getstate__(self) -> dict:
        return {"model": self.model(), "norm": self.norm}

    def __setstate__(self, state: dict) -> None:
        model = state["model"]
        self.model, self.norm = (weakref.ref(model) if model is not None else lambda: None), state["norm"]


def split_shared_op(model: nn.Module, norm: str) -> list[str]:
    """Move the online op shared after ``norm`` (a forward hook on the norm, each Linear reader's weight holding
    ``W·M``) onto each of its readers, as a pre-hook on that reader with the same values: the same function
    (each reader's weight holds the same ``M``), one transform per reader instead of one for all. The model's
    manifest (``plan.rotations``: the readers move from ``online_outputs`` to ``online``) and record follow, so a
    save writes, and a load puts back, one op per reader. Returns the readers' paths ([] where ``norm`` runs no
    shared op or a reader is missing; nothing changes then).

    Why: an adapter layer (PEFT) on one reader reads that reader's input; after a shared op that input is
    ``x·M``, so the adapter computes something else than on the model without ops, and an adapter trained there
    would be silently wrong. With the op on the reader, the adapter reads ``x``, as on a Linear that holds its
    own op, and :class:`MergeInOpBasis` merges it exactly."""
    held = held_ops(model).get(norm)
    entry = next((o for o in _shared_entries(model) if o["norm"] == norm), None)
    module = _at(model, norm)
    if held is None or entry is None or module is None or not holds_op(module) or not held.output:
        return []
    readers = [(p, _at(model, p)) for p in entry["readers"]]
    if any(m is None or holds_op(m) for _, m in readers):
        return []
    values = held.current()
    handle = module.__dict__.pop(HANDLE)
    handle.remove()
    for name in held.buffers:
        module._buffers.pop(name, None)
    for name in held.attrs:
        module.__dict__.pop(name, None)
    for _, reader in readers:
        reader.__dict__.pop(READER, None)
        _install(reader, HeldOp(output=False, hook=held.hook.as_input(), attrs=dict(held.attrs)),
                 {k: v.clone() for k, v in values.items()})
    plan = plan_of(model)
    plan.rotations = [{**r, "online_outputs": [o for o in r["online_outputs"] if o is not entry],
                       "online": sorted([*r.get("online", []), *entry["readers"]])}
                      if any(o is entry for o in r.get("online_outputs", [])) else r for r in plan.rotations]
    del model.__dict__[REGISTRY][norm]
    record(model)
    return [p for p, _ in readers]


# ------------------------------------------------------------- adapters on the per-head turn of the values
class HeadTurn:
    """On a value projection (``side="output"``) or attention output projection (``side="input"``) whose weight
    holds the per-head Hadamard ``H̃`` of an online conversion (``rotate(model, "none", online=True)``: the
    values' rows, the output projection's input columns, per head; no op runs): what an adapter there must turn
    so that it acts in the original model's basis. ``path``: the Linear's path in the model (for the refusal)."""

    def __init__(self, head_dim: int, side: str, path: str) -> None:
        self.head_dim, self.side, self.path = head_dim, side, path
        self._cache: dict = {}

    def matrix(self, like: torch.Tensor) -> torch.Tensor:
        """``H̃ = H/sqrt(head_dim)`` on ``like``'s device and dtype (cached; the same matrix the rotation
        folded: :func:`normswap.rotation.heads.head_turn`)."""
        key = (like.device, like.dtype)
        if key not in self._cache:
            self._cache[key] = head_turn(self.head_dim).to(device=like.device, dtype=like.dtype)
        return self._cache[key]

    def turn_delta(self, delta: torch.Tensor) -> torch.Tensor:
        """An adapter's weight update ``ΔW`` (``[out, in]``) as the turned weight holds it: rows per head times
        ``H̃`` (value projection), or columns (output projection); in float64, back in ``delta``'s dtype."""
        axis = 0 if self.side == "output" else 1
        d = delta.double()
        return turn_heads(d, axis, self.matrix(d)).to(delta.dtype)

    def __getstate__(self) -> dict:
        return {"head_dim": self.head_dim, "side": self.side, "path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["head_dim"], state["side"], state["path"])

    def __deepcopy__(self, memo: dict) -> HeadTurn:
        return HeadTurn(self.head_dim, self.side, self.path)


class _TurnHeadsHook:
    """Forward hook on an adapter's ``lora_B`` Linear (its output turned per head by ``H̃``: the value
    projection's side) or forward pre-hook on its ``lora_A`` Linear (its input turned back by ``H̃ᵀ``: the
    output projection reads the turned values)."""

    def __init__(self, turn: HeadTurn) -> None:
        self.turn = turn

    def __call__(self, module: nn.Module, args: tuple, *rest: Any) -> Any:
        if self.turn.side == "output":
            out = rest[0]
            return turn_heads(out, -1, self.turn.matrix(out))
        x = args[0]
        return (turn_heads(x, -1, self.turn.matrix(x).T), *args[1:])


def _turn_branch(linear: nn.Module, turn: HeadTurn) -> None:
    """Put the turn on one adapter branch Linear (``lora_B[name]`` or ``lora_A[name]``), once."""
    if not isinstance(linear, nn.Module) or linear.__dict__.get(HEAD_HOOK) is not None:
        return
    hook = _TurnHeadsHook(turn)
    linear.__dict__[HEAD_HOOK] = (linear.register_forward_hook(hook) if turn.side == "output"
                                  else linear.register_forward_pre_hook(hook))


class _Branch:
    """On a turned LoRA layer's ``lora_B`` (value projection) or ``lora_A`` (output projection) dictionary: the
    :class:`HeadTurn` and the layer (weakly; a deep copy's mark names the copy), so that an adapter added later
    (``add_adapter``: a new entry) is turned as it is assigned, or refused where its variant cannot be."""

    def __init__(self, turn: HeadTurn, layer: nn.Module) -> None:
        self.turn, self.layer = turn, weakref.ref(layer)

    def __deepcopy__(self, memo: dict) -> _Branch:
        layer = self.layer()
        return _Branch(HeadTurn(self.turn.head_dim, self.turn.side, self.turn.path), memo.get(id(layer), layer))

    def __getstate__(self) -> dict:
        return {"turn": self.turn, "layer": self.layer()}

    def __setstate__(self, state: dict) -> None:
        self.turn = state["turn"]
        layer = state["layer"]
        self.layer = weakref.ref(layer) if layer is not None else lambda: None


def _branch_refusal(branch: _Branch, name: str, new: Any) -> str | None:
    """Why a new entry ``name`` of a turned LoRA layer's branch dictionary cannot act in the original basis."""
    layer = branch.layer()
    if layer is not None and name in (getattr(layer, "lora_variant", None) or {}):
        variant = type(layer.lora_variant[name]).__name__
        return _refusal_line(layer, branch.turn, f"a LoRA variant ({variant}: DoRA's norm is taken per row of the "
                                                 "turned weight)")
    if branch.turn.side == "output" and getattr(new, "bias", None) is not None:
        return _refusal_line(layer, branch.turn, "a LoRA with lora_bias (its merge adds lora_B's bias unturned)")
    return None


def _mark_heads(model: nn.Module) -> None:
    """Mark the value and output projections whose weights hold the per-head ``H̃`` of a rotation (the
    manifest's ``value_heads`` without a learned R2), with :class:`HeadTurn`, so that an adapter layer assigned
    in their place acts in the original basis or is refused (:func:`_head_adapter`). Since round 56 also where
    the rotation turns a stream (recorded from round 56 on: ``adapter_bases``), whose ``Q`` the adapter bases
    map on the other side of those Linears; before, only a ``"none"`` rotation's."""
    default = None
    for r in getattr(plan_of(model), "rotations", None) or []:
        hd = r.get("head_dim")
        stream_unrecorded = r.get("kind") != "none" and not r.get("adapter_bases")
        if stream_unrecorded or r.get("learned_heads") or not isinstance(hd, int):
            continue
        default = default if default is not None else config_head_dim(model)
        for path in r.get("value_heads") or []:
            module = _at(model, path)
            pair = value_output(module, default) if module is not None else None
            if pair is None or pair[2] != hd:
                continue
            names = {id(m): n for n, m in module.named_modules()}
            for linear, side in ((pair[0], "output"), (pair[1], "input")):
                if HEADS not in linear.__dict__:
                    where = names.get(id(linear), "")
                    linear.__dict__[HEADS] = HeadTurn(hd, side, f"{path}.{where}" if path and where else path or where)


class TurnedHeadsDelta:
    """A LoHa / LoKr layer's ``get_delta_weight`` (an instance attribute in place of its class's) where its base
    Linear holds the per-head ``H̃``: their forward (``x·ΔWᵀ``) and merge both read this update, so turning it
    (:meth:`HeadTurn.turn_delta`) makes both act in the original model's basis."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, adapter: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _delta_as_held(self.layer, adapter, *args, **kwargs)


def _delta_as_held(layer: nn.Module, adapter: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """PEFT's weight update of ``adapter`` (its class's ``get_delta_weight``) as the base Linear's weight holds
    the original's: turned by the per-head ``H̃`` where the Linear holds it (:class:`HeadTurn`, rows or columns per
    head), then by the conversion's folds where it has an :class:`AdapterBasis` (γ in the columns, a writer's
    centered, scaled rows, a rotated stream's ``Q``)."""
    delta = type(layer).get_delta_weight(layer, adapter, *args, **kwargs)
    base = layer.get_base_layer()
    turn, basis = base.__dict__.get(HEADS), base.__dict__.get(BASIS)
    delta = turn.turn_delta(delta) if turn is not None else delta
    return basis.turn_delta(delta, _input_axis(base)) if basis is not None else delta


def _peft_classes(layer: nn.Module) -> set[str]:
    return {c.__name__ for c in type(layer).__mro__ if c.__module__.startswith("peft.")}


def _head_refusal(layer: nn.Module, turn: HeadTurn) -> str | None:
    """Why the adapter layer ``layer`` (wrapping a Linear marked with ``turn``) cannot act in the original
    model's basis there (one line), or None where it can (LoRA without a variant or, on the value projection,
    a bias; LoHa; LoKr; IA3 scaling the output projection's output; a wrapper that is not PEFT's)."""
    names = _peft_classes(layer)
    what = None
    if not names:  # not PEFT's: a wrapper normswap knows nothing of is left alone (as before round 54)
        return None
    if "AdaLoraLayer" in names:
        what = "AdaLoRA (its forward reads its matrices, not its branch Linears)"
    elif "LoraLayer" in names:
        if any(getattr(layer, "lora_variant", None) or {}):
            variant = type(next(iter(layer.lora_variant.values()))).__name__
            what = f"a LoRA variant ({variant}: DoRA's norm is taken per row of the turned weight)"
        elif turn.side == "output" and any((getattr(layer, "lora_bias", None) or {}).values()):
            what = "a LoRA with lora_bias (its merge adds lora_B's bias unturned)"
    elif "LycorisLayer" in names:
        if not names & {"LoHaLayer", "LoKrLayer"}:
            what = "this adapter type"
    elif "IA3Layer" in names:
        if turn.side == "output" or getattr(layer, "is_feedforward", False):
            what = "IA3 scaling the turned values (a per-feature scale does not commute with the turn)"
    else:
        what = "this adapter type"
    return None if what is None else _refusal_line(layer, turn, what)


def _adapter_named(layer: nn.Module | None) -> str:
    """``a PEFT <tuner> adapter (<class>)``: how a refusal names the adapter layer ``layer``."""
    parts = type(layer).__module__.split(".") if layer is not None else []
    tuner = parts[2] if len(parts) > 2 and parts[:2] == ["peft", "tuners"] else type(layer).__module__
    return f"a PEFT {tuner} adapter ({type(layer).__name__})"


def _refusal_line(layer: nn.Module | None, turn: HeadTurn, what: str) -> str:
    """The one line refusing an adapter on a Linear that holds the per-head ``H̃`` (``what``: why)."""
    return (f"{_adapter_named(layer)} on `{turn.path}` is refused: that Linear's weight holds "
            f"the per-head Hadamard of the values (rotate(..., online=True)), and {what} cannot act there in the "
            "original model's basis; use LoRA, LoHa or LoKr on it, or leave it out of target_modules")


def _head_adapter(layer: nn.Module, turn: HeadTurn) -> None:
    """Make the adapter layer ``layer`` (PEFT's, assigned in place of a Linear marked with ``turn``) act in the
    original model's basis: LoRA's branch Linears turned by hooks (``lora_B``'s output on the value projection,
    ``lora_A``'s input on the output projection; its ``lora_B`` / ``lora_A`` dictionaries marked, so an adapter
    added later is turned as it is assigned), its merge through :class:`MergeInOpBasis`; LoHa's and LoKr's update
    turned (:class:`TurnedHeadsDelta`). IA3 on the output projection's output needs nothing."""
    names = _peft_classes(layer)
    if "LoraLayer" in names:
        branches = layer.lora_B if turn.side == "output" else layer.lora_A
        branches.__dict__[HEADS] = _Branch(turn, layer)
        for linear in branches.values():
            _turn_branch(linear, turn)
    elif "LycorisLayer" in names:
        layer.__dict__["get_delta_weight"] = TurnedHeadsDelta(layer)
    if _family(layer) == "delta":
        layer.__dict__["merge"] = MergeInOpBasis(layer, "merge")
        layer.__dict__["unmerge"] = MergeInOpBasis(layer, "unmerge")


def _at(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _expected(model: nn.Module) -> list[str]:
    """The paths that must run an op: the recorded ones and the manifest's (``plan.rotations``), where they
    exist in this model (a head another class lacks is not there)."""
    paths = set(held_ops(model))
    plan = plan_of(model)
    for r in getattr(plan, "rotations", None) or []:
        paths.update(r.get("online", []))
        paths.update(o["norm"] for o in r.get("online_outputs", []))
    return sorted(p for p in paths if _at(model, p) is not None)


def missing_online_ops(model: nn.Module) -> list[str]:
    """Paths of the modules that should run an online Hadamard (their weight holds its transpose) and do not."""
    ops = held_ops(model)
    return [p for p in _expected(model) if not _runs_op(model.get_submodule(p), ops.get(p))]


def lost_line(path: str, module: nn.Module) -> str:
    """The refusal's one line for ``module`` at ``path`` (the model's, the op's own, a swapped module's)."""
    return (f"`{path}` ({type(module).__name__}) has lost its online Hadamard: its weight was turned for the op, so "
            "the model would compute wrong outputs (a module swap, e.g. by a quantization engine, drops the op); "
            "call normswap.rotation.carry.carry_online_ops(model) after replacing modules")


def check_online_ops(model: nn.Module) -> None:
    """Raise :class:`normswap.errors.NormswapError` (one line naming the first module) when a module that should
    run an online Hadamard does not; return quietly otherwise, and for a model without online ops. Each module
    found without its op is also made to refuse its own calls (:class:`Refuse`), so that calling a submodule
    directly, past the model's guard, is refused too until the ops are carried back."""
    missing = missing_online_ops(model)
    if missing:
        ops = held_ops(model)
        for path in missing:
            Refuse.arm(model.get_submodule(path), path, ops.get(path))
        more = f" ({len(missing) - 1} other module(s) too)" if len(missing) > 1 else ""
        raise NormswapError(lost_line(missing[0], model.get_submodule(missing[0])) + more)


class Refuse:
    """Forward pre-hook on a module that sits where an online op should run and does not (an engine's module
    swapped in by ``setattr``, seen as it happens; or one the full check found): its own calls refuse, in
    :func:`check_online_ops`'s line, so that a submodule called directly (``model.encoder.layer[3](x)``, or
    ``generate`` calling the encoder), which the model's guard never sees, is refused too. Nothing runs per call
    on a model nobody swapped; once the op is back (:func:`carry_online_ops` removes this hook) or the module
    runs it otherwise, the hook removes itself."""

    def __init__(self, path: str, held: HeldOp | None = None) -> None:
        self.path, self.held = path, held

    @classmethod
    def arm(cls, module: nn.Module, path: str, held: HeldOp | None = None) -> None:
        """Put the refusal on ``module`` (first among its pre-hooks; once); ``held``: the op it should run."""
        if not any(isinstance(h, cls) for h in module._forward_pre_hooks.values()):
            module.register_forward_pre_hook(cls(path, held), prepend=True)

    @classmethod
    def disarm(cls, module: nn.Module) -> None:
        """Take the refusal off ``module`` (where it has one)."""
        for key in [k for k, h in module._forward_pre_hooks.items() if isinstance(h, cls)]:
            del module._forward_pre_hooks[key]

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if _runs_op(module, self.held):
            Refuse.disarm(module)
            return
        raise NormswapError(lost_line(self.path, module))


def _device_of(module: nn.Module) -> torch.device | None:
    t = next((t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
              if t.device.type != "meta"), None)
    if t is None:
        t = next((t for t in (*module.parameters(), *module.buffers()) if t.device.type != "meta"), None)
    return t.device if t is not None else None


def _install(module: nn.Module, held: HeldOp, values: dict[str, torch.Tensor]) -> None:
    """``held`` on ``module``: its buffers (``values``, on the module's device), attributes and hook."""
    device = _device_of(module)
    Refuse.disarm(module)
    for key in _registered(module, held):  # copied by the engine without what it reads: once, from here
        for d in (module._forward_pre_hooks, module._forward_hooks):
            d.pop(key, None)
        module._forward_pre_hooks_with_kwargs.pop(key, None)
        module._forward_hooks_with_kwargs.pop(key, None)
    for name, value in values.items():
        module.register_buffer(name, value.to(device) if device is not None else value)
    for key, value in held.attrs.items():
        setattr(module, key, value)
    if held.output:
        handle = module.register_forward_hook(held.hook, with_kwargs=held.with_kwargs)
    else:
        handle = module.register_forward_pre_hook(held.hook, with_kwargs=held.with_kwargs)
    module.__dict__[HANDLE] = handle


def carry_online_ops(model: nn.Module, values: Callable[[str, HeldOp], dict[str, torch.Tensor] | None]
                     | None = None) -> list[str]:
    """Put every recorded online Hadamard back on the module now at its path, where that module lost it (an
    engine replaced the Linear); returns the paths carried. Exact: the op and its values are the ones recorded,
    and the engine's module computes the Linear the op was made for.

    Call it after replacing ``nn.Linear`` modules of a model with online Hadamards (``quanto.quantize``,
    bitsandbytes' or HQQ's own replacement functions, any module swap); loading a native checkpoint with a
    ``quantization_config`` calls it itself. A module that runs the op already (itself, or a wrapper around the
    original Linear) is left alone, so calling it twice is harmless.

    Args:
        model: the model the ops were recorded on (by the rotation or the loader).
        values: for the loader: ``(path, held) -> {buffer: value}`` where the recorded buffers hold no values
            (they were created on the meta device and the swap left them nothing to load into); None: the
            recorded values.

    Raises:
        NormswapError: an op whose values are not known (not loaded, and ``values`` has none); nothing is
            changed then. After carrying, any module that should run an op and still does not (one never
            recorded) is refused as :func:`check_online_ops` does.
    """
    ops = held_ops(model)
    todo = []
    for path, held in ops.items():
        module = _at(model, path)
        if module is None or _runs_op(module, held):
            continue
        now = held.current()  # as the model holds them now: after .float() / .half() / .to(), in that dtype
        vals = now
        if any(v.device.type == "meta" for v in vals.values()):
            vals = (values(path, held) if values is not None else None) or {}
            if set(vals) != set(held.buffers) or any(v.device.type == "meta" for v in vals.values()):
                raise NormswapError(f"`{path}` ({type(module).__name__}) lost its online Hadamard and the op's values "
                                    "were never loaded, so it cannot be put back; load the checkpoint again and "
                                    "replace modules after loading")
            # stored values in the dtype the model was built in (a float64 checkpoint loaded as float32)
            vals = {k: v.to(now[k].dtype) if v.is_floating_point() and now[k].is_floating_point() else v
                    for k, v in vals.items()}
        todo.append((path, module, held, vals))
    for _, module, held, vals in todo:
        _install(module, held, vals)
    carried = [path for path, *_ in todo]
    if carried:
        record(model)
    check_online_ops(model)
    if ops:
        _guard(model).watch(model)  # the modules that hold the ops now
    return carried


def after_load(model: nn.Module, files: Callable[[], Iterable[str]]) -> list[str]:
    """The loader's step once the weights are in: ops a ``quantization_config`` swapped away are put back with
    their values read from the checkpoint's safetensors ``files()`` (only when some op is missing; the
    files are not opened otherwise), the record takes the loaded values, and the model is checked. Returns the
    paths carried."""
    ops = held_ops(model)
    if not ops:
        return []
    carried: list[str] = []
    if any(_at(model, p) is not None and not _runs_op(_at(model, p), held) for p, held in ops.items()):
        stored = _StoredValues(model, files)
        carried = carry_online_ops(model, stored)
    record(model)  # the loaded values replace the meta ones
    check_online_ops(model)
    return carried


class _StoredValues:
    """``(path, held) -> {buffer: tensor}`` read from safetensors files, by the model's key names (with or
    without its base-model prefix, as transformers matches them)."""

    def __init__(self, model: nn.Module, files: Callable[[], Iterable[str]]) -> None:
        self.prefix = getattr(model, "base_model_prefix", "") or ""
        self.files = files
        self.index: dict[str, str] | None = None

    def __call__(self, path: str, held: HeldOp) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        if self.index is None:
            self.index = {}
            for f in self.files():
                with safe_open(str(f), framework="pt") as fh:
                    self.index.update(dict.fromkeys(fh.keys(), str(f)))
        out = {}
        for name in held.buffers:
            key = f"{path}.{name}" if path else name
            for k in (key, key.removeprefix(self.prefix + "."), f"{self.prefix}.{key}"):
                if k in self.index:
                    with safe_open(self.index[k], framework="pt") as fh:
                        out[name] = fh.get_tensor(k)
                    break
        return out


# ------------------------------------------------------------------------------ the guard at every call
_WATCHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module with a plain _modules -> its guards
_GUARDS: weakref.WeakSet = weakref.WeakSet()  # guards holding watched `_modules` weakly (swept as Dynamo compiles)
OWNED = "_modules"  # round 54's slot entry (owner.__dict__, OWNED, its WatchedModules, ...), in older pickles
HOOK_SLOTS = ("_forward_pre_hooks", "_forward_hooks")  # an op module's hook dictionaries, by their __dict__ slot
LAYOUT = 55  # OpsGuard's state layout: watched `_modules` held weakly, the op's hook dictionary's slot checked


class WatchedModules(dict):
    """A module's ``_modules`` dictionary that tells the guards watching one of its entries (:class:`OpsGuard`)
    of every write, as it happens: ``setattr`` / ``set_submodule`` / ``add_module`` (which write into it) and a
    write straight into it (``parent._modules[name] = new``, ``.update``, ``.setdefault``), which no torch hook
    sees. Put in place of a plain ``dict`` on each module on the way to an op's module (the model, a layer, the
    MLP that holds the op's Linear) when the guard starts to watch it (:meth:`on`), so that no edge on the way is
    compared at the call. The guard holds it weakly: replaced as a whole (``mlp._modules = {...}``, ``del
    layers[0]``, which rebuilds the list's), it is freed and the guard is told (:meth:`OpsGuard._freed`). Reads are
    the ``dict``'s own (no method of its reading side is overridden), but CPython's specialised ``dict[key]`` takes
    exact dicts only, so a submodule read on a watched module costs a little more
    (``benchmarks/watched_modules_read.py``). A copy (``copy.deepcopy``, pickle) is a ``WatchedModules`` too, whose
    guard is the copy's."""

    __slots__ = ("guards", "__weakref__")  # the guards watching an entry of this dictionary (weakly: a WeakSet)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        dict.__init__(self, *args, **kwargs)
        self.guards: weakref.WeakSet = weakref.WeakSet()

    def __reduce_ex__(self, protocol: Any) -> tuple:
        """Copied and pickled with its entries, not its guards (a copy's guard adds itself)."""
        return WatchedModules, (), None, None, iter(self.items())

    @classmethod
    def on(cls, module: nn.Module) -> WatchedModules:
        """``module``'s ``_modules``, made a :class:`WatchedModules` (same entries, same order) where it is not."""
        d = module.__dict__["_modules"]
        if type(d) is not cls and not any(m is module for m in _ASSIGNING):
            d = module.__dict__["_modules"] = cls(d)
        return d

    def __setitem__(self, name: str, new: Any) -> None:
        for guard in list(self.guards):
            guard.replaced(self, name, new)
        dict.__setitem__(self, name, new)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """``dict.update``, one :meth:`__setitem__` per entry."""
        for name, new in dict(*args, **kwargs).items():
            self[name] = new

    def __ior__(self, other: Any) -> WatchedModules:  # type: ignore[override]
        self.update(other)
        return self

    def setdefault(self, name: str, default: Any = None) -> Any:
        """``dict.setdefault`` through :meth:`__setitem__`."""
        if name not in self:
            self[name] = default
        return self[name]


def _target(entry: tuple) -> Any:
    """The dictionary an :class:`OpsGuard` entry reads (a watched ``_modules`` is held weakly: None once freed)."""
    d = entry[0]
    return d() if isinstance(d, weakref.ref) else d


class OpsGuard:
    """Forward pre-hook on the model (one, registered first by :func:`record`): before each call, whether every
    module that runs an online op still runs it, where the model's modules lead. A swap (``setattr`` or a write
    into ``_modules``, with or without another reference to the old module), a ``_modules`` replaced whole, a deep
    copy (the copy's guard watches the copy's modules: ``copy.deepcopy`` maps them), a trace by ``torch.compile``
    (Dynamo evaluates the comparison while tracing, as a constant since round 65, and guards on the flag, the
    layout's version and each op module's hook dictionary by id and length, so an edit after compiling
    recompiles) and an
    op's hook removed from a module that stays (``handle.remove()``, ``_forward_pre_hooks.clear()``, the hook
    dictionary replaced whole) all meet it.

    Per call: one tuple of ``dict.get`` over the checked entries (per op: its entry in its module's hook
    dictionary, and the slot in the module's ``__dict__`` that holds that dictionary), compared by identity with
    the hooks and dictionaries recorded, in C, and one flag. The ``_modules`` on the way to each op (the model, a
    layer, the MLP holding the op's Linear) are :class:`WatchedModules`, which tell the guard of each write as it
    happens (:meth:`replaced`; torch's ``setattr`` / ``set_submodule`` / ``add_module`` write into them too), and
    are held weakly, so one replaced whole is seen as it is freed (:meth:`_freed`): a replacement that drops an op
    sets the flag, so the next call runs the full check, and makes the new module at the op's path refuse its own
    calls (:class:`Refuse`), for calls of a submodule that skip this hook. (A ``_modules`` that cannot be watched,
    the one torch is writing into while a shared op is split, is compared at every call instead, its ``setattr``
    told by torch's module-registration hook.) A changed entry or the flag runs :func:`check_online_ops` (raise,
    one line, before the model runs) and, where the ops still run (a wrapper that calls the original module, as
    PEFT's LoRA layers do), watches the new structure."""

    def __init__(self) -> None:
        self.entries: list[tuple] = []  # (dict or weak ref, key, what is there, owner, path, checked at every call)
        self.dicts: tuple[dict, ...] = ()  # the checked entries: their dictionaries, keys and recorded values
        self.names: tuple[Any, ...] = ()
        self.modules: tuple[Any, ...] = ()
        self.dirty = False  # a watched module on the way to an op was replaced without it: check at the next call
        self.version = 0  # bumped by _set: a compiled call guards on it (an int reached by one path)

    def __getstate__(self) -> dict:
        """Entries with their dictionaries (not weak references: a copy maps them to its own), no derived tuples."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("dicts", "names", "modules", "slots", "loose")}
        # a slot entry is read again from its owner's __dict__ (a module's own __getstate__ may differ from it)
        state["entries"] = [(None if e[1] in HOOK_SLOTS else _target(e), *e[1:]) for e in self.entries
                            if _target(e) is not None]
        state["dirty"] = self.dirty or len(state["entries"]) < len(self.entries)
        state["layout"] = LAYOUT
        return state

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy``, pickle) watches its own modules, and is told of assignments to them."""
        state = dict(state)
        layout = state.pop("layout", None)
        self.__dict__.update(state)
        if layout == LAYOUT:
            entries = []
            for e in self.entries:
                if e[1] in HOOK_SLOTS:  # a slot reads the owner's own __dict__ (a copy's module was given a new one)
                    entries.append((e[3].__dict__, *e[1:]))
                elif isinstance(e[0], dict) and e[0] is e[3].__dict__.get("_modules"):  # an edge: weak where watched
                    entries.append(self._edge(e[0], *e[1:5]))
                else:  # an op's hook entry
                    entries.append(e)
            self._set(entries)
            _listen()
            return
        # pickled before round 55: told of writes as it was, and the next call checks and watches the round-55 way
        if "entries" not in state:  # pickled in round 51: every edge checked
            self.entries = [(d, n, m, o, "", True) for d, n, m, o in zip(
                state.get("dicts", ()), state.get("names", ()), state.get("modules", ()), state.get("owners", ()),
                strict=False)]
        self._set([(e[3].__dict__, *e[1:]) if e[1] == OWNED else e for e in self.entries])
        for entry in self.entries:
            if isinstance(entry[0], WatchedModules):
                entry[0].guards.add(self)
            elif entry[0] is entry[3].__dict__.get("_modules"):
                _WATCHERS.setdefault(entry[3], weakref.WeakSet()).add(self)
        self.dirty = True
        _listen()  # a model unpickled in a process that recorded none

    def _set(self, entries: list[tuple]) -> None:
        self.entries = entries
        self.version = getattr(self, "version", 0) + 1  # what a compiled call guards on (an int, one path)
        checked = [e for e in entries if e[5]]
        self.dicts, self.names, self.modules = (tuple(e[i] for e in checked) for i in range(3))
        # what a compiled call reads (:meth:`__call__`): per op module, its hook dictionary by its slot in the
        # module's __dict__, compared by id, and the op's keys in it (no hook and no hook dictionary held a second
        # time, so Dynamo reaches each by one path); any other checked entry by its key
        slots = [e for e in checked if e[1] in HOOK_SLOTS]
        under = {id(e[2]) for e in slots}
        self.slots = tuple((e[0], e[1], id(e[2]), len(e[2])) for e in slots)
        self.loose = tuple((e[0], e[1]) for e in checked if e[1] not in HOOK_SLOTS and id(e[0]) not in under)

    def _edge(self, d: dict, name: str, child: Any, owner: nn.Module, at: str) -> tuple:
        """The entry for ``d[name]`` (``d``: ``owner``'s ``_modules``): a watched one held weakly and told of
        writes, not checked at the call; a plain one (not watched yet) checked at every call, its ``setattr``
        told by torch's registration hook."""
        if type(d) is WatchedModules:
            d.guards.add(self)
            _GUARDS.add(self)
            return (weakref.ref(d, self._freed), name, child, owner, at, False)
        _WATCHERS.setdefault(owner, weakref.WeakSet()).add(self)
        return (d, name, child, owner, at, True)

    def watch(self, model: nn.Module) -> None:
        """Watch the edges from ``model`` to each module that runs an op now (at an op's path, or inside the
        wrapper now there), and each op's hook entry."""
        self._set([])
        self.dirty = False
        ops = held_ops(model)
        for path in _expected(model):
            module = model.get_submodule(path)
            running = _running_in(module, ops.get(path))
            if not running:  # an op missing already: every call takes the check, which refuses
                self._set([({}, "", model, model, "", True)])
                return
            for sub in running:
                self._add(model, f"{path}.{sub}" if path and sub else path or sub, "", ops.get(path))

    def _add(self, owner: nn.Module, path: str, prefix: str, held: HeldOp | None = None) -> None:
        """Watch the edges from ``owner`` (at ``prefix`` in the model) down ``path`` (those not watched yet; each
        ``_modules`` on the way made a :class:`WatchedModules`), and the op's hook entry in the module that runs
        it, with the slot holding that hook dictionary, at every call."""
        entries = list(self.entries)
        where = {(id(_target(e)), e[1]): i for i, e in enumerate(entries)}
        at = prefix
        for part in path.split(".") if path else []:
            d = owner.__dict__["_modules"]
            if type(d) is not WatchedModules:
                watched = WatchedModules.on(owner)
                if watched is not d:  # entries already taken from the plain dict now watch the new one
                    entries = [self._edge(watched, *e[1:5]) if e[0] is d else e for e in entries]
                    where = {(id(_target(e)), e[1]): i for i, e in enumerate(entries)}
                    d = watched
            child = d[part]
            at = f"{at}.{part}" if at else part
            if (id(d), part) not in where:
                where[(id(d), part)] = len(entries)
                entries.append(self._edge(d, part, child, owner, at))
            owner = child
        hook = _hook_entry(owner, held)
        if hook is not None and (id(hook[0]), hook[1]) not in where:
            entries.append((*hook, owner, at, True))
            slot = next((s for s in HOOK_SLOTS if owner.__dict__.get(s) is hook[0]), None)
            if slot is not None and (id(owner.__dict__), slot) not in where:  # the hook dictionary replaced whole
                where[(id(owner.__dict__), slot)] = len(entries)
                entries.append((owner.__dict__, slot, hook[0], owner, at, True))
        self._set(entries)

    def _arm(self, old: nn.Module, new: Any, path: str) -> bool:
        """Where ``new`` (now at ``path``, in place of ``old``) lacks a module of ``old`` that ran an op: make the
        module at that op's path in ``new`` refuse its own calls (where it does not run the op) and return True."""
        inside = {id(m) for m in new.modules()} if isinstance(new, nn.Module) else set()
        holders = [(sub, m) for sub, m in old.named_modules() if holds_op(m)] if isinstance(old, nn.Module) else []
        if all(id(m) in inside for _, m in holders):
            return False
        for sub, m in holders:
            target = _at(new, sub) if id(m) not in inside and isinstance(new, nn.Module) else None
            held = _held(m)  # its op, as another module may run it (a hook object carried over by other code)
            if target is not None and not _runs_op(target, held):
                Refuse.arm(target, f"{path}.{sub}" if sub else path, held)
        return True

    def replaced(self, d: dict, name: str, new: nn.Module) -> None:
        """``parent.name = new`` on a watched edge, as it happens: where ``new`` holds every op module that was at
        or under the old one (PEFT wrapping a Linear as its ``base_layer``, or unloading it back), ``new`` is
        watched in place of the old module, so the next call, eager or traced by
        ``torch.compile(fullgraph=True)``, finds nothing changed. Otherwise the next call runs the full check (which
        refuses), and each module of ``new`` at an op's path that does not run the op refuses its own calls."""
        i = next((i for i, e in enumerate(self.entries) if e[1] == name and _target(e) is d), None)
        if i is None or not isinstance(new, nn.Module):
            return
        old = self.entries[i][2]
        if not any(holds_op(m) for m in old.modules()):
            return
        path = self.entries[i][4]
        if self._arm(old, new, path):
            self.dirty = True
            return
        inside = {id(m) for m in new.modules()}
        gone = {id(m) for m in old.modules()} - inside  # a wrapper unloaded: stop watching (and holding) it
        entries = list(self.entries)
        entries[i] = (*entries[i][:2], new, *entries[i][3:])
        self._set([e for e in entries if id(e[3]) not in gone])
        for sub in _running_in(new):
            self._add(new, sub, path)

    def _freed(self, ref: weakref.ref) -> None:
        """A watched ``_modules`` was freed: replaced whole (``mlp._modules = {...}``, ``del layers[0]``), or its
        owner is gone. The next call runs the full check (and watches the new dictionary), and a module now at an
        op's path that does not run the op refuses its own calls at once (a direct call of the MLP, say)."""
        try:
            self.dirty = True
            for e in self.entries:
                if e[0] is ref:
                    now = e[3].__dict__.get("_modules")
                    new = now.get(e[1]) if isinstance(now, dict) else None
                    if new is not e[2]:
                        self._arm(e[2], new, e[4])
        except Exception:  # noqa: BLE001 - a weakref callback (during a store, or a collection) must not raise
            self.dirty = True

    def sweep(self) -> None:
        """Treat each watched ``_modules`` that its owner no longer holds as freed (:meth:`_freed`), whether or not
        it is: run by :func:`_sweep` as ``torch.compile`` starts a compilation (not at the call)."""
        try:
            for e in list(self.entries):
                if isinstance(e[0], weakref.ref) and e[3].__dict__.get("_modules") is not e[0]():
                    self._freed(e[0])
        except Exception:  # noqa: BLE001 - a compile callback must not break the compilation
            self.dirty = True

    def _compiled_keys(self) -> bool:
        """What Dynamo guards on for a compiled call (traced, always True where :meth:`intact` is): each op
        module's hook dictionary still the one recorded (by id) and holding the op's keys, any other checked entry's
        key present. A hook removed or a hook dictionary replaced after compiling then recompiles, and the
        recompilation's trace refuses."""
        for owner, slot, kept, count in self.slots:
            hooks = dict.get(owner, slot)
            if id(hooks) != kept or len(hooks) != count:
                return False
        return all(k in d for d, k in self.loose)

    def intact(self) -> bool:
        """Whether nothing the guard watches changed since it last watched: one tuple of ``dict.get`` compared by
        identity with what was recorded, and the flag."""
        return not self.dirty and tuple(map(dict.get, self.dicts, self.names)) == self.modules

    def __call__(self, model: nn.Module, args: tuple) -> None:
        if is_dynamo_compiling():  # (False in eager: one call, ~50 ns)
            # Traced by Dynamo: the comparison runs as Python at trace time (:func:`_intact`, a constant to Dynamo),
            # so none of the guard's references (the hook dictionaries and hooks the model's own modules lead to as
            # well) is wrapped a second time, which made Dynamo build a Python object-aliasing guard per op
            # (``benchmarks/compile_guard_cost.py``). The compiled call stays guarded by what Dynamo reads of the
            # model itself plus the guard's flag and layout version.
            # (``self.version < 0`` is never true: reading the version is what makes Dynamo guard on it)
            if self.dirty or self.version < 0 or not _intact(self) or not self._compiled_keys():
                check_online_ops(model)
                self.watch(model)
            return
        # intact(), inlined: an eager call pays no extra method call
        if self.dirty or tuple(map(dict.get, self.dicts, self.names)) != self.modules:
            check_online_ops(model)
            self.watch(model)


@torch.compiler.assume_constant_result
def _intact(guard: OpsGuard) -> bool:
    """:meth:`OpsGuard.intact`, evaluated by Dynamo at trace time as a constant (not traced)."""
    return guard.intact()


def _hook_entry(module: nn.Module, held: HeldOp | None = None) -> tuple[dict, int, Callable] | None:
    """``(hook dictionary, key, hook)`` of the op ``module`` runs itself: its handle's entry, else (a hook
    carried by other code) the entry holding ``held``'s hook object; None where it runs none itself."""
    handle = module.__dict__.get(HANDLE)
    for d in (module._forward_pre_hooks, module._forward_hooks):
        if handle is not None and handle.id in d:
            return d, handle.id, d[handle.id]
    for d in (module._forward_pre_hooks, module._forward_hooks) if held is not None else ():
        for key, hook in d.items():
            if hook is held.hook:
                return d, key, hook
    return None


def _guard(model: nn.Module) -> OpsGuard:
    """``model``'s guard, registered (first among its pre-hooks) when it has none."""
    for hook in model._forward_pre_hooks.values():
        if isinstance(hook, OpsGuard):
            return hook
    guard = OpsGuard()
    model.register_forward_pre_hook(guard, prepend=True)
    return guard


# ------------------------------------------------------------------------------ PEFT adapters on an op's Linear
_LISTENER: list = []  # the process's module-registration hook, registered once by record()
_ASSIGNING: list = []  # the module torch is assigning a submodule into, while _on_register splits a shared op


def _listen() -> None:
    """Register :func:`_on_register` (once per process) with torch's global module-registration hooks, and
    :func:`_sweep` with Dynamo's compile-start callbacks (again after ``torch._dynamo.reset()``, which clears
    them)."""
    if not _LISTENER:
        _LISTENER.append(nn.modules.module.register_module_module_registration_hook(_on_register))
    try:
        import torch._dynamo as dynamo

        if _sweep not in dynamo.callback_handler.start_callbacks:
            dynamo.callback_handler.register_start_callback(_sweep)
    except Exception:  # noqa: BLE001 - a torch without Dynamo's callbacks: the weak references alone
        return


def _sweep(*args: Any) -> None:
    """At the start of each ``torch.compile`` compilation: each live guard compares the slots of its watched
    ``_modules`` (:meth:`OpsGuard.sweep`), since the trace that compiled the model before may keep a replaced
    dictionary alive (in reference cycles, until the collector runs), and a recompilation after such a replacement
    must trace the full check."""
    for guard in list(_GUARDS):
        guard.sweep()


def _on_register(parent: nn.Module, name: str, new: Any) -> None:
    """Called by torch for every submodule assignment: where an adapter layer (PEFT's: a ``base_layer`` and a
    ``merge``) replaces a Linear that runs an online op around that very Linear, its ``merge`` / ``unmerge``
    become :class:`MergeInOpBasis`, so that PEFT's ``merge`` / ``merge_and_unload`` / ``unmerge`` stay exact (or
    refuse). Where the assignment replaces a module an :class:`OpsGuard` watches, the guard is told
    (:meth:`OpsGuard.replaced`). Where it replaces a value or output projection that holds the per-head ``H̃``
    (:class:`HeadTurn`), the adapter is made to act in the original basis (:func:`_head_adapter`), or refused
    (:class:`normswap.errors.NormswapError`, one line, before anything changes: the only exception this raises).
    Costs a few dict lookups per assignment elsewhere."""
    turn = _head_turn_of(parent, name, new)
    basis = _basis_of(parent, name, new)
    branch = parent.__dict__.get(HEADS) if isinstance(parent, nn.ModuleDict) else None
    on_basis = parent.__dict__.get(BASIS) if isinstance(parent, nn.ModuleDict) else None
    why = _head_refusal(new, turn) if turn is not None else _branch_refusal(branch, name, new) if branch else None
    why = why or (_basis_refusal(new, basis) if basis is not None else None)
    if why is None and on_basis is not None:
        layer = on_basis.layer()
        if layer is not None and name in (getattr(layer, "lora_variant", None) or {}):
            why = _basis_line(layer, on_basis.basis, "a LoRA variant (its norm is taken per row of the edited weight)")
    if why is not None:
        raise NormswapError(why)
    try:
        _on_register_ops(parent, name, new)
        if turn is not None:
            _head_adapter(new, turn)
        if basis is not None:
            _basis_adapter(new, basis)
        if branch is not None:  # an adapter added later to a turned LoRA layer (its lora_B / lora_A entry)
            _turn_branch(new, branch.turn)
        if on_basis is not None:  # an adapter added later to a LoRA layer on an edited Linear
            _basis_branch(new, on_basis.basis, on_basis.side)
    except Exception:  # noqa: BLE001 - a hook inside every module assignment must never break one
        return None
    return None


def _head_turn_of(parent: nn.Module, name: str, new: Any) -> HeadTurn | None:
    """The :class:`HeadTurn` of the Linear an adapter layer ``new`` replaces at ``parent.name`` (None elsewhere)."""
    return _replaced_mark(parent, name, new, HEADS)


def _replaced_mark(parent: nn.Module, name: str, new: Any, key: str) -> Any:
    """The mark ``key`` in the ``__dict__`` of the Linear that ``new``, a layer wrapping it as its
    ``base_layer``, replaces at ``parent.name`` (None elsewhere)."""
    try:
        old = parent.__dict__["_modules"].get(name)
        if old is None or old is new or not isinstance(new, nn.Module):
            return None
        mark = old.__dict__.get(key)
        return mark if mark is not None and new.__dict__["_modules"].get("base_layer") is old else None
    except Exception:  # noqa: BLE001 - never break an assignment it has nothing to say about
        return None


def _on_register_ops(parent: nn.Module, name: str, new: Any) -> None:
    """:func:`_on_register`'s part for online ops: guards told, a shared op split, merges turned."""
    d = parent.__dict__["_modules"]
    if type(d) is not WatchedModules:  # (a WatchedModules tells its guards itself, as the write happens)
        for guard in list(_WATCHERS.get(parent, ())):
            guard.replaced(d, name, new)
    old = d.get(name)
    if old is None or old is new or not isinstance(new, nn.Module):
        return None
    if new.__dict__["_modules"].get("base_layer") is not old or not callable(getattr(type(new), "merge", None)):
        return None
    shared = old.__dict__.get(READER)
    model = shared.model() if shared is not None else None
    if model is not None and not holds_op(old):  # an adapter on a reader of a shared op: one op per reader
        _ASSIGNING.append(parent)  # its `_modules` stays as it is: torch writes `new` into that very dict
        try:
            if split_shared_op(model, shared.norm):
                _guard(model).replaced(d, name, new)
        finally:
            _ASSIGNING.pop()
    if not holds_op(old):
        return None
    if old.__dict__[HANDLE].id not in old._forward_pre_hooks:  # an op on the output (a norm's): not an input
        return None
    new.__dict__["merge"] = MergeInOpBasis(new, "merge")
    new.__dict__["unmerge"] = MergeInOpBasis(new, "unmerge")
    return None


def _family(layer: nn.Module) -> str | None:
    """How a PEFT adapter layer merges: ``"delta"`` (LoRA and its kin, LoHa, LoKr: the weight plus
    ``get_delta_weight``), ``"ia3"`` (the weight times a per-feature scale), None (another family)."""
    names = {c.__name__ for c in type(layer).__mro__ if c.__module__.startswith("peft.")}
    if names & {"LoraLayer", "LycorisLayer"}:
        return "delta"
    return "ia3" if "IA3Layer" in names else None


class MergeInOpBasis:
    """An adapter layer's ``merge`` or ``unmerge`` (an instance attribute in place of its class's) where the
    Linear it wraps (``base_layer``) runs an online op before itself: that Linear's weight is ``W·M`` (the op
    takes ``x`` to ``x·M``), and the adapter reads the Linear's input before the op, so its update belongs to
    ``W``. Per family:

    * ``"delta"`` (LoRA, AdaLoRA, LoHa, LoKr): while PEFT's method runs, ``get_delta_weight`` returns the update
      turned, ``ΔW·M`` (:func:`turned_delta`); elsewhere (their forward, ``add_weighted_adapter``) it is the
      class's own. DoRA is refused (its norm is taken in the op's basis).
    * ``"ia3"`` on a feedforward layer (it scales the Linear's *input*): PEFT's method runs on the weight turned
      back, ``W = W·M·Mᵀ``, and the result is turned again (in float64; the merged weight is
      ``W·diag(l)·M``, the columns of ``W·M`` mixed, which no column scaling of ``W·M`` gives). On its output
      (key, value), the scale of rows is the same in either basis: PEFT's own.
    * any other family: ``merge`` refused, one line, before the Linear changes (not known to be exact).
    """

    def __init__(self, layer: nn.Module, name: str) -> None:
        self.layer, self.name = layer, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer = self.layer
        method = getattr(type(layer), self.name)
        base = layer.get_base_layer()
        handle = base.__dict__.get(HANDLE)
        op = handle is not None and handle.id in base._forward_pre_hooks
        if not op and HEADS not in base.__dict__ and BASIS not in base.__dict__:  # nothing to turn
            return method(layer, *args, **kwargs)
        family = _family(layer)
        if family == "delta":
            own = layer.__dict__.get("get_delta_weight")  # LoHa / LoKr on the per-head turn: TurnedHeadsDelta
            layer.__dict__["get_delta_weight"] = types.MethodType(turned_delta, layer)
            before = list(getattr(layer, "merged_adapters", []))
            try:
                out = method(layer, *args, **kwargs)
            finally:
                if own is None:
                    layer.__dict__.pop("get_delta_weight", None)
                else:
                    layer.__dict__["get_delta_weight"] = own
            basis = base.__dict__.get(BASIS)
            if basis is not None:  # the adapter's share of the folded β (and a writer's lora_bias, turned)
                after = list(getattr(layer, "merged_adapters", []))
                for name, sign in [*((a, 1.0) for a in after if a not in before),
                                   *((a, -1.0) for a in before if a not in after)]:
                    _merge_bias_share(layer, base, basis, name, sign)
            return out
        if not op:  # IA3 on the output projection's output: rows scaled, the per-head columns untouched
            return method(layer, *args, **kwargs)
        if family == "ia3":
            if not getattr(layer, "is_feedforward", False):
                return method(layer, *args, **kwargs)
            with _original_basis(base):
                return method(layer, *args, **kwargs)
        if self.name == "merge":
            hook = base._forward_pre_hooks[handle.id]
            raise NormswapError(f"adapter layer {type(layer).__name__} on `{getattr(hook, 'path', '?')}` "
                                f"({type(base).__name__}) runs an online Hadamard before that Linear: normswap knows "
                                "the merges of LoRA, LoHa, LoKr and IA3 there, not this one's, so it is refused; keep "
                                "the adapter unmerged")
        return method(layer, *args, **kwargs)


def _input_axis(module: nn.Module) -> int:
    """The weight's input axis: 0 for HF's ``Conv1D`` (``[in, out]``), else the last."""
    return 0 if type(module).__name__ == "Conv1D" else -1


@contextmanager
def _original_basis(base: nn.Module) -> Iterator[None]:
    """Within: ``base``'s weight holds ``W = (W·M)·Mᵀ`` in float64 (the op's matrix ``M``, ``n × n``, built from
    its hook); after (also on an error): that weight times ``M`` again, in the weight's dtype."""
    hook = base._forward_pre_hooks[base.__dict__[HANDLE].id]
    axis, dtype = _input_axis(base), base.weight.dtype
    with torch.no_grad():
        m = hook.transform(base, torch.eye(base.weight.shape[axis], dtype=torch.float64, device=base.weight.device))
        base.weight.data = (base.weight.data.double().movedim(axis, -1) @ m.T).movedim(-1, axis).contiguous()
    try:
        yield
    finally:
        with torch.no_grad():
            w = base.weight.data.double().movedim(axis, -1)
            base.weight.data = (w @ m).movedim(-1, axis).contiguous().to(dtype)


def turned_delta(layer: nn.Module, adapter: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """PEFT's weight update of ``adapter`` (its class's ``get_delta_weight``) for a base Linear whose weight is
    in the basis of the online op before it: the update times the op (``ΔW·M``, where the op takes ``x`` to
    ``x·M`` and the weight holds ``W·M``), so that the merged Linear, which keeps its op, computes the unmerged
    layer's output. The adapter itself reads the input before the op, as the Linear's caller sees it. Where the
    base Linear holds the per-head ``H̃`` of the values (:class:`HeadTurn`), the update is turned by it too (rows
    or columns, per head), with or without an op. Used by :class:`MergeInOpBasis` while PEFT merges or
    unmerges."""
    base = layer.get_base_layer()
    if adapter in (getattr(layer, "lora_variant", None) or {}):  # DoRA: its norm is taken in the op's basis
        raise NormswapError(f"adapter `{adapter}` is a {type(layer.lora_variant[adapter]).__name__} on a "
                            f"{type(base).__name__} that runs an online Hadamard: it cannot be merged exactly (its "
                            "weight norm is taken in the op's basis); keep it unmerged, or train a plain LoRA")
    delta = _delta_as_held(layer, adapter, *args, **kwargs)
    handle = base.__dict__.get(HANDLE)
    if handle is None or handle.id not in base._forward_pre_hooks:
        return delta
    hook = base._forward_pre_hooks[handle.id]
    axis = _input_axis(base)
    return hook.transform(base, delta.movedim(axis, -1)).movedim(-1, axis)


# ------------------------------------------------------------- adapters on the Linears the conversion edited
class AdapterBasis:
    """On a Linear / Conv1D the conversion edited (from the plan's ``adapter_bases``, so it survives a save and a
    load): how its input and output relate to the original model's, so that an adapter attached to it acts as
    the same adapter on the original Linear. Input: the original Linear received ``x·γ + β`` where this one
    receives ``x`` (``gamma``: the norm's γ folded into its weight; ``beta``: the β folded into its bias).
    Output: this one's output is ``T·y`` of the original's ``y``, ``T = diag(1/s)·C·diag(λ)`` (``scale``: a
    LayerScale λ folded into its rows; ``center``: its rows centered, ``True`` or per ``[lo, hi)`` block;
    ``balance``: the per-row ``s`` taken back into λ). A rotated stream (since round 56): ``turn_in``, the
    ``Q`` of the stream it reads (its input is ``x·Q`` of the conversion's), ``turn_out``, the ``Q`` of the
    stream it writes (its output ``·Q``); each ``d × d``, kept flat. ``path``: the Linear's path (for a
    refusal). ``record`` names each vector (the plan's structure); ``vectors``: the plan's ``adapter_vectors``
    they are looked up in.
    A named vector not there (a checkpoint loaded without its side file) is listed in ``missing``: every
    adapter on this Linear is then refused at attach. ``refuse`` (a record of an edit the bases do not model, or
    of a rotated stream): why every adapter on this Linear is refused at attach (one line naming it)."""

    FIELDS = ("gamma", "beta", "scale", "center", "balance", "turn_in", "turn_out", "refuse")

    def __init__(self, path: str, record: dict[str, Any], vectors: dict[str, torch.Tensor] | None = None) -> None:
        self.path = path
        self.record = {k: record.get(k) for k in self.FIELDS}
        self.vectors: dict[str, torch.Tensor] = {}
        self.missing: list[str] = []
        for key in ADAPTER_VECTOR_FIELDS:
            name = self.record[key]
            if name is None:
                continue
            t = (vectors or {}).get(name) if isinstance(name, str) else None
            if t is None:
                self.missing.append(str(name))
            else:
                self.vectors[key] = t
        self.refuse: str | None = self.record["refuse"]
        self._cache: dict = {}

    @property
    def reads(self) -> bool:
        """Whether its input differs from the original Linear's."""
        return any(self.record[k] is not None for k in ("gamma", "beta", "turn_in"))

    @property
    def writes(self) -> bool:
        """Whether its output differs from the original Linear's."""
        return any(self.record[k] for k in ("scale", "center", "balance", "turn_out"))

    def _vec(self, key: str, like: torch.Tensor) -> torch.Tensor | None:
        t = self.vectors.get(key)
        if t is None:
            return None
        k = (key, like.device, like.dtype)
        if k not in self._cache:
            if key.startswith("turn_"):  # a stream's Q, kept flat
                n = int(round(t.numel() ** 0.5))
                t = t.reshape(n, n)
            self._cache[k] = t.to(device=like.device, dtype=like.dtype)
        return self._cache[k]

    def to_input(self, x: torch.Tensor) -> torch.Tensor:
        """This Linear's input (features last) as the original Linear received it: ``x·Qᵀ`` where its stream
        was rotated, then ``·γ + β``."""
        q, g, b = self._vec("turn_in", x), self._vec("gamma", x), self._vec("beta", x)
        x = x @ q.T if q is not None else x
        x = x * g if g is not None else x
        return x + b if b is not None else x

    def to_output(self, y: torch.Tensor) -> torch.Tensor:
        """An output of the original Linear (features last) in this one's space: ``diag(1/s)·C·diag(λ)·y``."""
        lam, s, center = self._vec("scale", y), self._vec("balance", y), self.record["center"]
        y = y * lam if lam is not None else y
        if center is True:
            y = y - y.mean(dim=-1, keepdim=True)
        elif center:
            parts, at = [], 0
            for lo, hi in center:
                parts += [y[..., at:lo], y[..., lo:hi] - y[..., lo:hi].mean(dim=-1, keepdim=True)]
                at = hi
            y = torch.cat([*parts, y[..., at:]], dim=-1)
        y = y / s if s is not None else y
        q = self._vec("turn_out", y)
        return y @ q if q is not None else y

    def turn_delta(self, delta: torch.Tensor, in_axis: int) -> torch.Tensor:
        """A weight update ``ΔW`` of the original Linear (in the weight's own layout, input along ``in_axis``) as
        this one's weight holds it: ``T·ΔW·diag(γ)``, in float64, back in ``delta``'s dtype."""
        d = delta.double().movedim(in_axis, -1)  # [out, in]
        g, q = self._vec("gamma", d), self._vec("turn_in", d)
        d = d * g if g is not None else d
        d = d @ q if q is not None else d
        d = self.to_output(d.T).T if self.writes else d
        return d.movedim(-1, in_axis).to(delta.dtype)

    def bias_share(self, delta: torch.Tensor, in_axis: int) -> torch.Tensor | None:
        """What merging the original-basis update ``delta`` adds to this Linear's bias: ``T·ΔW·β`` (None when
        no β was folded)."""
        d = delta.double().movedim(in_axis, -1)
        b = self._vec("beta", d)
        return None if b is None else self.to_output(d @ b)

    def _named(self) -> dict[str, torch.Tensor]:
        return {self.record[k]: t for k, t in self.vectors.items()}

    def __getstate__(self) -> dict:
        return {"path": self.path, "record": self.record, "vectors": self._named()}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["record"], state.get("vectors"))

    def __deepcopy__(self, memo: dict) -> AdapterBasis:
        return AdapterBasis(self.path, self.record, self._named())  # the vectors are never written: shared


class _BasisHook:
    """Forward pre-hook on an adapter's ``lora_A`` Linear (its input taken back to the original Linear's:
    :meth:`AdapterBasis.to_input`) or forward hook on its ``lora_B`` Linear (its output taken to this Linear's
    output space: :meth:`AdapterBasis.to_output`)."""

    def __init__(self, basis: AdapterBasis, side: str) -> None:
        self.basis, self.side = basis, side

    def __call__(self, module: nn.Module, args: tuple, *rest: Any) -> Any:
        if self.side == "output":
            return self.basis.to_output(rest[0])
        return (self.basis.to_input(args[0]), *args[1:])


def _basis_branch(linear: nn.Module, basis: AdapterBasis, side: str) -> None:
    """Put the basis hook on one adapter branch Linear (``lora_A[name]`` for the input side, ``lora_B[name]``
    for the output side), once."""
    if not isinstance(linear, nn.Module) or linear.__dict__.get(BASIS_HOOK) is not None:
        return
    hook = _BasisHook(basis, side)
    linear.__dict__[BASIS_HOOK] = (linear.register_forward_hook(hook) if side == "output"
                                   else linear.register_forward_pre_hook(hook))


class _BasisBranch:
    """On a LoRA layer's ``lora_A`` / ``lora_B`` dictionary over an edited Linear: the basis, the side and the
    layer (weakly), so that an adapter added later (``add_adapter``) is hooked as it is assigned."""

    def __init__(self, basis: AdapterBasis, side: str, layer: nn.Module) -> None:
        self.basis, self.side, self.layer = basis, side, weakref.ref(layer)

    def __deepcopy__(self, memo: dict) -> _BasisBranch:
        layer = self.layer()
        return _BasisBranch(copy.deepcopy(self.basis), self.side, memo.get(id(layer), layer))

    def __getstate__(self) -> dict:
        return {"basis": self.basis, "side": self.side, "layer": self.layer()}

    def __setstate__(self, state: dict) -> None:
        self.basis, self.side = state["basis"], state["side"]
        layer = state["layer"]
        self.layer = weakref.ref(layer) if layer is not None else lambda: None


def _basis_line(layer: nn.Module | None, basis: AdapterBasis, what: str) -> str:
    return (f"{_adapter_named(layer)} on `{basis.path}` is refused: the conversion folded "
            f"a norm's γ/β into that Linear or centered its rows, and {what} cannot act there as on the original "
            "model; use LoRA on it, or leave it out of target_modules")


def _basis_refusal(layer: nn.Module, basis: AdapterBasis) -> str | None:
    """Why the PEFT adapter layer ``layer`` on an edited Linear cannot act as on the original (one line), or
    None (LoRA without a variant; LoHa / LoKr where no β was folded; IA3 on a reader's output or on a writer's
    input; not PEFT's)."""
    names = _peft_classes(layer)
    what = None
    if not names:
        return None
    if basis.refuse:
        return (f"{_adapter_named(layer)} on `{basis.path}` is refused (an adapter there could not act as on the "
                f"original model): {basis.refuse}; or leave that Linear out of target_modules")
    if basis.missing:
        return (f"{_adapter_named(layer)} on `{basis.path}` is refused: the conversion folded a "
                "norm's γ/β into that Linear or centered its rows, and the vectors that make an adapter there act "
                f"as on the original model ({ADAPTER_BASES_FILE} beside config.json) were not there when the "
                "checkpoint was loaded; put that file back and load again, or leave the Linear out of "
                "target_modules")
    if "AdaLoraLayer" in names:
        what = "AdaLoRA (its forward reads its matrices, not its branch Linears)"
    elif "LoraLayer" in names:
        if any(getattr(layer, "lora_variant", None) or {}):
            variant = type(next(iter(layer.lora_variant.values()))).__name__
            what = f"a LoRA variant ({variant}: its norm is taken per row of the edited weight)"
    elif "LycorisLayer" in names:
        if not names & {"LoHaLayer", "LoKrLayer"}:
            what = "this adapter type"
        elif basis.record["beta"] is not None:
            what = "LoHa / LoKr on a Linear that took the norm's β (their forward misses the update's β share)"
    elif "IA3Layer" in names:  # a scale of the input commutes with γ and T, one of the output with γ and β
        feedforward = getattr(layer, "is_feedforward", False)
        if (basis.writes and not feedforward) or (feedforward and basis.record["beta"] is not None):
            what = ("IA3 scaling a centered writer's output (the centering does not commute with the scale)"
                    if not feedforward else "feedforward IA3 on a Linear that took the norm's β (β is not scaled)")
    else:
        what = "this adapter type"
    return None if what is None else _basis_line(layer, basis, what)


def _basis_adapter(layer: nn.Module, basis: AdapterBasis) -> None:
    """Make the PEFT adapter layer ``layer`` on an edited Linear act as on the original: LoRA's ``lora_A`` input
    taken back by :meth:`AdapterBasis.to_input`, its ``lora_B`` output forward by :meth:`AdapterBasis.to_output`
    (hooks; the dictionaries marked so that adapters added later are hooked too); LoHa's / LoKr's update
    turned (:class:`TurnedHeadsDelta`); merges through :class:`MergeInOpBasis`."""
    names = _peft_classes(layer)
    if "LoraLayer" in names:
        for side, branches, needed in (("input", layer.lora_A, basis.reads), ("output", layer.lora_B, basis.writes)):
            if not needed:
                continue
            branches.__dict__[BASIS] = _BasisBranch(basis, side, layer)
            for linear in branches.values():
                _basis_branch(linear, basis, side)
    elif "LycorisLayer" in names:
        layer.__dict__["get_delta_weight"] = TurnedHeadsDelta(layer)
    if _family(layer) == "delta":
        layer.__dict__["merge"] = MergeInOpBasis(layer, "merge")
        layer.__dict__["unmerge"] = MergeInOpBasis(layer, "unmerge")


def _basis_of(parent: nn.Module, name: str, new: Any) -> AdapterBasis | None:
    """The :class:`AdapterBasis` of the Linear an adapter layer ``new`` replaces at ``parent.name``."""
    return _replaced_mark(parent, name, new, BASIS)


def _merge_bias_share(layer: nn.Module, base: nn.Module, basis: AdapterBasis, adapter: str, sign: float) -> None:
    """Add (``sign`` 1, merge) or take back (-1, unmerge) adapter ``adapter``'s share of the folded β in
    ``base``'s bias, ``T·ΔW·β``, and where ``base`` writes a changed output space, its ``lora_bias`` turned
    (PEFT adds it as is)."""
    delta = type(layer).get_delta_weight(layer, adapter)
    share = basis.bias_share(delta, _input_axis(base))
    lora_b = getattr(layer, "lora_B", {})
    lb = getattr(lora_b[adapter], "bias", None) if adapter in lora_b else None
    if lb is not None and basis.writes:
        own = lb.detach().double() * layer.scaling[adapter]
        extra = basis.to_output(own) - own
        share = extra if share is None else share + extra
    if share is None or base.bias is None:
        return
    turn = base.__dict__.get(HEADS)
    if turn is not None and turn.side == "output":  # a value projection's rows hold the per-head H̃ too
        share = turn.turn_delta(share.reshape(-1, 1)).reshape(-1)
    with torch.no_grad():
        base.bias.data = (base.bias.data.double() + sign * share).to(base.bias.dtype)


def mark_bases(model: nn.Module, plan: Plan | None = None) -> int:
    """Mark each Linear the conversion edited (the ``adapter_bases`` of ``plan``, default the model's own plan)
    with its :class:`AdapterBasis`, so that a PEFT adapter assigned in its place acts as on the original model
    (:func:`_on_register`), or is refused where the record says why; marks already there are replaced (a loader
    marks again once it has read the vectors). Where a rotation turned a stream, a record that does not refuse
    yet (a checkpoint rotated before round 56, when :func:`turn_rotated` did not record them) refuses as a
    rotated Linear: its recorded basis is not the whole map. Returns how many Linears were marked without
    their vectors (their adapters are refused)."""
    plan = plan if plan is not None else plan_of(model)
    bases = getattr(plan, "adapter_bases", None) or {}
    if not bases:
        return 0
    rotated = any(r.get("kind") != "none" and not r.get("adapter_bases")  # rotated before round 56
                  for r in getattr(plan, "rotations", None) or [])
    vectors = getattr(plan, "adapter_vectors", None) or {}
    missing = 0
    for path, record in bases.items():
        module = _at(model, path)
        if isinstance(module, nn.Module) and hasattr(module, "weight") and "base_layer" not in module._modules:
            if rotated and not record.get("refuse"):
                record = {"kind": record.get("kind"), "refuse": REFUSE_ROTATED}
            basis = AdapterBasis(path, record, vectors)
            module.__dict__[BASIS] = basis
            missing += bool(basis.missing)
    _listen()
    return missing


def turn_rotated(model: nn.Module, plan: Plan, rotated: list[dict]) -> int:
    """Record in ``plan.adapter_bases`` what a stream rotation did to each Linear it turned, so that an adapter
    there still acts as on the original model: a reader's input is ``x·Q`` of the conversion's (``turn_in``), a
    writer's output ``·Q`` (``turn_out``); ``Q`` kept once per stream in ``plan.adapter_vectors`` (flat, float64;
    the side file holds it). Where the rotation did more than ``Q`` (smoothing, learned scales or head
    rotations) and for a turned Embedding / table (PEFT keeps its update in parameters no map reaches), the
    record refuses adapters instead (``REFUSE_ROTATED``). Marks the model (:func:`mark_bases`). ``rotated``: the
    streams of :class:`normswap.rotation.rotate.Rotation` ``.rotated`` (``q``; readers by module path, writers
    by parameter name). Before round 56 an adapter on such a Linear ran on the turned stream as is. Returns
    how many Linears it records."""
    count = 0
    for stream in rotated:
        learned = stream.get("learned") or {}
        exact = stream.get("q") is not None and not stream.get("smoothed") and not learned.get("scaled_norms") \
            and not learned.get("head_rotations")
        name = f"{stream['norms'][0]}:turn"
        exact = exact and name not in plan.adapter_vectors  # a stream turned twice: Q₁Q₂ is not recorded
        if exact:
            plan.adapter_vectors[name] = stream["q"].detach().to("cpu", torch.float64).reshape(-1).contiguous()
        sides = dict.fromkeys([(p, "turn_in") for p in stream.get("readers", [])]
                              + [(w.rpartition(".")[0], "turn_out") for w in stream.get("writers", [])])
        for path, side in sides:
            module = _at(model, path) if path else None
            if not isinstance(module, nn.Module) or not isinstance(getattr(module, "weight", None), torch.Tensor):
                continue
            record = plan.adapter_bases.get(path) or {"kind": type(module).__name__.lower()}
            if record.get("refuse"):
                continue
            if not exact or isinstance(module, nn.Embedding) or module.weight.dim() != 2 or record.get(side):
                record = {"kind": record["kind"], "refuse": REFUSE_ROTATED}
            else:
                record = {**record, side: name}
            plan.adapter_bases[path] = record
            count += 1
        stream["adapter_bases"] = True  # this stream's Linears are recorded (a manifest from round 56 on)
    named = {v for r in plan.adapter_bases.values() for k, v in r.items() if k in ADAPTER_VECTOR_FIELDS}
    plan.adapter_vectors = {k: v for k, v in (plan.adapter_vectors or {}).items() if k in named}
    mark_bases(model, plan)
    return count
