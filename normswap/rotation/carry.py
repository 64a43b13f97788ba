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
  an op does not. ``normswap.save`` and ``save_pretrained`` call it before writing anything; and when a module
  that held an op is freed while its model lives (what a swap does), the model's next forward call runs the
  check once (a one-shot pre-hook on the model, removed after it passes): no Python is added to any call
  otherwise, and none to a call of a model nobody swapped.

Ops after a norm (``OnlineHadamardOutput``, a forward hook on the norm) are carried and checked the same way;
engines do not swap norms, so in practice they stay where they are. The op itself (its math) is
:class:`normswap.rotation.rotate.OnlineHadamard`'s; this module copies whatever buffers and attributes it keeps
under the ``normswap_hadamard`` / ``_normswap_hadamard`` prefixes, so it carries any form of the op.
"""

from __future__ import annotations

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
GUARD = "_normswap_ops_guard"  # on the model: the one-shot forward pre-hook armed when an op's module is freed

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
    for m in module.modules():
        if holds_op(m):
            return True
        if held is not None and any(h is held.hook for h in (*m._forward_pre_hooks.values(),
                                                             *m._forward_hooks.values())):
            return True
    return False


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
        _watch(model, {p: model.get_submodule(p) for p in ops if _at(model, p) is not None})
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
    _disarm(model)  # the swap that armed it is undone
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
    _disarm(model)  # armed by the quantizer's swap, which is undone
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


# ------------------------------------------------------------------------------ the guard at the next call
_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {path: weakref to its op's module}


def _watch(model: nn.Module, modules: dict[str, nn.Module]) -> None:
    """Watch each op's module: freed while ``model`` lives, it arms ``model``'s one-shot check. Kept outside the
    model (a weak reference neither pickles nor deep-copies); a module watched already keeps its reference."""
    watched = _WATCHED.setdefault(model, {})
    root = weakref.ref(model)
    for path, module in modules.items():
        ref = watched.get(path)
        if ref is not None and ref() is module:
            continue
        watched[path] = weakref.ref(module, lambda _ref, root=root: _arm(root()))


def _arm(model: nn.Module | None) -> None:
    """Register ``model``'s one-shot check (a weak reference's callback: it runs when the module is freed)."""
    if model is None or model.__dict__.get(GUARD) is not None:
        return
    try:
        model.__dict__[GUARD] = model.register_forward_pre_hook(_check_once)
    except Exception:  # noqa: BLE001 - a callback at interpreter teardown must not print a traceback
        return


def _disarm(model: nn.Module) -> None:
    """Remove the one-shot check (the ops were just checked)."""
    handle = model.__dict__.pop(GUARD, None)
    if handle is not None:
        handle.remove()


def _check_once(model: nn.Module, args: tuple) -> None:
    """One-shot forward pre-hook: check the ops (raise if one is missing), then remove itself. Skipped while
    torch.compile traces (its Python would be traced, not run; the eager call and ``normswap.save`` check)."""
    if torch.compiler.is_compiling():
        return
    check_online_ops(model)
    _disarm(model)
    record(model)  # watch the modules that hold the ops now
