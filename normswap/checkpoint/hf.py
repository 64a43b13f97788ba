"""Transformers integration for converted checkpoints: one ``normswap_<base>`` type per base type.

A native checkpoint keeps the base architecture (its weights use the base's key names) and adds a
manifest. Loading it needs a config class whose ``model_type`` is new (``normswap_gpt2``), and model
classes that build the base architecture and then re-apply the manifest's *structure* (untie, swap
norms for ``normswap.RMSNorm``, install centering hooks) before the weights are loaded.

Those classes are generated for any base type on demand by :func:`config_class_for` and
:func:`model_class_for`: a subclass of the base config with the new ``model_type``, and a subclass
of each base model class whose ``__init__`` calls :func:`normswap.surgery.edits.apply_structure`. Three
ways lead to them:

* ``normswap.load(dir)`` registers the base type named in the manifest and loads.
* ``import normswap`` installs a lazy entry in transformers' config registry
  (:mod:`normswap.integrations.auto_registry`), so ``AutoModelFor*.from_pretrained(dir)`` resolves
  ``normswap_<anything>`` the first time it is seen, through :func:`register` (the classes are
  created and registered with every ``AutoModel*`` mapping that knows the base config).
* ``trust_remote_code=True`` imports the small ``modeling_normswap.py`` written next to the
  weights, which subclasses the same generated classes.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import warnings

from torch import nn

from normswap.analysis.plan import plan_of
from normswap.checkpoint import bases_io, rebase
from normswap.checkpoint.hf_types import (  # noqa: F401  (re-exported: hf.PREFIX, hf.config_class_for, ...)
    LEFT_OUT_KEY,
    MANIFEST_KEY,
    PREFIX,
    auto_classes,
    base_config_class,
    base_type,
    config_class_for,
    drop_modules,
    known_type,
    manifest_of,
    one_class,
    prefix_of,
    register_conversion_mapping,
)
from normswap.errors import NormswapError
from normswap.integrations import trainer

log = logging.getLogger("normswap")

_MODELS: dict[tuple[str, str], type] = {}
_BUILDING: contextvars.ContextVar[bool] = contextvars.ContextVar("normswap_building", default=False)


def model_class_for(base: str, class_name: str) -> type:
    """``Normswap<class_name>``: the base model class plus the manifest's structural edits."""
    key = (base, class_name)
    if key in _MODELS:
        return _MODELS[key]
    import transformers

    base_cls = getattr(transformers, class_name, None)
    if base_cls is None or not isinstance(base_cls, type) or not issubclass(base_cls, nn.Module):
        raise NormswapError(
            f"transformers has no model class {class_name!r} (needed by this checkpoint); "
            "upgrade transformers or pass the class explicitly"
        )
    cfg_cls = config_class_for(base)

    def __init__(self, config, *args, **kwargs):  # noqa: N807, ANN001
        # a head class may build its base model through AutoModel.from_config (v5's generic sequence
        # classifiers), which gives a Normswap base model too: only the outermost one applies the
        # manifest, once, to the whole model
        outer = not _BUILDING.get()
        token = _BUILDING.set(True)
        try:
            base_cls.__init__(self, config, *args, **kwargs)
        finally:
            _BUILDING.reset(token)
        manifest = manifest_of(config)
        if manifest is not None and outer:
            rebuild(self, manifest)

    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):  # noqa: ANN001, ANN202, N805
        """The base class's ``from_pretrained``, then the online Hadamards put back on the modules a
        ``quantization_config`` swapped in for their Linears (their values read from the checkpoint), and the
        model refused if one is still missing (:func:`normswap.rotation.carry.after_load`)."""
        out = super(_MODELS[key], cls).from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        loaded = out[0] if isinstance(out, tuple) else out
        from normswap.rotation import carry

        carry.after_load(loaded, lambda: _weight_files(pretrained_model_name_or_path, kwargs))
        _load_adapter_bases(loaded, pretrained_model_name_or_path, kwargs)
        return out

    def save_pretrained(self, save_directory, *args, **kwargs):  # noqa: ANN001, ANN202
        """``save_pretrained`` that writes a complete native checkpoint (also used by ``Trainer``):
        aliases loading will not re-tie are stored, and the modeling file and ``auto_map`` are added. A model
        that lost an online Hadamard to a module swap is refused before anything is written."""
        from pathlib import Path

        from normswap.checkpoint import writer
        from normswap.rotation import carry

        carry.check_online_ops(self)
        if kwargs.get("state_dict") is None:
            kwargs["state_dict"] = writer.state_dict_for_save(self)
        result = base_cls.save_pretrained(self, save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True) and not (args and args[0] is False):
            writer.finish_native_dir(self, Path(save_directory))
        return result

    name = f"Normswap{class_name}"
    cls = type(
        name,
        (base_cls,),
        {
            "config_class": cfg_cls,
            "__init__": __init__,
            "from_pretrained": classmethod(from_pretrained),
            "save_pretrained": save_pretrained,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"{class_name} rebuilt with normswap.RMSNorm from a converted checkpoint's manifest.",
        },
    )
    setattr(sys.modules[__name__], name, cls)
    _MODELS[key] = cls
    register_conversion_mapping(name, class_name)
    return cls


