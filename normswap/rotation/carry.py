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
  ``merge_and_unload`` keeps the model exact; DoRA is refused at merge.

Ops after a norm (``OnlineHadamardOutput``, a forward hook on the norm) are carried and checked the same way;
engines do not swap norms, so in practice they stay where they are. The op itself (its math) is
:class:`normswap.rotation.rotate.OnlineHadamard`'s; this module copies whatever buffers and attributes it keeps
under the ``normswap_hadamard`` / ``_normswap_hadamard`` prefixes, so it carries any form of the op.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normswap.analysis.plan import plan_of
from normswap.errors import NormswapError

HANDLE = "_normswap_online"  # the op's RemovableHandle on its module (rotate.py's _install_online sets it)
BUFFER_PREFIX = "normswap_hadamard"  # the op's buffers: the small Hadamard factor, the signs, ...
ATTR_PREFIX = "_normswap_hadamard"  # its plain attributes (the Sylvester factor built from the widths)
REGISTRY = "_normswap_online_ops"  # on the model: {module path: HeldOp}

__all__ = ["HeldOp", "record", "held_ops", "carry_online_ops", "check_online_ops", "missing_online_ops",
           "after_load"]


@dataclass
class HeldOp:
    """One online Hadamard as its module held it: enough to put it on another module.

    ``output``: a forward hook on the module's output (a norm's op shared by its readers), else a pre-hook on
    its input. ``hook``: the hook object itself (it keeps per-device copies of its constant factor).
    ``buffers`` / ``attrs``: the module's ``normswap_hadamard*`` buffers and ``_normswap_hadamard*`` attributes,
    by name (buffers on the meta device until the checkpoint's values are loaded)."""

    output: bool
    hook: Callable
    with_kwargs: bool = False
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)


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
                  attrs={k: v for k, v in vars(module).items() if k.startswith(ATTR_PREFIX)})


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
    if ops:
        model.__dict__[REGISTRY] = ops
        _guard(model).watch(model)
        _listen()
    return ops


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


def _lost(model: nn.Module, path: str) -> str:
    module = model.get_submodule(path)
    return (f"`{path}` ({type(module).__name__}) has lost its online Hadamard: its weight was turned for the op, so "
            "the model would compute wrong outputs (a module swap, e.g. by a quantization engine, drops the op); "
            "call normswap.rotation.carry.carry_online_ops(model) after replacing modules")


def check_online_ops(model: nn.Module) -> None:
    """Raise :class:`normswap.errors.NormswapError` (one line naming the first module) when a module that should
    run an online Hadamard does not; return quietly otherwise, and for a model without online ops."""
    missing = missing_online_ops(model)
    if missing:
        more = f" ({len(missing) - 1} other module(s) too)" if len(missing) > 1 else ""
        raise NormswapError(_lost(model, missing[0]) + more)


def _device_of(module: nn.Module) -> torch.device | None:
    t = next((t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
              if t.device.type != "meta"), None)
    if t is None:
        t = next((t for t in (*module.parameters(), *module.buffers()) if t.device.type != "meta"), None)
    return t.device if t is not None else None


def _install(module: nn.Module, held: HeldOp, values: dict[str, torch.Tensor]) -> None:
    """``held`` on ``module``: its buffers (``values``, on the module's device), attributes and hook."""
    device = _device_of(module)
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
        vals = dict(held.buffers)
        if any(v.device.type == "meta" for v in vals.values()):
            vals = (values(path, held) if values is not None else None) or {}
            if set(vals) != set(held.buffers) or any(v.device.type == "meta" for v in vals.values()):
                raise NormswapError(f"`{path}` ({type(module).__name__}) lost its online Hadamard and the op's values "
                                    "were never loaded, so it cannot be put back; load the checkpoint again and "
                                    "replace modules after loading")
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
_WATCHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> guards watching edges out of it


