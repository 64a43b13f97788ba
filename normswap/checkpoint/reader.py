"""``normswap.load``: open a checkpoint written by normswap (native or compat) as a model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from normswap.checkpoint import bases_io, hf, io, module_io, rebase, source
from normswap.errors import NormswapError
from normswap.options import TASKS, choose


def read_config(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise NormswapError(f"{path} has no config.json; is it a model directory?")
    try:
        return json.loads(cfg_path.read_text())
    except ValueError as exc:
        raise NormswapError(f"{cfg_path} is not valid JSON ({exc}); the file is corrupted") from exc


def is_normswap_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory normswap wrote: a converted transformers checkpoint (a manifest in
    its ``config.json``, or a ``normswap_*`` model type) or a custom module saved by ``normswap.save``.
    Reads one small file; a missing or unreadable one is ``False``."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return False
    if module_io.is_module_dir(path):
        return True
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and is_normswap_config(cfg)


def is_normswap_config(cfg: dict[str, Any]) -> bool:
    """Whether a ``config.json``'s content is a converted checkpoint's: a normswap manifest, or a
    ``normswap_*`` model type (the one rule for :func:`load` and :func:`is_normswap_dir`)."""
    return isinstance(cfg.get(hf.MANIFEST_KEY), dict) or hf.base_type(str(cfg.get("model_type", ""))) is not None


def model_class(cfg: dict[str, Any], task: str | type | None = None) -> type:
    """The class to instantiate for a normswap checkpoint's ``config.json`` content.

    ``task`` picks another class of the same base model, as choosing an ``AutoModelFor*`` class does
    in transformers: a task name (``"sequence-classification"``, the names of ``--task``), an
    ``AutoModel*`` class, or a transformers model class (``BertForSequenceClassification``).
    ``None``: the class the checkpoint was converted as.
    """
    manifest = cfg.get(hf.MANIFEST_KEY)
    base = hf.base_type(cfg.get("model_type", ""))
    if base is not None:
        if not isinstance(manifest, dict):
            raise NormswapError(
                f"config.json says model_type {cfg.get('model_type')!r} but has no normswap "
                "manifest; the checkpoint is incomplete"
            )
        if task is None:
            return hf.class_for_manifest(manifest)
        hf.register(base)
        return _task_class(task, hf.config_class_for(base), cfg, native_base=base)
    if task is not None:  # compat: the stock model_type, loaded by transformers' own classes
        from transformers import AutoConfig

        cfg_cls = type(AutoConfig.for_model(cfg.get("model_type", ""))) if cfg.get("model_type") else None
        return _task_class(task, cfg_cls, cfg, native_base=None)
    import transformers

    archs = cfg.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        raise NormswapError(
            "config.json names no known architecture; load it with the AutoModel class for its task"
        )
    return cls


def _task_class(task: str | type, cfg_cls: type | None, cfg: dict[str, Any], *, native_base: str | None) -> type:
    """``task`` (a name, an ``AutoModel*`` class or a model class) as the class to load with."""
    import transformers

    model_type = cfg.get("model_type", "")
    if isinstance(task, str):
        auto = getattr(transformers, TASKS[choose("task", task, TASKS)])
    elif isinstance(task, type) and hasattr(task, "_model_mapping"):
        auto = task
    elif isinstance(task, type) and issubclass(task, nn.Module):
        stock = task.__name__.removeprefix("Normswap")
        wanted = getattr(transformers, stock, None)
        expects = getattr(wanted, "config_class", None)
        if expects is None or cfg_cls is None or not issubclass(cfg_cls, expects):
            raise NormswapError(f"{task.__name__} is not a model class for model_type {model_type!r}")
        return hf.model_class_for(native_base, stock) if native_base is not None else wanted
    else:
        raise NormswapError(
            f"task must be a task name ({', '.join(TASKS)}), an AutoModel class or a model class, not {task!r}"
        )
    mapping = auto._model_mapping
    if cfg_cls is None or cfg_cls not in mapping:
        raise NormswapError(f"{auto.__name__} has no class for model_type {model_type!r}")
    return hf.one_class(mapping[cfg_cls], cfg.get("architectures"))


def load(path: str | os.PathLike, *, task: str | type | None = None, model: nn.Module | None = None,
         **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a normswap checkpoint directory (native or compat) in eval mode.

    ``path`` may also be a Hub id whose snapshot is in the local Hugging Face cache (``revision=``
    picks a branch, tag or commit); nothing is downloaded.

    Native checkpoints rebuild the base architecture on the meta device, apply the manifest's
    structural edits (no re-analysis) and load the weights; ``normswap.plan_of(model)`` returns it.
    Keyword arguments go to ``from_pretrained`` (``dtype=``, ``device_map=``, ``num_labels=``, ...).

    ``task`` loads the checkpoint as another class of its base model, as choosing an
    ``AutoModelFor*`` class does in transformers (the same as ``import normswap`` then
    ``AutoModelForSequenceClassification.from_pretrained(path)``): a ``--task`` name
    (``"base"``, ``"sequence-classification"``, ...), an ``AutoModel*`` class, or a model class.
    The manifest's edits are moved to that class's module paths; a head it lacks is ignored with
    its weights, and a head the checkpoint lacks is initialised at random with transformers'
    "newly initialized" warning. Default: the class the checkpoint was converted as.

    A directory ``normswap.save`` wrote from a custom module (not a transformers model) loads into
    ``model``, a freshly built, unpatched instance of the saved class (PEFT's
    ``from_pretrained(base_model, dir)``): the manifest's structural edits are applied to it and the
    weights loaded strictly (cast to the instance's dtypes, as ``load_state_dict`` does; build it in
    the saved dtype for outputs bitwise equal to the saved model's). A directory that does not fit
    ``model`` raises one line naming the first mismatch, and ``model`` is left as it was.

    Example:
        >>> model = normswap.load("tiny-gpt2-rms")                      # doctest: +SKIP
        >>> model.generate(**tok("hello", return_tensors="pt"))         # doctest: +SKIP
        >>> clf = normswap.load("bert-rms", task="sequence-classification", num_labels=3)  # doctest: +SKIP
        >>> net = normswap.load("net-rms", model=MyNet())               # doctest: +SKIP
    """
    spec = str(path)
    path = Path(path).expanduser()
    if not path.exists() and source.is_hub_id(spec):
        # a Hub id, as from_pretrained takes it: its snapshot in the Hugging Face cache (no download)
        cached = source.cached_snapshot(spec, from_pretrained_kwargs.pop("revision", None))
        if cached is None:
            raise NormswapError(
                f"{spec} is not a local directory, and not in the Hugging Face cache (searched "
                f"{source.hub_cache_dir()}): download it first (`hf download {spec} --local-dir DIR`)"
            )
        path = cached
    if not path.exists():
        raise NormswapError(f"{path} does not exist")
    if not path.is_dir():
        raise NormswapError(f"{path} is not a directory; normswap.load expects a checkpoint directory")
    if module_io.is_module_dir(path):
        if task is not None:
            raise NormswapError(f"{path} holds a custom module saved by normswap.save: task= is for transformers "
                                "checkpoints; pass the instance to load into, normswap.load(path, model=...)")
        return load_module(path, model, from_pretrained_kwargs)
    if model is not None:
        raise NormswapError(
            f"{path} has no {module_io.MANIFEST_FILE}, so normswap.save did not write it from a custom module; "
            "model= is only for those (a transformers checkpoint loads with normswap.load(path))")
    cfg = read_config(path)
    if not is_normswap_config(cfg):
        raise NormswapError(
            f"{path} is not a normswap checkpoint (no normswap manifest in config.json); load it "
            "with transformers.AutoModel*.from_pretrained, or convert it first with "
            f"`normswap convert {path} --out DIR`"
        )
    safe, pickles = io.weight_files(path)
    if not safe:
        raise NormswapError(
            f"{path} has no safetensors weights" + (" (only pickle files)" if pickles else "")
        )
    for f in safe:
        io.read_safetensors_header(f)
    cls = remote_code_class(cfg, task) if from_pretrained_kwargs.get("trust_remote_code") else None
    cls = cls or model_class(cfg, task)
    from_pretrained_kwargs.setdefault("local_files_only", True)
    model = cls.from_pretrained(path, **from_pretrained_kwargs)
    model.eval()
    if hf.base_type(cfg.get("model_type", "")) is None and isinstance(cfg.get(hf.MANIFEST_KEY), dict):
        from normswap.analysis.plan import Plan

        plan = cfg[hf.MANIFEST_KEY]["plan"]
        if type(model).__name__ != cfg[hf.MANIFEST_KEY].get("architecture", type(model).__name__):
            plan, _ = rebase.rebase_plan(plan, model)  # loaded as another class (task=)
        model._normswap_compat = Plan.from_dict(plan)
        from normswap.rotation import carry

        # its Linears hold the same folds as the native form's: adapters on them act as on the original
        bases_io.load(model._normswap_compat, path / bases_io.SIDECAR, path)
        carry.mark_bases(model, model._normswap_compat)
    return model


