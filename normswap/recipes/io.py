"""Reading and writing converted directories, and rotating training checkpoints.

The final model is written with ``normswap.checkpoint.save`` (the same format as ``normswap
convert``) and read back with ``normswap.load``. Until that module is importable, a fallback
writes ``save_pretrained`` output plus ``normswap_manifest.json`` (the plan and the recipe's
extras) and reads it back by rebuilding the structure from the manifest, so recipes and their
tests work either way. ``saved_with`` in the returned info says which path was taken.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.errors import NormswapError

FALLBACK_MANIFEST = "normswap_manifest.json"


def _checkpoint_api() -> tuple[Any, Any] | None:
    """``(save, load)`` from normswap's checkpoint module, or None while it does not exist."""
    try:
        import normswap
        from normswap import checkpoint
    except ImportError:
        return None
    save = getattr(checkpoint, "save", None)
    load = getattr(normswap, "load", None) or getattr(checkpoint, "load", None)
    if save is None or load is None:
        return None
    return save, load


def save_converted(
    model: nn.Module,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    fmt: str = "native",
    manifest_extra: dict[str, Any] | None = None,
) -> str:
    """Write the converted ``model`` (and tokenizer) to ``out_dir``; returns how it was saved."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    split_stale_ties(model)
    api = _checkpoint_api()
    if api is not None:
        api[0](model, str(out), format=fmt, manifest_extra=manifest_extra)
        how = "normswap.checkpoint"
    else:
        if fmt != "native":
            raise NormswapError(
                "config key `output.format`: only 'native' is available until "
                "normswap.checkpoint is installed"
            )
        model.save_pretrained(str(out), safe_serialization=True)
        plan = getattr(model, "_normswap_plan", None)
        manifest = {
            "format": "normswap-fallback/1",
            "class": type(model).__name__,
            "plan": plan.to_dict() if plan is not None else None,
            **(manifest_extra or {}),
        }
        (out / FALLBACK_MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
        how = "fallback"
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return how


def split_stale_ties(model: nn.Module) -> list[str]:
    """Give each name its own tensor where a tie survives in memory but not on reload.

    ``patch(untie=True)`` sets ``tie_word_embeddings=False`` after cloning the output head, but
    other parameters transformers ties under the same flag stay shared in memory (BERT's
    ``cls.predictions.decoder.bias`` *is* ``cls.predictions.bias``). ``save_pretrained`` writes one
    of the two names and, with the flag off, loading does not re-tie the other: it comes back
    randomly initialised. Cloning the shared tensor for the second name makes the saved directory
    reload to the same function. Ties the config still declares (``untie=False``) are left alone.
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "tie_word_embeddings", True):
        return []
    seen: dict[int, str] = {}
    split = []
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if id(param) not in seen:
            seen[id(param)] = name
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_path) if owner_path else model
        setattr(owner, attr, nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))
        split.append(name)
    return split


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a converted directory (from either saver)."""
    p = Path(path)
    if (p / FALLBACK_MANIFEST).is_file():
        return json.loads((p / FALLBACK_MANIFEST).read_text())
    cfg = p / "config.json"
    if cfg.is_file():
        section = json.loads(cfg.read_text()).get("normswap")
        if isinstance(section, dict):
            return section
    for name in ("normswap_manifest.json", "manifest.json"):
        if (p / name).is_file():
            return json.loads((p / name).read_text())
    raise NormswapError(f"{str(p)!r} has no normswap manifest; is it a converted directory?")


def load_converted(path: str | Path, task: str | None = None, **kwargs: Any) -> nn.Module:
    """Load a converted directory: ``normswap.load`` when available, else the fallback format."""
    p = Path(path)
    if not (p / FALLBACK_MANIFEST).is_file():
        api = _checkpoint_api()
        if api is None:
            raise NormswapError(
                f"config key `model.student`: {str(p)!r} is not a converted directory this "
                "normswap can read (no normswap_manifest.json, and normswap.load is missing)"
            )
        return api[1](str(p), **{k: v for k, v in kwargs.items() if v is not None})
    from normswap.plan import Plan
    from normswap.recipes.models import auto_class
    from normswap.surgery import apply_structure

    manifest = read_manifest(p)
    import transformers as tf

    cls = getattr(tf, manifest.get("class", ""), None) or auto_class(task or "causal-lm")
    dtype = kwargs.get("dtype")
    model = cls.from_pretrained(str(p), local_files_only=True, **({"dtype": dtype} if dtype else {}))
    if manifest.get("plan"):
        apply_structure(model, Plan.from_dict(manifest["plan"]))
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for f in sorted(p.glob("*.safetensors")):
            state.update(load_file(str(f)))
        missing, unexpected = model.load_state_dict(state, strict=False)
        rms = {n for n, _ in model.named_parameters()}
        lost = [k for k in missing if k in rms and not _is_tied(model, k)]
        if lost:
            raise NormswapError(f"{str(p)!r}: weights missing for {lost[0]} (and {len(lost) - 1} more)")
    model.eval()
    return model


def _is_tied(model: nn.Module, name: str) -> bool:
    param = model.get_parameter(name)
    return sum(1 for _, p in model.named_parameters(remove_duplicate=False) if p is param) > 1


# ---------------------------------------------------------------------------------- rotation
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``root``, oldest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    found = []
    for child in r.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / "trainer_state.json").is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def prune_checkpoints(root: str | Path, keep_last: int) -> None:
    for _, path in checkpoint_dirs(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
