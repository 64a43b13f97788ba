"""A recipe's output directory: may this run write there, and does it resume a run? Torch-free, so that
``normswap finetune`` answers before the heavy imports, as ``convert`` checks ``--out``.

A refusal is a usage error (exit 2): the command line (``output.dir``, ``checkpoint.resume``,
``output.overwrite``) does not fit what is on disk, and nothing has been touched.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from normswap.errors import UsageError

STEP_DIR = re.compile(r"^step-(\d+)$")
# what a run writes into output.dir; recipe.yaml and curves.png alone are no run to protect (a run
# interrupted before its first record leaves recipe.yaml, and rerunning it must not be refused)
RUN_FILES = ("metrics.jsonl", "checkpoints", "model")
RUN_SIDE_FILES = ("recipe.yaml", "curves.png")


def checkpoint_dirs(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``root`` (one with its ``trainer_state.json``),
    oldest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    found = []
    for child in r.iterdir():
        m = STEP_DIR.match(child.name)
        if m and (child / "trainer_state.json").is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def _inside(path: Path, model: str | None) -> str | None:
    """``model`` when it is a local directory that ``path`` equals or lies inside (writing there would mix
    the run's files into the model's own)."""
    if not model or not Path(model).expanduser().is_dir():
        return None
    src, dst = Path(model).expanduser().resolve(), path.resolve()
    return model if dst == src or src in dst.parents else None


def check_output(cfg: Any) -> tuple[Path, Path | None, list[Path]]:
    """The output directory, the checkpoint to resume from (if any) and what ``output.overwrite`` replaces.

    Raises :class:`~normswap.errors.UsageError` (exit 2), writing nothing, when ``output.dir`` is a file,
    lies in a model directory the recipe reads, holds a run and neither ``checkpoint.resume`` (with a
    checkpoint to resume from) nor ``output.overwrite`` was set, or holds other files and
    ``output.overwrite`` was not set. ``cfg``: a :class:`~normswap.recipes.config.RecipeConfig`."""
    out = Path(cfg.output.dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"config key `output.dir`: {str(out)!r} is a file; give a directory to write the run to")
    for key in ("source", "student", "tokenizer"):
        model = _inside(out, getattr(cfg.model, key))
        if model is not None:
            raise UsageError(f"config key `output.dir`: {str(out)!r} is model.{key}'s directory {model!r} or inside "
                             "it; the run would write into the model's own files: choose another output.dir")
    ckpt_root = out / "checkpoints"
    done = checkpoint_dirs(ckpt_root) if cfg.checkpoint.resume else []
    latest = done[-1][1] if done else None
    existing = [out / name for name in RUN_FILES if (out / name).exists()]
    if latest is None and existing and not cfg.output.overwrite:
        if cfg.checkpoint.resume:
            raise UsageError(
                f"config key `checkpoint.resume`: {str(ckpt_root)!r} holds no checkpoint to resume "
                "from; set output.overwrite=true to start the run again"
            )
        raise UsageError(
            f"config key `output.dir`: {str(out)!r} already holds a run ({existing[0].name}); "
            "set checkpoint.resume=true to continue it or output.overwrite=true to replace it"
        )
    others = sorted(p.name for p in out.iterdir() if p.name not in RUN_FILES + RUN_SIDE_FILES) \
        if out.is_dir() else []
    if others and latest is None and not cfg.output.overwrite:
        shown = ", ".join(others[:3]) + (" ..." if len(others) > 3 else "")
        raise UsageError(f"config key `output.dir`: {str(out)!r} exists and is not empty ({shown}); choose a new "
                         "directory, or set output.overwrite=true to write the run beside those files")
    return out, latest, existing if latest is None else []
