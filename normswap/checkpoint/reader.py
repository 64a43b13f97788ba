"""``normswap.load``: open a checkpoint written by normswap (native or compat) as a model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from normswap.checkpoint import hf, io
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


def load(path: str | os.PathLike, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a normswap checkpoint directory (native or compat) in eval mode.

    Native checkpoints rebuild the base architecture on the meta device, apply the manifest's
    structural edits (no re-analysis) and load the weights; ``normswap.plan_of(model)`` returns it.
    Keyword arguments go to ``from_pretrained`` (``dtype=``, ``device_map=``, ...).

    Example:
        >>> model = normswap.load("tiny-gpt2-rms")                      # doctest: +SKIP
        >>> model.generate(**tok("hello", return_tensors="pt"))         # doctest: +SKIP
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise NormswapError(f"{path} does not exist")
    if not path.is_dir():
        raise NormswapError(f"{path} is not a directory; normswap.load expects a checkpoint directory")
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
