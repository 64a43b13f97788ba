"""File-level helpers: atomic output directories, shard sizes, safetensors checks, side files.

Nothing here knows about models; it is the part of checkpoint writing that must be boring and
safe: a conversion writes into a hidden temporary directory *beside* the destination and renames
it into place at the very end, so an interrupted or failed run leaves no partial output and never
touches what the user already has.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import struct
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from normswap.errors import DiskFull, NormswapError

TMP_MARK = ".normswap-tmp-"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


# ------------------------------------------------------------------------------------ sizes
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(value: int | str) -> int:
    """``"500MB"`` / ``"2GB"`` / ``"1.5GiB"`` / ``1000000`` -> bytes (HF's decimal convention for GB)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise NormswapError(f"max shard size must be positive, not {value}")
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        raise NormswapError(f"invalid size {value!r}: use a number with a unit, e.g. 500MB, 2GB or 1.5GiB")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise NormswapError(f"size must be positive, not {value!r}")
    return size


def human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.2f} TB"


# ------------------------------------------------------------------------------------ output dirs
def _dangerous(out: Path) -> str | None:
    resolved = out.resolve()
    home = Path.home().resolve()
    if resolved == Path(resolved.anchor) or resolved == home:
        return "it is the filesystem root or your home directory"
    cwd = Path.cwd().resolve()
    if cwd == resolved or resolved in cwd.parents:
        return "it contains the current working directory"
    if (resolved / ".git").exists():
        return "it is a git checkout"
    return None


def check_destination(out: str | os.PathLike, *, overwrite: bool, source: Path | None = None) -> Path:
    """Refuse destinations we must not write: non-empty without ``overwrite``, the source itself,
    a parent of the working directory, a file, or a place we cannot write. Nothing is created."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise NormswapError(f"--out {out} exists and is not a directory; choose another path")
    if source is not None:
        src = source.resolve()
        dst = out.resolve()
        if dst == src or dst in src.parents or src in dst.parents:
            raise NormswapError(f"--out {out} overlaps the source model at {source}; write somewhere else")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise NormswapError(
                f"--out {out} exists and is not empty; pass --overwrite to replace it, "
                "or choose a new directory"
            )
        why = _dangerous(out)
        if why:
            raise NormswapError(f"refusing to overwrite {out}: {why}")
    parent = _existing_parent(out)
    if not parent.is_dir():
        raise NormswapError(f"cannot create --out {out}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise NormswapError(f"cannot write to {parent} (permission denied); choose a writable --out")
    return out


def _existing_parent(out: Path) -> Path:
    parent = out.resolve().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def available_memory() -> int:
    """Bytes of RAM available now (8 GB when psutil cannot tell)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001
        return 8 << 30


def free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(_existing_parent(path / "x")).free
    except OSError:
        return 1 << 62


def check_space(out: Path, needed: int) -> int:
    """Fail early, before writing anything, when the destination's filesystem is too small.

    Returns ``needed`` so the caller can hand it to :func:`atomic_directory` for the message a
    full disk gives later (the estimate is not exact: another process may fill the disk meanwhile).
    """
    free = free_bytes(out)
    if needed > 0 and free < needed * 1.05 + (16 << 20):
        raise disk_full(out, needed, free)
    return needed


def disk_full(out: Path, needed: int | None, free: int | None = None) -> DiskFull:
    """``disk full: needed ~X GB, Y GB free at PATH`` (one line, the same wording early or late)."""
    where = _existing_parent(Path(out))
    free = free_bytes(Path(out)) if free is None else free
    need = f"needed ~{human(needed)}, " if needed else ""
    return DiskFull(
        f"disk full: {need}{human(free)} free at {where}; nothing was written. Free some space "
        "or choose another --out"
    )


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname() or "host")[:40]


def _owner() -> str:
    """``host.pid`` of this process: a later run can tell whether a temp dir's writer is gone."""
    return f"{_host()}.{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's process: leave its directory alone
    return True


