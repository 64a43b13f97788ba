"""File-level helpers: atomic output directories, shard sizes, safetensors checks, side files.

Nothing here knows about models; it is the part of checkpoint writing that must be boring and
safe: a conversion writes into a hidden temporary directory *beside* the destination and renames
it into place at the very end, so an interrupted or failed run leaves no partial output and never
touches what the user already has.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
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

from normswap import interrupts
from normswap.analysis.plan import ADAPTER_BASES_FILE
from normswap.errors import DiskFull, NormswapError, UsageError
from normswap.memory import available_memory, human  # noqa: F401 - re-exported: io.human, io.available_memory
from normswap.options import check_out_dir, parse_size  # noqa: F401 - io.parse_size, as the writers call it (torch-free home)

TMP_MARK = ".normswap-tmp-"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


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
    a parent of the working directory, a file, or a place we cannot write (a read-only filesystem
    is named as such; any other place is probed by creating and removing a directory there, the one
    thing this leaves no trace of)."""
    out = check_out_dir(out, overwrite=overwrite, source=source)
    if out.is_dir() and any(out.iterdir()):  # overwrite=True: replace, unless that would destroy more
        why = _dangerous(out)
        if why:
            raise UsageError(f"refusing to overwrite {out}: {why}")
    where = staging_dir(out)
    if not where.is_dir():
        raise NormswapError(f"cannot create out_dir {out}: {where} is a file, not a directory")
    for place in (out, where) if out.is_dir() else (where,):
        mount = read_only_mount(place)
        if mount is not None:
            what = "it is a read-only mount" if mount == out.resolve() else (
                f"its filesystem is mounted read-only (at {mount})")
            raise NormswapError(f"cannot write out_dir {out}: {what}; choose out_dir on a writable filesystem")
    if not os.access(where, os.W_OK | os.X_OK):
        raise NormswapError(f"cannot write to {where} (permission denied); choose a writable out_dir")
    _probe(out, where)
    return out


def _probe(out: Path, where: Path) -> None:
    """Create and remove at once the kind of directory the output is first written into, so that a place
    no permission bit or mount flag tells about (``/proc``, a FUSE mount that refuses writes, a root
    process on a read-only bind) is refused now, with the system's own reason, not after the work (where
    ``/proc``'s 0 bytes free read as a full disk)."""
    with interrupts.deferred():  # an interrupt in between would leave the probe behind
        try:
            probe = tempfile.mkdtemp(prefix=f".{out.name}{TMP_MARK}{_owner()}-probe-", dir=where)
        except OSError as exc:
            if exc.errno == errno.EROFS:
                raise NormswapError(f"cannot write out_dir {out}: its filesystem is mounted read-only; choose "
                                    "out_dir on a writable filesystem") from exc
            raise NormswapError(f"cannot write out_dir {out}: a directory cannot be created in {where} "
                                f"({exc.strerror or exc}); choose a writable out_dir") from exc
        with contextlib.suppress(OSError):
            os.rmdir(probe)


def _existing_parent(out: Path) -> Path:
    parent = out.resolve().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def _into_mount(out: Path) -> bool:
    """Whether ``out`` is an existing directory no rename may replace, so that the output is staged
    *inside* it and its entries are moved into place (see :func:`atomic_directory`): a mount point (a
    Docker volume, say), or the working directory (``--out .`` in an empty directory), which replacing
    would leave the user's shell in a deleted directory."""
    if not out.is_dir():
        return False
    resolved = out.resolve()  # resolved: a link to a mount point is one too
    return os.path.ismount(resolved) or resolved == Path.cwd().resolve()


def staging_dir(out: Path) -> Path:
    """The existing directory the output is first written into (its filesystem receives every byte):
    ``out`` itself when it is a mount point, else the first existing directory above it, where the
    temporary directory beside ``out`` (and any missing parents) will be created."""
    out = Path(out).expanduser()
    return out.resolve() if _into_mount(out) else _existing_parent(out)