def remote_code_class(cfg: dict[str, Any], task: str | type | None) -> type | None:
    """The ``AutoModel*`` class that loads a compat checkpoint of a model with custom modeling code (its
    ``auto_map``, with ``trust_remote_code=True``): the one mapped to the class the config names, or ``None``
    for a checkpoint without custom code (or a ``task`` given: :func:`model_class` resolves it)."""
    auto_map = cfg.get("auto_map")
    archs = cfg.get("architectures") or []
    if task is not None or not isinstance(auto_map, dict) or not archs:
        return None
    import transformers

    for auto, target in auto_map.items():
        if auto.startswith("AutoModel") and str(target).rpartition(".")[2] == archs[0]:
            return getattr(transformers, auto, None)
    return None


def load_module(path: Path, model: nn.Module | None, from_pretrained_kwargs: dict[str, Any]) -> nn.Module:
    """``normswap.load`` of a directory written from a custom module: into ``model``, which must be given."""
    if model is None:
        saved = module_io.read_manifest(path)["class"]
        raise NormswapError(
            f"{path} holds a custom module ({saved}) saved by normswap.save: build a fresh instance of its class "
            f"and pass it, normswap.load(path, model={saved.rpartition('.')[2]}(...))")
    if from_pretrained_kwargs:
        raise NormswapError(
            f"normswap.load(path, model=...) takes no from_pretrained arguments ({', '.join(from_pretrained_kwargs)}); "
            "build the instance on the device and in the dtype you want")
    return module_io.load_into(model, path)