def clean_stale(parent: Path, name: str) -> list[Path]:
    """Remove temporary directories for ``name`` in ``parent`` left by a killed run.

    Only directories created on this host by a process that no longer exists are removed (a
    SIGKILL or a power cut skips every cleanup); each removal is announced with a warning.
    """
    removed: list[Path] = []
    pattern = re.compile(re.escape(f".{name}{TMP_MARK}") + r"(?P<host>[A-Za-z0-9_.]+)\.(?P<pid>\d+)-")
    with contextlib.suppress(OSError):
        for d in parent.iterdir():
            m = pattern.match(d.name)
            if not m or not d.is_dir() or m["host"] != _host() or _alive(int(m["pid"])):
                continue
            shutil.rmtree(d, ignore_errors=True)
            if not d.exists():
                removed.append(d)
                warnings.warn(
                    f"normswap: removed {d}, a temporary directory left by an interrupted run "
                    f"(process {m['pid']} no longer exists)",
                    stacklevel=2,
                )
    return removed


def untie_note(count: int, params: int, extra: int, total: int) -> str:
    """The convert summary's line about untying: how much bigger, and how to avoid it."""
    pct = 100 * extra / max(1, total - extra)
    return (
        f"untied {count} tied weight(s): +{params:,} parameters, +{human(extra)} on disk "
        f"(+{pct:.0f}%); --no-untie keeps the tie instead (also exact: one centering op per token)"
    )


@contextlib.contextmanager
def atomic_directory(out: Path, *, overwrite: bool, needed: int | None = None) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``out``; on success rename it to ``out``.

    On any exception (including KeyboardInterrupt) the temporary directory is removed and ``out``
    is left exactly as it was. With ``overwrite`` an existing ``out`` is moved aside, replaced,
    and deleted only after the new directory is in place.
    """
    out = Path(out).expanduser()
    parent = out.resolve().parent
    created = parent  # the outermost directory this call creates (removed again on failure)
    while not created.parent.exists() and created.parent != created:
        created = created.parent
    created = created if not created.exists() else None

    def cleanup(tmp: Path | None) -> None:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)

    try:
        parent.mkdir(parents=True, exist_ok=True)
        clean_stale(parent, out.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}{TMP_MARK}{_owner()}-", dir=parent))
    except OSError as exc:
        cleanup(None)
        raise NormswapError(
            f"cannot create the output directory next to {out}: {exc.strerror or exc}"
        ) from exc
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        _move_into_place(tmp, out, overwrite=overwrite)
    except OSError as exc:
        cleanup(tmp)
        raise os_error(exc, out, needed=needed) from exc
    except BaseException:
        cleanup(tmp)
        raise


def _move_into_place(tmp: Path, out: Path, *, overwrite: bool) -> None:
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if out.exists():
        if not overwrite:  # appeared while we were converting
            raise NormswapError(f"--out {out} appeared during the conversion; result discarded")
        old = out.parent / f".{out.name}{TMP_MARK}{_owner()}-old"
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def os_error(exc: OSError, where: Path | str, *, needed: int | None = None) -> NormswapError:
    """One actionable line for an I/O failure while writing."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return disk_full(Path(where), needed)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return NormswapError(f"cannot write {where} ({exc.strerror}); choose a writable --out")
    return NormswapError(f"I/O error on {where}: {exc.strerror or exc}")


# ------------------------------------------------------------------------------------ safetensors
def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Parse and sanity-check a safetensors header without loading tensors (no pickle, ever)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 << 20):
                raise ValueError("header length points past the end of the file")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise NormswapError(
            f"{path} is not a valid safetensors file ({exc}); the download may be "
            "truncated or corrupted: fetch it again"
        ) from exc
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise NormswapError(
                f"{path} has a malformed safetensors header (tensor {key!r}); fetch the file again"
            ) from exc
    if 8 + n + end > size:
        raise NormswapError(
            f"{path} is truncated ({human(size)} on disk, header describes "
            f"{human(8 + n + end)}); fetch the file again"
        )
    return header