def read_only_mount(path: Path) -> Path | None:
    """The mount point of ``path``'s filesystem when that filesystem is mounted read-only, else None
    (also None where the platform cannot tell)."""
    statvfs = getattr(os, "statvfs", None)
    flag = getattr(os, "ST_RDONLY", 1)
    try:
        if statvfs is None or not statvfs(path).f_flag & flag:
            return None
    except OSError:
        return None
    mount = Path(path).resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return mount


def free_bytes(path: Path) -> int:
    """Bytes free on the filesystem the output at ``path`` is written to (:func:`staging_dir`)."""
    try:
        return shutil.disk_usage(staging_dir(Path(path))).free
    except OSError:
        return 1 << 62


# What the pre-check asks for beyond the estimate (weights and copied side files): config, model card,
# safetensors headers and filesystem blocks, which it leaves out. Said in the message, with the sum.
SPACE_MARGIN_FRACTION = 0.01
SPACE_MARGIN_BYTES = 256 << 10


def space_required(needed: int) -> int:
    """Free bytes the pre-check asks for to write ``needed`` bytes: the estimate, 1% more, 256 KiB more."""
    return int(needed * (1 + SPACE_MARGIN_FRACTION)) + SPACE_MARGIN_BYTES


def check_space(out: Path, needed: int) -> int:
    """Fail early, before writing anything, when the destination's filesystem is too small.

    Returns ``needed`` so the caller can hand it to :func:`atomic_directory` for the message a
    full disk gives later (the estimate is not exact: another process may fill the disk meanwhile).
    """
    free = free_bytes(out)
    if needed > 0 and free < space_required(needed):
        raise disk_full(out, needed, free, early=True)
    return needed


def disk_full(out: Path, needed: int | None, free: int | None = None, *, early: bool = False,
              quota: bool = False) -> DiskFull:
    """One line naming ``out_dir``, the directory whose filesystem is full and figures that agree.

    ``early`` (the pre-check): what is needed, the headroom asked on top of it, and the free space,
    which is less than their sum. Otherwise the disk filled up while writing: what was being written
    and what is free now that the partial output is removed (which may be more: the write did fail);
    ``quota``: it was the user's disk quota (EDQUOT), not the filesystem, that ran out.
    """
    out = Path(out)
    where = staging_dir(out)
    free = free_bytes(out) if free is None else free
    if early and needed:
        margin = space_required(needed) - needed
        what = (f"out_dir {out} needs ~{human(space_required(needed))} ({human(needed)} to write + "
                f"{human(margin)} headroom), and the filesystem of {where} has {human(free)} free")
    elif quota:
        size = f" (~{human(needed)} to write)" if needed else ""
        return DiskFull(f"disk quota exceeded: your quota on the filesystem of {where} ran out while writing "
                        f"out_dir {out}{size}; nothing was written. Free some of your files or choose another out_dir")
    else:
        size = f" (~{human(needed)} to write)" if needed else ""
        what = (f"the filesystem of {where} filled up while writing out_dir {out}{size}; "
                f"{human(free)} free once the partial output was removed")
    return DiskFull(f"disk full: {what}; nothing was written. Free some space or choose another out_dir")


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
        f"(+{pct:.0f}%): a folded γ or a reader rewrite needs the head's own weight, or untie=True was asked"
    )


