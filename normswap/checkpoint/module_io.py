"""Save a patched custom ``nn.Module`` and load it into a fresh instance of its class (PEFT-style).

A transformers model is saved as a native checkpoint (:mod:`normswap.checkpoint.writer`): its config
names its class, so loading can build it. A custom module has no config; only its author's code can
build it. So, like PEFT's ``save_pretrained`` / ``PeftModel.from_pretrained(base_model, dir)``, the
directory holds what the user's class cannot rebuild by itself, and loading starts from a freshly
built instance that the user passes in:

* ``model.safetensors`` (sharded with ``model.safetensors.index.json`` past ``max_shard_size``;
  ``metadata={"format": "pt"}``): the patched module's whole ``state_dict``, under its own names.
  Never pickle. A tensor registered under several names (a tied head) is stored once; the manifest
  lists the other names (``aliases``).
* ``normswap.json`` (:data:`MANIFEST_FILE`): the plan (``Plan.to_dict()``: replaced norms with
  shape/eps/affine slots, widened MLPs, bias slots, centering ops, untied heads, rotations, and
  every weight edit for the record), each RMSNorm's backend, the class of every module the plan
  names, the versions, and the saved class's name (information only).
* ``normswap_adapter_bases.safetensors`` (:data:`normswap.checkpoint.bases_io.SIDECAR`, only where the
  conversion edited Linears an adapter may target): the vectors that make such an adapter act as on the
  original module (``plan.adapter_bases`` names them).
* ``README.md``: a short card saying how to load it.

Loading (:func:`load_into`, reached as ``normswap.load(dir, model=MyNet(...))``) applies the plan's
structure with :func:`normswap.surgery.edits.apply_structure` (the function that rebuilds native
checkpoints, so every structural edit it knows is covered here too) and loads the weights strictly:
no analysis, no example inputs. Everything that can refuse runs first, on a meta-device copy of the
given module (module paths and classes, the structure itself, every key, shape and tie against the
files' headers), and the tensors are read before the module is touched: a directory that does not
fit leaves the module as it was and raises one line naming the first mismatch.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.analysis.plan import Plan, plan_of
from normswap.checkpoint import bases_io, io, stream_io
from normswap.copying import deepcopy_module
from normswap.errors import NormswapError, first_line
from normswap.integrations import trainer, wrappers
from normswap.nn.rmsnorm import RMSNorm

MANIFEST_FILE = "normswap.json"
FORMAT = "module"
# manifest keys normswap writes (manifest_extra may not replace them)
RESERVED = frozenset({"format", "class", "plan", "counts", "backends", "modules", "aliases", "parameters",
                      "versions", "verification", "source"})


def versions() -> dict[str, str]:
    """The versions a checkpoint records (transformers is added by the transformers writer)."""
    import safetensors

    import normswap

    return {
        "normswap": normswap.__version__,
        "torch": torch.__version__.split("+")[0],
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


def is_module_dir(path: Path) -> bool:
    """True for a directory :func:`save_module` wrote (it has :data:`MANIFEST_FILE`)."""
    return (Path(path) / MANIFEST_FILE).is_file()


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a directory :func:`save_module` wrote, checked to be one."""
    file = Path(path) / MANIFEST_FILE
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise NormswapError(f"cannot read {file} ({first_line(exc)}); the checkpoint is corrupted") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("plan"), dict):
        raise NormswapError(f"{file} is not a normswap module manifest (no format {FORMAT!r} with a plan)")
    return manifest


def class_name(model: nn.Module) -> str:
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}"


# ------------------------------------------------------------------------------------ what the plan names
def _strings(obj: Any) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)


def named_modules(plan_dict: dict, model: nn.Module) -> dict[str, str]:
    """``{path: class name}`` of every module of ``model`` the plan names, as a module path or as the
    owner of a parameter it names. Found by scanning every string of the plan, so an edit type added
    later is covered without a change here."""
    modules = dict(model.named_modules(remove_duplicate=False))
    found: dict[str, str] = {}
    for s in _strings(plan_dict):
        path = s if s in modules else s.rpartition(".")[0] if "." in s else None
        if path is not None and path in modules and path not in found:
            found[path] = type(modules[path]).__name__
    found.pop("", None)  # the top-level module's class is information only
    return dict(sorted(found.items()))


def _tensor_groups(state: dict[str, Any]) -> list[list[str]]:
    """The names of a ``state_dict(keep_vars=True)`` grouped by the tensor object they hold (a tie is one
    ``Parameter`` under two names), in state-dict order."""
    by_id: dict[int, list[str]] = {}
    for name, t in state.items():
        by_id.setdefault(id(t), []).append(name)
    return list(by_id.values())


