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


def _overlap(out: Path, key: str, value: str | None) -> str | None:
    """Why the run must not write to ``out`` given the input ``value`` (config key ``key``), or None.

    The run writes ``out`` itself (only to create it) and, inside it, the paths of ``RUN_FILES`` and
    ``RUN_SIDE_FILES`` (``output.overwrite`` removes the first ones before it starts; ``checkpoint.resume``
    and the end of the run write into ``checkpoints/`` and ``model/``). An input clashes when ``out``
    equals it or lies inside it (the run's files would mix into the model's own), or when one of those
    written paths equals it or contains it (a model kept at ``out/model`` or ``out/checkpoints/step-2``
    would be replaced or written over). An input elsewhere under ``out`` (``out/teacher``) is no clash: the
    run neither removes nor writes anything there. Symlinks are resolved on both sides. A preset name or a
    Hub id (no local path) never clashes."""
    if not value:
        return None
    given = Path(value).expanduser()
    if not given.exists():
        return None
    src, dst = given.resolve(), out.resolve()
    if dst == src or src in dst.parents:
        return (f"config key `output.dir`: {str(out)!r} is {key}'s directory {value!r} or inside it; the run would "
                "write into the model's own files: choose another output.dir")
    for name in RUN_FILES + RUN_SIDE_FILES:
        written = (out / name).resolve()
        if src == written or written in src.parents:
            return (f"config key `output.dir`: the run writes {str(out / name)!r}, which is or holds {key} "
                    f"({value!r}); it would replace or write over it: choose another output.dir, or move {key}")
    return None


def check_output(cfg: Any) -> tuple[Path, Path | None, list[Path]]:
    """The output directory, the checkpoint to resume from (if any) and what ``output.overwrite`` replaces.

    Raises :class:`~normswap.errors.UsageError` (exit 2), writing nothing, when ``output.dir`` is a file,
    equals or lies in a model directory or data set the recipe reads, would write (or replace) a path that
    is or holds one (see :func:`_overlap`), holds a run and neither ``checkpoint.resume`` (with a
    checkpoint to resume from) nor ``output.overwrite`` was set, or holds other files and
    ``output.overwrite`` was not set. ``cfg``: a :class:`~normswap.recipes.config.RecipeConfig`."""
    out = Path(cfg.output.dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"config key `output.dir`: {str(out)!r} is a file; give a directory to write the run to")
    inputs = [(f"model.{key}", getattr(cfg.model, key)) for key in ("source", "student", "tokenizer")]
    for key, value in [*inputs, ("data.path", cfg.data.path)]:
        clash = _overlap(out, key, value)
        if clash is not None:
            raise UsageError(clash)
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