class OpsGuard:
    """Forward pre-hook on the model (one, registered first by :func:`record`): before each call, whether every
    module that runs an online op is still the instance the model holds on the way to it. A swap (``setattr`` or
    a write into ``_modules``, with or without another reference to the old module), a deep copy (the copy's
    guard watches the copy's modules: ``copy.deepcopy`` maps them) or a trace by ``torch.compile`` (Dynamo
    evaluates the comparison while tracing and guards on it, so a swap after compiling recompiles) all meet it.

    Per call: one tuple of ``dict.get`` over the watched edges (the ``_modules`` entry of each module on the
    way from the model to an op), compared by identity with the modules recorded, in C. A changed edge runs
    :func:`check_online_ops` (raise, one line, before the model runs) and, where the ops still run (a wrapper
    that calls the original module, as PEFT's LoRA layers do), watches the new structure."""

    def __init__(self) -> None:
        self.dicts: tuple[dict, ...] = ()
        self.names: tuple[str, ...] = ()
        self.modules: tuple[nn.Module, ...] = ()
        self.owners: tuple[nn.Module, ...] = ()  # the module whose ``_modules`` each edge is in

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy``, pickle) watches its own modules, and is told of assignments to them."""
        self.__dict__.update(state)
        for owner in self.owners:
            _WATCHERS.setdefault(owner, weakref.WeakSet()).add(self)
        _listen()  # a model unpickled in a process that recorded none

    def watch(self, model: nn.Module) -> None:
        """Watch the edges from ``model`` to each module that runs an op now (at an op's path, or inside the
        wrapper now there)."""
        self.dicts, self.names, self.modules, self.owners = (), (), (), ()
        ops = held_ops(model)
        for path in _expected(model):
            module = model.get_submodule(path)
            running = _running_in(module, ops.get(path))
            if not running:  # an op missing already: every call takes the check, which refuses
                self.dicts, self.names, self.modules, self.owners = ({},), ("",), (model,), ()
                return
            for sub in running:
                self._add(model, f"{path}.{sub}" if path and sub else path or sub)

    def _add(self, owner: nn.Module, path: str) -> None:
        """Watch the edges from ``owner`` down ``path`` (those not watched yet)."""
        seen = set(zip(map(id, self.dicts), self.names, strict=True))
        dicts, names, modules, owners = list(self.dicts), list(self.names), list(self.modules), list(self.owners)
        for part in path.split(".") if path else []:
            d = owner.__dict__["_modules"]
            child = d[part]
            if (id(d), part) not in seen:
                dicts.append(d), names.append(part), modules.append(child), owners.append(owner)
                _WATCHERS.setdefault(owner, weakref.WeakSet()).add(self)
            owner = child
        self.dicts, self.names, self.modules, self.owners = tuple(dicts), tuple(names), tuple(modules), tuple(owners)

    def replaced(self, parent: nn.Module, name: str, new: nn.Module) -> None:
        """``parent.name = new`` on a watched edge, as it happens: where ``new`` holds every op module that was at
        or under the old one (PEFT wrapping a Linear as its ``base_layer``, or unloading it back), ``new`` is
        watched in place of the old module, so the next call, eager or traced by
        ``torch.compile(fullgraph=True)``, finds nothing changed; any other module is left for the next call to
        refuse."""
        d = parent.__dict__["_modules"]
        edges = enumerate(zip(self.dicts, self.names, strict=True))
        i = next((i for i, (dd, n) in edges if dd is d and n == name), None)
        if i is None or not isinstance(new, nn.Module):
            return
        old, inside = self.modules[i], {id(m) for m in new.modules()}
        holders = [m for m in old.modules() if holds_op(m)]
        if not holders or any(id(m) not in inside for m in holders):
            return
        gone = {id(m) for m in old.modules()} - inside  # a wrapper unloaded: stop watching (and holding) it
        keep = [j for j, o in enumerate(self.owners) if id(o) not in gone]
        modules = list(self.modules)
        modules[i] = new
        self.dicts, self.names, self.owners = (tuple(self.dicts[j] for j in keep), tuple(self.names[j] for j in keep),
                                               tuple(self.owners[j] for j in keep))
        self.modules = tuple(modules[j] for j in keep)
        for sub in _running_in(new):
            self._add(new, sub)

    def __call__(self, model: nn.Module, args: tuple) -> None:
        if tuple(map(dict.get, self.dicts, self.names)) != self.modules:
            check_online_ops(model)
            self.watch(model)


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


def _listen() -> None:
    """Register :func:`_on_register` (once per process) with torch's global module-registration hooks."""
    if not _LISTENER:
        _LISTENER.append(nn.modules.module.register_module_module_registration_hook(_on_register))


def _on_register(parent: nn.Module, name: str, new: Any) -> None:
    """Called by torch for every submodule assignment: where an adapter layer (PEFT's LoRA family: a
    ``base_layer`` and a ``get_delta_weight``) replaces a Linear that runs an online op around that very Linear,
    its ``get_delta_weight`` returns the update turned into the basis the Linear's weight is in
    (:func:`turned_delta`), so that PEFT's ``merge`` / ``merge_and_unload`` / ``unmerge`` stay exact.
    Where the assignment replaces a module an :class:`OpsGuard` watches, the guard is told
    (:meth:`OpsGuard.replaced`). Costs two dict lookups per assignment elsewhere; never raises."""
    try:
        for guard in list(_WATCHERS.get(parent, ())):
            guard.replaced(parent, name, new)
        old = parent.__dict__["_modules"].get(name)
        if old is None or old is new or not isinstance(new, nn.Module) or not holds_op(old):
            return None
        if new.__dict__["_modules"].get("base_layer") is not old or not hasattr(type(new), "get_delta_weight"):
            return None
        if old.__dict__[HANDLE].id not in old._forward_pre_hooks:  # an op on the output (a norm's): not an input
            return None
        new.get_delta_weight = types.MethodType(turned_delta, new)
    except Exception:  # noqa: BLE001 - a hook inside every module assignment must never break one
        return None
    return None


def turned_delta(layer: nn.Module, adapter: str) -> torch.Tensor:
    """PEFT's weight update of ``adapter`` (its class's ``get_delta_weight``) for a base Linear whose weight is
    in the basis of the online op before it: the update times the op (``ΔW·M``, where the op takes ``x`` to
    ``x·M`` and the weight holds ``W·M``), so that the merged Linear, which keeps its op, computes the unmerged
    layer's output. The adapter itself reads the input before the op, as the Linear's caller sees it."""
    base = layer.get_base_layer()
    if adapter in (getattr(layer, "lora_variant", None) or {}):  # DoRA: its norm is taken in the op's basis
        raise NormswapError(f"adapter `{adapter}` is a {type(layer.lora_variant[adapter]).__name__} on a "
                            f"{type(base).__name__} that runs an online Hadamard: it cannot be merged exactly (its "
                            "weight norm is taken in the op's basis); keep it unmerged, or train a plain LoRA")
    delta = type(layer).get_delta_weight(layer, adapter)
    hook = base._forward_pre_hooks[base.__dict__[HANDLE].id]
    axis = 0 if type(base).__name__ == "Conv1D" else -1  # the weight's input axis (Conv1D stores [in, out])
    return hook.transform(base, delta.movedim(axis, -1)).movedim(-1, axis)