# ------------------------------------------------------------------------------------ save
def save_module(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str,
    overwrite: bool = False,
    manifest_extra: dict | None = None,
    verification: dict | None = None,
    source: str | None = None,
    tokenizer: Any = None,
) -> Path:
    """Write a patched custom module as safetensors + manifest (see the module docstring).

    Called by :func:`normswap.save` for every module that is not a transformers model. Refuses a module
    ``normswap.patch`` has not converted: a directory with an empty plan would look like a conversion
    and hold none (save plain weights with ``safetensors.torch.save_model`` instead).
    """
    model = wrappers.held_module(model)  # torch.compile / DDP: the module inside
    plan = plan_of(model)
    if not isinstance(plan, Plan):
        raise NormswapError(
            f"{type(model).__name__} has not been converted: run normswap.patch(model, example_inputs) first "
            "(to save an unconverted module, use safetensors.torch.save_model)")
    limit = io.parse_size(max_shard_size)
    for key in manifest_extra or {}:
        if key in RESERVED:
            raise NormswapError(f"manifest_extra key {key!r} is reserved by normswap; use another name")
    layout, aliases = _layout(model)
    plan_dict = plan.to_dict()
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "class": class_name(model),
        "source": source,
        "counts": plan.counts(),
        "plan": plan_dict,
        "backends": {path: m.backend for path, m in model.named_modules() if isinstance(m, RMSNorm)},
        "modules": named_modules(plan_dict, model),
        "aliases": aliases,
        "parameters": sum(p.numel() for p in model.parameters()),
        "verification": verification or {},
        "versions": versions(),
        **(manifest_extra or {}),
    }
    out = io.check_destination(out_dir, overwrite=overwrite)
    needed = io.check_space(out, sum(stream_io.nbytes(dtype, shape) for _, dtype, shape, _ in layout))
    with io.atomic_directory(out, overwrite=overwrite, needed=needed) as tmp:
        stream_io.write_shards(layout, tmp, limit, progress=False)
        stream_io.check_written(tmp, model.state_dict(), what=f"normswap.save: the {type(model).__name__} checkpoint")
        io.write_json(tmp / MANIFEST_FILE, manifest)
        bases_io.write(plan, tmp)
        (tmp / "README.md").write_text(model_card(manifest, out.name))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return out


def _layout(model: nn.Module) -> tuple[list[stream_io.OutputTensor], dict[str, str]]:
    """The tensors to write (one per tensor object, under its first state-dict name) and the aliases."""
    state = model.state_dict(keep_vars=True)
    layout: list[stream_io.OutputTensor] = []
    aliases: dict[str, str] = {}
    for group in _tensor_groups(state):
        key = group[0]
        t = state[key]
        if not isinstance(t, torch.Tensor):
            raise NormswapError(f"`{key}` in the state dict is not a tensor (extra state): normswap.save stores "
                                "tensors only")
        if t.device.type == "meta":
            raise NormswapError(f"`{key}` is on the meta device (no values to save); load or materialize the "
                                "model's weights first")
        dtype = stream_io.ST_DTYPES.get(t.dtype)
        if dtype is None:
            raise NormswapError(f"`{key}` has dtype {t.dtype}, which normswap.save cannot store; cast it to a "
                                f"float or integer dtype ({', '.join(str(d) for d in stream_io.ST_DTYPES)})")
        layout.append((key, dtype, tuple(t.shape), lambda t=t: t.detach().to("cpu")))
        aliases.update({alias: key for alias in group[1:]})
    return layout, aliases


def model_card(manifest: dict[str, Any], out_name: str) -> str:
    """The README of a saved module: what it is and the one call that loads it."""
    counts = ", ".join(f"{n} {v}" for v, n in manifest["counts"].items() if n) or "no norms"
    converted = sum(1 for s in manifest["plan"].get("sites", []) if s.get("convert"))
    short = manifest["class"].rpartition(".")[2]
    return "\n".join([
        f"# {out_name}",
        "",
        f"`{manifest['class']}` patched by normswap {manifest['versions'].get('normswap', '')}: {converted} "
        f"LayerNorm(s) replaced by RMSNorm ({counts}).",
        "",
        "## How to load",
        "",
        "```python",
        "import normswap",
        f'model = normswap.load("{out_name}", model={short}(...))  # a freshly built instance, same arguments',
        "```",
        "",
        "The weights are `model.safetensors` under the module's own names; `normswap.json` holds the",
        "structural edits (RMSNorm modules, widened MLPs, bias slots, centering ops, untied heads,",
        "rotations) that loading applies to the fresh instance before the weights load. No pickle.",
        "",
    ])