def _umask() -> int:
    """The process umask (read without changing it where /proc tells, else set and restored at once)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def set_modes(root: Path) -> None:
    """Give every file under ``root`` the mode a plain ``open(path, "w")`` gives (0644 under the usual
    umask 022), and every directory, ``root`` included, 0755: writers differ (safetensors writes 0600
    through a temporary file), a checkpoint should not."""
    mask = _umask()
    os.chmod(root, 0o777 & ~mask)
    for path in root.rglob("*"):
        if path.is_symlink():
            continue
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


@contextlib.contextmanager
def atomic_directory(out: Path, *, overwrite: bool, needed: int | None = None) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``out``; on success rename it to ``out``.

    On any exception (including KeyboardInterrupt) the temporary directory is removed and ``out``
    is left exactly as it was. An interrupt during the final rename is held until it is done
    (:func:`normswap.interrupts.deferred`), then raised with the output recorded as complete. With
    ``overwrite`` an existing ``out`` is moved aside, replaced, and deleted only after the new
    directory is in place. Every file written gets one mode (:func:`set_modes`). When ``out`` is a
    mount point (which no rename can replace) the temporary directory is made inside it and its
    entries are moved into ``out`` one by one at the end. When ``out`` is a symbolic link (an output
    directory kept on a bigger disk, say) the output goes where it points, and the link is kept.
    """
    out = Path(out).expanduser()
    if out.is_symlink():  # write into its target: renaming onto the link would replace the link itself
        out = out.resolve()
    if out.name in ("", ".."):  # `.` or `x/..`: name the directory itself (the temporary one is named after it)
        out = Path(os.path.abspath(out))
    into_mount = _into_mount(out)
    parent = out.resolve() if into_mount else out.resolve().parent
    created = parent  # the outermost directory this call creates (removed again on failure)
    while not created.parent.exists() and created.parent != created:
        created = created.parent
    created = created if not created.exists() else None

    def cleanup(tmp: Path | None) -> None:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)

    tmp: Path | None = None
    try:
        try:
            parent.mkdir(parents=True, exist_ok=True)
            clean_stale(parent, out.name)
            # the directory and the name that cleans it up come into being together: Ctrl-C between
            # mkdtemp's return and the assignment would leave a temporary directory nobody removes
            with interrupts.deferred():
                tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}{TMP_MARK}{_owner()}-", dir=parent))
        except OSError as exc:
            if exc.errno == errno.EROFS:
                raise os_error(exc, out) from exc
            raise NormswapError(
                f"cannot create the output directory next to {out}: {exc.strerror or exc}"
            ) from exc
        yield tmp
        set_modes(tmp)
    except OSError as exc:
        cleanup(tmp)
        raise os_error(exc, out, needed=needed) from exc
    except BaseException as exc:
        cleanup(tmp)
        cause = wrapped_os_error(exc)
        if cause is None:
            raise
        raise os_error(cause, out, needed=needed) from exc
    # the commit: Ctrl-C / SIGTERM are held across it, so it happens whole or not at all; one that
    # arrived meanwhile is raised when the block ends, after the output is recorded as complete (the
    # command line then says it was written). Nothing after the commit may remove anything.
    with interrupts.deferred():
        try:
            if into_mount:
                _move_entries_into(tmp, out, overwrite=overwrite)
            else:
                _move_into_place(tmp, out, overwrite=overwrite)
        except OSError as exc:
            cleanup(tmp)
            raise os_error(exc, out, needed=needed) from exc
        except BaseException:
            cleanup(tmp)
            raise
        interrupts.committed(out)


def _move_into_place(tmp: Path, out: Path, *, overwrite: bool) -> None:
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if out.exists():
        if not overwrite:  # appeared while we were converting
            raise NormswapError(f"out_dir {out} appeared during the conversion; result discarded")
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


def _move_entries_into(tmp: Path, out: Path, *, overwrite: bool) -> None:
    """``out`` is a mount point holding ``tmp``: move what else it holds aside (with ``overwrite``),
    move ``tmp``'s entries in, then drop the old ones; on failure put everything back."""
    mine = f".{out.name}{TMP_MARK}"
    others = [p for p in out.iterdir() if p != tmp and not p.name.startswith(mine)]
    if others and not overwrite:  # appeared while we were converting
        raise NormswapError(f"out_dir {out} appeared during the conversion; result discarded")
    old = out / f"{mine}{_owner()}-old"
    moved_old: list[Path] = []
    moved_new: list[Path] = []
    try:
        if others:
            old.mkdir()
            for p in others:
                os.rename(p, old / p.name)
                moved_old.append(p)
        for p in sorted(tmp.iterdir()):
            os.rename(p, out / p.name)
            moved_new.append(out / p.name)
    except BaseException:
        for p in moved_new:
            with contextlib.suppress(OSError):
                os.rename(p, tmp / p.name)
        for p in moved_old:
            with contextlib.suppress(OSError):
                os.rename(old / p.name, p)
        with contextlib.suppress(OSError):
            old.rmdir()
        raise
    tmp.rmdir()
    if others:
        shutil.rmtree(old, ignore_errors=True)