def weight_files(model_dir: Path) -> tuple[list[Path], list[Path]]:
    """(safetensors files, pickle-format files) of a local model directory."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise NormswapError(f"{index} is not a valid index file ({exc}); fetch it again") from exc
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise NormswapError(
                f"{model_dir} is missing shard(s) {', '.join(missing[:3])} listed in "
                f"{index.name}; the download is incomplete"
            )
        safe = files
    else:
        safe = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    pickles = sorted(p for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    return safe, pickles


def checkpoint_bytes(model_dir: Path) -> int:
    safe, pickles = weight_files(model_dir)
    return sum(p.stat().st_size for p in (safe or pickles))


# ------------------------------------------------------------------------------------ side files
# root-level files that are weights of the model being converted (rewritten, never copied), and
# exports of the unconverted weights in other formats (they would be stale, so they are dropped)
_WEIGHT_SUFFIXES = (".safetensors", ".h5", ".msgpack", ".ot", ".gguf", ".onnx", ".tflite", *PICKLE_SUFFIXES)
_WEIGHT_INDEXES = (".safetensors.index.json", ".bin.index.json", ".pt.index.json")
_STALE_DIRS = ("onnx", "openvino", "coreml", "tflite")
CARD_MARK = "<!-- normswap conversion -->"


def _is_weight(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name.endswith(_WEIGHT_INDEXES)


def copy_side_files(src: Path | None, dst: Path) -> list[str]:
    """Copy every file of the source directory that is not a weight of the converted model.

    Tokenizers, processors, generation configs, chat templates, sentence-transformers'
    ``modules.json`` / ``1_Pooling/`` / ``2_Normalize/`` (subdirectories whole: they hold other
    modules, not the converted one), licences, ``*.md`` / ``*.txt`` / ``*.json``. Never copied:
    ``config.json`` (rewritten), the root's weights and weight indexes, exports of the unconverted
    weights (``onnx/``, ``openvino/``, ...), hidden files. A file the conversion already wrote
    wins, except ``README.md``: the source's card becomes the body and the conversion's card is
    kept as a section of it (:func:`merge_card`).
    """
    copied: list[str] = []
    if src is None or not src.is_dir():
        return copied
    for f in sorted(src.iterdir()):
        name = f.name
        if name.startswith(".") or name == "config.json" or (f.is_file() and _is_weight(name)):
            continue
        target = dst / name
        if f.is_dir():
            if name in _STALE_DIRS or target.exists():
                continue
            shutil.copytree(f, target, ignore=shutil.ignore_patterns(".*"))
        elif name == "README.md" and target.is_file():
            target.write_text(merge_card(f.read_text(errors="replace"), target.read_text()))
        elif not target.exists():
            shutil.copy2(f, target)
        else:
            continue
        copied.append(name)
    return copied


def _split_front_matter(text: str) -> tuple[list[str], str]:
    """(YAML front-matter lines without the ``---`` fences, body) of a model card."""
    lines = text.splitlines()
    if lines and lines[0].strip() == "---":
        for i in range(1, len(lines)):
            if lines[i].strip() == "---":
                return lines[1:i], "\n".join(lines[i + 1 :]).strip("\n")
    return [], text.strip("\n")


def merge_card(source_card: str, ours: str) -> str:
    """The source model card as the body, with normswap's card appended as one section.

    The source front matter is kept; ``normswap`` and ``rmsnorm`` tags are added to it. Our card's
    headings move one level down under "Converted by normswap". Merging twice replaces the
    earlier normswap section instead of stacking a second one.
    """
    if CARD_MARK in source_card:
        source_card = source_card.split(CARD_MARK)[0]
    front, body = _split_front_matter(source_card)
    ours_front, ours_body = _split_front_matter(ours)
    if CARD_MARK in ours_body:  # already merged once: take only our section
        ours_body = ours_body.split(CARD_MARK, 1)[1]
    ours_lines = ours_body.strip("\n").splitlines()
    if ours_lines and ours_lines[0].startswith("# "):
        ours_lines = ours_lines[1:]
    section = "\n".join(("#" + ln) if ln.startswith("#") else ln for ln in ours_lines).strip("\n")
    tags = [ln for ln in ours_front if ln.startswith("- ")]
    if front:
        try:
            i = next(k for k, ln in enumerate(front) if ln.rstrip() == "tags:")
            existing = set()
            j = i + 1
            while j < len(front) and front[j].lstrip().startswith("- "):
                existing.add(front[j].strip())
                j += 1
            front[j:j] = [t for t in tags if t.strip() not in existing]
        except StopIteration:
            front += ["tags:", *tags]
    head = ("---\n" + "\n".join(front) + "\n---\n\n") if front else ""
    return f"{head}{body}\n\n{CARD_MARK}\n## Converted by normswap\n\n{section}\n"


def write_card(out: Path, card: str, source_dir: Path | None = None) -> None:
    """Write ``out/README.md``: ``card``, merged into the source's own card when there is one."""
    src_card = source_dir / "README.md" if source_dir is not None else None
    if src_card is not None and src_card.is_file():
        card = merge_card(src_card.read_text(errors="replace"), card)
    (out / "README.md").write_text(card)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=json_default) + "\n")


def json_default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return list(obj)
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)