# ------------------------------------------------------------------------------------ load
def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors (no memory); ties stay ties."""
    memo: dict[int, Any] = {}
    for p in model.parameters(recurse=True):
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers(recurse=True):
        memo[id(b)] = torch.empty_like(b, device="meta")
    return deepcopy_module(model, memo)


def load_into(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Apply the manifest in ``path`` to ``model`` (a freshly built, unpatched instance of the saved class)
    and load the saved weights strictly; returns ``model`` in eval mode. See :func:`normswap.load`."""
    path = Path(path).expanduser()
    manifest = read_manifest(path)
    target = wrappers.held_module(model)
    if plan_of(target) is not None:
        raise NormswapError(f"{type(target).__name__} is already converted by normswap; pass a freshly built "
                            "instance of its class")
    plan = Plan.from_dict(manifest["plan"])
    safe, pickles = io.weight_files(path)
    if not safe:
        raise NormswapError(f"{path} has no safetensors weights" + (" (only pickle files)" if pickles else ""))
    entries = stream_io.scan(safe)
    check_fits(target, plan, manifest, entries)
    reader = stream_io.Reader(entries)
    try:
        state = {key: reader.get(key) for key in entries}
    finally:
        reader.close()
    for alias, key in manifest.get("aliases", {}).items():
        state[alias] = state[key]
    bases_io.load(plan, path / bases_io.SIDECAR, path)  # before apply_structure marks the edited Linears
    # nothing below can refuse: check_fits ran the same structure on a meta copy and matched every tensor
    from normswap.surgery.edits import apply_structure

    apply_structure(target, plan)
    trainer.register()  # transformers' Trainer: RMSNorm parameters are norm parameters (no weight decay)
    for name, backend in manifest.get("backends", {}).items():
        target.get_submodule(name).backend = backend
    target.load_state_dict(state, strict=True)
    model.eval()
    return model


def check_fits(model: nn.Module, plan: Plan, manifest: dict[str, Any], entries: dict[str, stream_io.Entry]) -> None:
    """Raise one line naming the first way the manifest and files do not fit ``model``; touch nothing."""
    saved = manifest.get("class", "?")
    given = class_name(model)

    def refuse(what: str) -> NormswapError:
        origin = f"saved from {saved}" + ("" if saved == given else f", given {given}")
        return NormswapError(f"the checkpoint does not fit this {type(model).__name__}: {what} ({origin})")

    from normswap import backends
    from normswap.surgery.edits import apply_structure

    modules = dict(model.named_modules(remove_duplicate=False))
    for sp in plan.sites:
        if not sp.convert:
            continue
        module = modules.get(sp.name)
        if module is None:
            raise refuse(f"no module `{sp.name}` (a {sp.class_name} the checkpoint replaced by RMSNorm)")
        if type(module).__name__ != sp.class_name:
            raise refuse(f"`{sp.name}` is a {type(module).__name__}, the checkpoint replaced a {sp.class_name}")
    for name, backend in manifest.get("backends", {}).items():
        try:
            backends.check_name(backend)
        except NormswapError as exc:
            raise refuse(f"`{name}`: {exc}") from exc
    meta = meta_copy(model)
    try:
        apply_structure(meta, plan)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        raise refuse(f"its structural edits do not apply ({first_line(exc, 200)})") from exc
    meta_modules = dict(meta.named_modules(remove_duplicate=False))
    for path, cls in manifest.get("modules", {}).items():
        if path not in meta_modules:
            raise refuse(f"no module `{path}` (a {cls} in the saved model)")
        if type(meta_modules[path]).__name__ != cls:
            raise refuse(f"`{path}` is a {type(meta_modules[path]).__name__}, the saved model has a {cls}")
    for name in manifest.get("backends", {}):
        if not isinstance(meta_modules.get(name), RMSNorm):
            raise refuse(f"no RMSNorm at `{name}` after the structural edits")
    aliases = manifest.get("aliases", {})
    stored = {k: entries[v] for k, v in aliases.items() if v in entries}
    stored.update(entries)
    state = meta.state_dict(keep_vars=True)
    for key, t in state.items():
        e = stored.get(key)
        if e is None:
            raise refuse(f"`{key}` ({_describe(tuple(t.shape))}) is not in the checkpoint")
        if e.shape != tuple(t.shape):
            raise refuse(f"`{key}` is {_describe(tuple(t.shape))} in the model, {_describe(e.shape)} in the checkpoint")
    extra = [k for k in list(entries) + list(aliases) if k not in state]
    if extra:
        raise refuse(f"the checkpoint has `{extra[0]}`, which the model lacks"
                     + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    for group in _tensor_groups(state):
        files = {aliases.get(k, k) for k in group}
        if len(files) > 1:
            a, b = group[:2]
            raise refuse(f"`{a}` and `{b}` are one tensor in the model (tied) but two in the checkpoint")


def _describe(shape: tuple[int, ...]) -> str:
    return f"shape {list(shape)}"