def _quiet_online_keys(model: nn.Module) -> None:
    """Where a ``quantization_config`` replaces the Linears before the weights load, their online Hadamards'
    tensors find no module to load into and transformers would list them as unexpected keys; the loader reads
    them itself and puts the ops back (:func:`normswap.rotation.carry.after_load`), so they are not reported."""
    from normswap.rotation import carry

    if carry.held_ops(model):
        ignored = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
        model._keys_to_ignore_on_load_unexpected = ignored | {rf"(^|\.){carry.BUFFER_PREFIX}[a-z_]*$"}


def _weight_files(spec: object, kwargs: dict) -> list[str]:
    """The safetensors files ``from_pretrained(spec, **kwargs)`` loaded, found as transformers finds them (a
    local directory, or a Hub id's snapshot in the Hugging Face cache; ``revision=``, ``subfolder=``), offline."""
    import json

    from transformers.utils import cached_file

    if spec is None:
        raise NormswapError("the online Hadamards' values are in no file (the model was loaded from a state_dict); "
                            "load it from its checkpoint directory")
    where = {"subfolder": kwargs.get("subfolder") or "", "revision": kwargs.get("revision"),
             "local_files_only": True, "_raise_exceptions_for_missing_entries": False}
    single = cached_file(str(spec), "model.safetensors", **where)
    if single is not None:
        return [single]
    index = cached_file(str(spec), "model.safetensors.index.json", **where)
    if index is None:
        raise NormswapError(f"cannot find the safetensors files of {spec} to read its online Hadamards from")
    with open(index) as fh:
        shards = sorted(set(json.load(fh)["weight_map"].values()))
    return [cached_file(str(spec), shard, **where) for shard in shards]


def _load_adapter_bases(model: nn.Module, spec: object, kwargs: dict) -> None:
    """Read the adapter bases' vectors of the checkpoint ``spec`` (its side file, found as transformers finds
    its files) into the loaded model's plan and mark its edited Linears with them
    (:mod:`normswap.checkpoint.bases_io`; no side file: one warning, adapters there refused at attach)."""
    from transformers.utils import cached_file

    from normswap.rotation import carry

    plan = plan_of(model)
    if plan is None or not bases_io.named(plan):
        return
    found = None
    if spec is not None:  # a local directory, or the Hub (fetched as from_pretrained fetched the weights)
        where = {k: kwargs[k] for k in ("cache_dir", "token", "revision", "local_files_only", "proxies")
                 if kwargs.get(k) is not None}
        found = cached_file(str(spec), bases_io.SIDECAR, subfolder=kwargs.get("subfolder") or "", **where,
                            _raise_exceptions_for_missing_entries=False,
                            _raise_exceptions_for_connection_errors=False)
    bases_io.load(plan, found, spec if spec is not None else "a model loaded from a state_dict")
    carry.mark_bases(model, plan)


