"""``normswap.load``: open a checkpoint written by normswap (native or compat) as a model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from normswap.checkpoint import hf, io, module_io
from normswap.errors import NormswapError


def read_config(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise NormswapError(f"{path} has no config.json; is it a model directory?")
    try:
        return json.loads(cfg_path.read_text())
    except ValueError as exc:
        raise NormswapError(f"{cfg_path} is not valid JSON ({exc}); the file is corrupted") from exc


def model_class(cfg: dict[str, Any]) -> type:
    """The class to instantiate for a normswap checkpoint's ``config.json`` content."""
    manifest = cfg.get(hf.MANIFEST_KEY)
    base = hf.base_type(cfg.get("model_type", ""))
    if base is not None:
        if not isinstance(manifest, dict):
            raise NormswapError(
                f"config.json says model_type {cfg.get('model_type')!r} but has no normswap "
                "manifest; the checkpoint is incomplete"
            )
        return hf.class_for_manifest(manifest)
    import transformers

    archs = cfg.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        raise NormswapError(
            "config.json names no known architecture; load it with the AutoModel class for its task"
        )
    return cls


def load(path: str | os.PathLike, *, model: nn.Module | None = None, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a normswap checkpoint directory (native or compat) in eval mode.

    Native checkpoints rebuild the base architecture on the meta device, apply the manifest's
    structural edits (no re-analysis) and load the weights; ``normswap.plan_of(model)`` returns it.
    Keyword arguments go to ``from_pretrained`` (``dtype=``, ``device_map=``, ...).

    A directory ``normswap.save`` wrote from a custom module (not a transformers model) loads into
    ``model``, a freshly built, unpatched instance of the saved class (PEFT's
    ``from_pretrained(base_model, dir)``): the manifest's structural edits are applied to it and the
    weights loaded strictly (cast to the instance's dtypes, as ``load_state_dict`` does; build it in
    the saved dtype for outputs bitwise equal to the saved model's). A directory that does not fit
    ``model`` raises one line naming the first mismatch, and ``model`` is left as it was.

    Example:
        >>> model = normswap.load("tiny-gpt2-rms")                      # doctest: +SKIP
        >>> model.generate(**tok("hello", return_tensors="pt"))         # doctest: +SKIP
        >>> net = normswap.load("net-rms", model=MyNet())               # doctest: +SKIP
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise NormswapError(f"{path} does not exist")
    if not path.is_dir():
        raise NormswapError(f"{path} is not a directory; normswap.load expects a checkpoint directory")
    if module_io.is_module_dir(path):
        return load_module(path, model, from_pretrained_kwargs)
    if model is not None:
        raise NormswapError(
            f"{path} has no {module_io.MANIFEST_FILE}, so normswap.save did not write it from a custom module; "
            "model= is only for those (a transformers checkpoint loads with normswap.load(path))")
    cfg = read_config(path)
    if not isinstance(cfg.get(hf.MANIFEST_KEY), dict) and hf.base_type(cfg.get("model_type", "")) is None:
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
    cls = model_class(cfg)
    from_pretrained_kwargs.setdefault("local_files_only", True)
    model = cls.from_pretrained(path, **from_pretrained_kwargs)
    model.eval()
    if hf.base_type(cfg.get("model_type", "")) is None and isinstance(cfg.get(hf.MANIFEST_KEY), dict):
        from normswap.plan import Plan

        model._normswap_compat = Plan.from_dict(cfg[hf.MANIFEST_KEY]["plan"])
    return model


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