def wrapped_os_error(exc: BaseException) -> OSError | None:
    """The operating-system error inside a writer's own exception type, or None: safetensors' Rust writer
    (which ``save_pretrained`` uses) raises ``SafetensorError("... I/O error: No space left on device
    (os error 28)")``, not an ``OSError``, so a full disk would otherwise read as an internal error."""
    if type(exc).__name__ != "SafetensorError":
        return None
    found = re.search(r"\(os error (\d+)\)", str(exc))
    if found is None:
        return None
    code = int(found[1])
    return OSError(code, os.strerror(code))


def os_error(exc: OSError, where: Path | str, *, needed: int | None = None) -> NormswapError:
    """One actionable line for an I/O failure while writing."""
    if exc.errno == errno.EFBIG:
        return NormswapError(f"cannot write {where}: a file is larger than its filesystem or your file-size "
                             "limit allows (FAT32's 4 GiB, `ulimit -f`); nothing was written. Pass a smaller "
                             "max_shard_size, or choose another out_dir")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return disk_full(Path(where), needed, quota=exc.errno == errno.EDQUOT)
    if exc.errno == errno.EROFS:
        return NormswapError(f"cannot write {where}: its filesystem is mounted read-only; choose out_dir on "
                             "a writable filesystem")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return NormswapError(f"cannot write {where} ({exc.strerror}); choose a writable out_dir")
    return NormswapError(f"I/O error on {where}: {exc.strerror or exc}")


# ------------------------------------------------------------------------------------ safetensors
# bits per element of every safetensors dtype (the format's own list; F4/F6 pack below a byte)
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


def damaged(path: Path | str, problem: str) -> NormswapError:
    """The one diagnosis of a damaged checkpoint file, whichever reader finds it: which file, what is
    wrong with it, and what to do (fetch it again)."""
    return NormswapError(f"{path} {problem}; the file is damaged (an incomplete or corrupted download?): "
                         "fetch it again")


def _tensor_fault(info: Any) -> str:
    """What is wrong with one tensor's header entry, or "" when it is well formed."""
    if not isinstance(info, dict):
        return "is not described by a JSON object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPE_BITS:
        return f"has unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        return f"has an invalid shape {shape!r}"
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)):
        return f"has invalid data_offsets {offsets!r} (two byte offsets expected)"
    begin, end = offsets
    if end < begin:
        return f"has data_offsets [{begin}, {end}] that run backwards"
    bits = SAFETENSORS_DTYPE_BITS[dtype]
    for d in shape:
        bits *= d
    if bits % 8 or end - begin != bits // 8:
        return f"holds {end - begin} bytes, but a {dtype} tensor of shape {shape} needs {bits / 8:g}"
    return ""


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Parse and check a safetensors header without loading tensors (no pickle, ever): every check the
    safetensors library makes when it opens the file (known dtypes, sizes that match dtype and shape,
    data offsets that tile the data section exactly), so a damaged file is reported here, by name, the
    same way on every path, and never surfaces later as a library error. Raises :func:`damaged`."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"its header length ({n} bytes) points past the end of the file")
            if n > 100 << 20:
                raise ValueError(f"its header length ({n} bytes) is over the format's 100 MB limit")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise damaged(path, f"is not a valid safetensors file ({exc})") from exc
    if not isinstance(header, dict):
        raise damaged(path, "is not a valid safetensors file (its header is not a JSON object)")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise damaged(path, "has a corrupted safetensors header (__metadata__ is not a mapping of strings)")
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        fault = _tensor_fault(info)
        if fault:
            raise damaged(path, f"has a corrupted safetensors header: tensor {key!r} {fault}")
        spans.append((*info["data_offsets"], key))
    end, previous = 0, None
    for begin, stop, key in sorted(spans):
        if begin != end:
            what = (f"(from byte {begin}) overlaps tensor {previous!r} (up to byte {end})" if begin < end
                    else f"starts at byte {begin}, leaving a gap after byte {end}")
            raise damaged(path, f"has a corrupted safetensors header: tensor {key!r} {what}")
        end, previous = stop, key
    if 8 + n + end > size:
        raise damaged(path, f"is truncated ({human(size)} on disk, its header describes {human(8 + n + end)})")
    if 8 + n + end < size:
        raise damaged(path, f"has {size - 8 - n - end} bytes after its last tensor (its header describes "
                            f"{human(8 + n + end)}, {human(size)} on disk)")
    return header