# ------------------------------------------------------------------------------ structure on load
def rebuild(model: nn.Module, manifest: dict) -> nn.Module:
    """Apply a manifest's structural edits to a freshly built base model (meta device is fine).

    A checkpoint converted as one class may be built as another of the same base model (``AutoModel``
    on a masked-LM checkpoint, a classifier on a causal LM): the manifest's paths are moved to this
    class first (:mod:`normswap.checkpoint.rebase`, transformers' own key mapping), edits in a head it
    lacks are dropped as that head's weights are, and a warning says what a kept norm's output lacks
    where the conversion folded part of it into such a head, or where this class ties its output head
    to an input embedding the conversion centered.
    """
    from normswap.analysis.plan import Plan
    from normswap.surgery.edits import apply_structure

    plan_dict = manifest["plan"]
    saved_class = manifest.get("architecture")
    other = bool(saved_class) and type(model).__name__ not in (saved_class, f"Normswap{saved_class}")
    pmap = rebase.PathMap(model)
    left_out = [m for m in (pmap(p) for p in manifest.get(LEFT_OUT_KEY) or ()) if m is not None]
    lost: list[str] = []
    if other:
        moved, lost = rebase.rebase_plan(plan_dict, model)
        gone = rebase.dropped(plan_dict, moved)
        if gone:
            log.info("normswap: %s has no module for %s of the manifest of %s (a head it lacks): ignored",
                     type(model).__name__, ", ".join(f"{n} {k}" for k, n in sorted(gone.items())), saved_class)
        plan_dict = moved
    try:
        plan = Plan.from_dict(plan_dict)
        # modules the source checkpoint had no tensors for and its pipeline never used: absent again
        drop_modules(model, left_out)
        apply_structure(model, plan, backend=manifest.get("backend", "auto"))
        _quiet_online_keys(model)
        trainer.register()  # transformers' Trainer: RMSNorm parameters are norm parameters (no weight decay)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise NormswapError(
            f"the normswap manifest does not match {type(model).__name__} ({exc}); "
            "was the checkpoint edited by hand?"
        ) from exc
    if other:
        name = type(model).__name__.removeprefix("Normswap")
        if lost:
            warnings.warn(
                f"normswap: this checkpoint was converted as {saved_class} and folded part of a norm into "
                f"its head; as {name}: {'; '.join(lost)}. That norm's output (e.g. last_hidden_state) "
                f"differs from the stock model's by that fold; convert the model as {name} (--task) to keep "
                "it exact",
                stacklevel=2,
            )
        for head, embedding in rebase.tied_to_centered(model, plan):
            warnings.warn(
                f"normswap: {name} ties `{head}` to `{embedding}`, which this checkpoint (converted as "
                f"{saved_class}, without that head) centered: the head's outputs differ from the stock "
                f"model's; convert the model as {name} (--task) to keep them exact",
                stacklevel=2,
            )
    return model


# ------------------------------------------------------------------------------ auto registration
def register(base: str) -> type:
    """Register ``normswap_<base>`` with ``AutoConfig`` and with every ``AutoModel*`` that knows ``base``.

    Returns the config class. Idempotent; called lazily by transformers' registry once
    ``import normswap`` has run, and explicitly by :func:`normswap.load`.
    """
    from transformers import AutoConfig

    new_type = PREFIX + base
    cfg_cls = config_class_for(base)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if dict.get(CONFIG_MAPPING._extra_content, new_type) is not cfg_cls:
        AutoConfig.register(new_type, cfg_cls, exist_ok=True)
    base_cfg = base_config_class(base)
    for auto in auto_classes():
        mapping = auto._model_mapping
        try:
            if base_cfg not in mapping or cfg_cls in mapping._extra_content:
                continue
            target = mapping[base_cfg]
        except Exception:  # noqa: BLE001 - a mapping whose module fails to import is not ours to fix
            continue
        if isinstance(target, type):
            mapping.register(cfg_cls, model_class_for(base, target.__name__), exist_ok=True)
        elif isinstance(target, (tuple, list)) and target and all(isinstance(t, type) for t in target):
            # several classes for one config (DeiT's classifier with and without its teacher): transformers
            # picks the one config.architectures names, which for a converted checkpoint is Normswap<Class>
            mapping.register(cfg_cls, tuple(model_class_for(base, t.__name__) for t in target), exist_ok=True)
    return cfg_cls


def class_for_manifest(manifest: dict) -> type:
    """The generated model class a manifest was saved from."""
    base = manifest.get("base_model_type")
    arch = manifest.get("architecture")
    if not base or not arch:
        raise NormswapError(
            "the normswap manifest lacks base_model_type/architecture; re-run normswap convert"
        )
    register(base)
    return model_class_for(base, arch)
