"""Reading and writing converted directories, and rotating training checkpoints.

The final model is written with ``normswap.checkpoint.save`` (the same format as ``normswap
convert``) and read back with ``normswap.checkpoint.load`` (``normswap.load``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from normswap import checkpoint
from normswap.errors import NormswapError
from normswap.recipes.outdir import checkpoint_dirs


def save_converted(
    model: nn.Module,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    fmt: str = "native",
    manifest_extra: dict[str, Any] | None = None,
    source: str | None = None,
    card_section: list[str] | None = None,
) -> str:
    """Write the converted ``model`` (and tokenizer) to ``out_dir``; returns how it was saved.

    ``source`` (the original model's path or preset) is recorded in the manifest and names the model
    in its card (README.md), whose title is then the source's name, not the directory's (a recipe's
    is always ``model``); ``card_section`` lines are appended to the card (the run's figures)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    split_stale_ties(model)
    checkpoint.save(model, str(out), format=fmt, manifest_extra=manifest_extra, source=source)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    card = out / "README.md"
    if card.is_file() and (source or card_section):
        lines = card.read_text().splitlines()
        if source:
            title = next((i for i, line in enumerate(lines) if line.startswith("# ")), None)
            if title is not None:
                lines[title] = f"# {Path(source).name} (RMSNorm, distilled)"
        card.write_text("\n".join([*lines, *([""] + card_section if card_section else [])]) + "\n")
    return "normswap.checkpoint"


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
    """The manifest of a converted directory."""
    p = Path(path)
    cfg = p / "config.json"
    if cfg.is_file():
        section = json.loads(cfg.read_text()).get("normswap")
        if isinstance(section, dict):
            return section
    raise NormswapError(f"{str(p)!r} has no normswap manifest; is it a converted directory?")


def load_converted(path: str | Path, model_class: type | None = None, **kwargs: Any) -> nn.Module:
    """Load a converted directory with ``normswap.checkpoint.load``, as ``model_class`` (an ``AutoModel*``
    class: a causal LM's directory loads as its base model for the encoder task) or, when None, as the
    class the manifest names."""
    return checkpoint.load(str(path), task=model_class, **{k: v for k, v in kwargs.items() if v is not None})


# ---------------------------------------------------------------------------------- rotation
# checkpoint_dirs (the complete checkpoints under a directory) lives in the torch-free outdir module
def prune_checkpoints(root: str | Path, keep_last: int) -> None:
    for _, path in checkpoint_dirs(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