def weight_files(model_dir: Path) -> tuple[list[Path], list[Path]]:
    """(safetensors files, pickle-format files) of a local model directory (not normswap's adapter bases' side
    file, :data:`normswap.analysis.plan.ADAPTER_BASES_FILE`, which holds no weights)."""
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
        safe = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file() and p.name != ADAPTER_BASES_FILE)
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
# Python's bytecode caches: a source with custom modeling code that was imported in place holds one; it belongs to
# the machine that compiled it, not to the checkpoint (and a stale one would shadow an edited modeling file).
_BYTECODE = ("__pycache__", "*.pyc")
CARD_MARK = "<!-- normswap conversion -->"


def _is_weight(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name.endswith(_WEIGHT_INDEXES)


def _side_entries(src: Path | None) -> list[Path]:
    """The files and directories of ``src`` that :func:`copy_side_files` copies."""
    if src is None or not src.is_dir():
        return []
    return [f for f in sorted(src.iterdir())
            if not (f.name.startswith(".") or f.name == "config.json" or (f.is_file() and _is_weight(f.name))
                    or (f.is_dir() and f.name in _STALE_DIRS) or _is_bytecode(f.name))]


def _is_bytecode(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in _BYTECODE)


def side_file_bytes(src: Path | None) -> int:
    """Bytes :func:`copy_side_files` will copy from ``src`` (what the disk-space check adds to the weights)."""
    total = 0
    for f in _side_entries(src):
        files = [g for g in f.rglob("*")
                 if not any(part.startswith(".") or _is_bytecode(part) for part in g.relative_to(f).parts)] \
            if f.is_dir() else [f]
        total += sum(g.stat().st_size for g in files if g.is_file())
    return total


def copy_side_files(src: Path | None, dst: Path) -> list[str]:
    """Copy every file of the source directory that is not a weight of the converted model.

    Tokenizers, processors, generation configs, chat templates, sentence-transformers'
    ``modules.json`` / ``1_Pooling/`` / ``2_Normalize/`` (subdirectories whole: they hold other
    modules, not the converted one), licences, ``*.md`` / ``*.txt`` / ``*.json``. Never copied:
    ``config.json`` (rewritten), the root's weights and weight indexes, exports of the unconverted
    weights (``onnx/``, ``openvino/``, ...), hidden files, Python's bytecode caches (``__pycache__``,
    ``*.pyc``). A file the conversion already wrote wins, except ``README.md``: the source's card becomes
    the body and the conversion's card is kept as a section of it (:func:`merge_card`).
    """
    copied: list[str] = []
    for f in _side_entries(src):
        name = f.name
        target = dst / name
        if f.is_dir():
            if target.exists():
                continue
            shutil.copytree(f, target, ignore=shutil.ignore_patterns(".*", *_BYTECODE))
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
