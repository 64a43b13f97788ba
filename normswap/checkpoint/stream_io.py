"""Safetensors, tensor by tensor: header scans, a reader that re-opens its handles, a streaming writer.

The low-memory conversion never holds a model: it reads one input tensor at a time and writes one
output tensor at a time. Mapped pages of an open ``safe_open`` handle count as resident memory, so
the reader re-opens its handles every :data:`REOPEN_BYTES`; the writer lays out the header (with
every offset) first, then appends tensors, so memory stays at about one tensor per shard.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from normswap.checkpoint import io
from normswap.errors import NormswapError, first_line

REOPEN_BYTES = 256 << 20
ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
ST_TO_TORCH = {v: k for k, v in ST_DTYPES.items()}

# One output tensor: (key, safetensors dtype, shape, producer); the producer computes it when written.
OutputTensor = tuple[str, str, tuple[int, ...], Callable[[], torch.Tensor]]


@dataclass
class Entry:
    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


def itemsize(st_dtype: str) -> int:
    """Bytes per element of a safetensors dtype name (1 for the formats packed below a byte)."""
    return max(1, io.SAFETENSORS_DTYPE_BITS.get(st_dtype, 8) // 8)


def scan(files: list[Path]) -> dict[str, Entry]:
    """Every tensor of a (sharded) checkpoint, from the headers only, in file then offset order."""
    entries: dict[str, Entry] = {}
    for f in files:
        header = io.read_safetensors_header(f)
        items = sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"),
            key=lambda kv: kv[1]["data_offsets"][0],
        )
        for key, info in items:
            if key in entries:
                raise NormswapError(
                    f"tensor {key} appears in two shards ({entries[key].file.name}, {f.name}); "
                    "the checkpoint is corrupted"
                )
            entries[key] = Entry(key, f, info["dtype"], tuple(info["shape"]), info["data_offsets"][0])
    return entries


class Reader:
    """Tensors by key through ``safe_open``, re-opening handles so mapped pages do not pile up."""

    def __init__(self, entries: dict[str, Entry]) -> None:
        self.entries = entries
        self._handles: dict[Path, Any] = {}
        self._read: dict[Path, int] = {}

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        e = self.entries[key]
        if self._read.get(e.file, 0) > REOPEN_BYTES:
            self.close(e.file)
        try:
            if e.file not in self._handles:
                self._handles[e.file] = safe_open(str(e.file), framework="pt").__enter__()
                self._read[e.file] = 0
            t = self._handles[e.file].get_tensor(key)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise io.damaged(e.file, f"cannot be read (tensor {key}: {first_line(exc, 200)})") from exc
        self._read[e.file] += e.nbytes
        if e.nbytes > REOPEN_BYTES // 4:  # a big tensor: drop its mapped pages right away
            self.close(e.file)
        return t

    def close(self, file: Path | None = None) -> None:
        for f in [file] if file is not None else list(self._handles):
            handle = self._handles.pop(f, None)
            if handle is not None:
                handle.__exit__(None, None, None)
            self._read.pop(f, None)


class ShardWriter:
    """Write one safetensors file tensor by tensor (the header, with all offsets, comes first)."""

    def __init__(self, path: Path, layout: list[tuple[str, str, tuple[int, ...]]]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self._expected: list[tuple[str, int]] = []
        for key, dtype, shape in layout:
            n = nbytes(dtype, shape)
            header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._expected.append((key, n))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = path
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0

    def write(self, key: str, tensor: torch.Tensor) -> None:
        want_key, want_bytes = self._expected[self._next]
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if key != want_key or data.nbytes != want_bytes:
            raise RuntimeError(f"streaming writer: got {key} ({data.nbytes} bytes), expected {want_key}")
        self._f.write(memoryview(data))
        self._next += 1

    def close(self, *, complete: bool = True) -> None:
        """Close the file; ``complete=False`` on the way out of an error (nothing raised that
        would mask it: an interrupt or a full disk must be reported as what it is)."""
        if not complete:
            with contextlib.suppress(OSError):
                self._f.close()
            return
        self._f.close()
        if self._next != len(self._expected):
            raise RuntimeError(f"streaming writer: {self.path.name} is incomplete")


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = itemsize(dtype)
    for s in shape:
        n *= s
    return n


def split_shards(sizes: list[int], max_shard_size: int) -> list[list[int]]:
    """Group tensors (their byte sizes, in save order) into shards as ``save_pretrained`` does
    (``huggingface_hub.split_torch_state_dict_into_shards``), so that a streamed checkpoint has the in-memory
    one's files: in order, a tensor opens a new shard when it would take the current one past
    ``max_shard_size``; a tensor larger than the limit gets a shard of its own, placed before the current
    shard, which stays open for the tensors after it."""
    shards: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(sizes):
        if n > max_shard_size:
            shards.append([i])
            continue
        if used + n > max_shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current or not shards:
        shards.append(current)
    return shards


def file_order(entries: list[tuple[str, str]]) -> list[int]:
    """The order in which ``safetensors`` lays out (name, safetensors dtype) pairs in a file (by dtype, then
    name), asked of safetensors itself with empty tensors, so that a streamed shard is byte for byte the file
    ``save_pretrained`` writes for the same tensors."""
    from safetensors.torch import save

    if len(entries) < 2:
        return list(range(len(entries)))
    raw = save({k: torch.empty(0, dtype=ST_TO_TORCH[d]) for k, d in entries})
    (n,) = struct.unpack("<Q", raw[:8])
    keys = [k for k in json.loads(raw[8:8 + n]) if k != "__metadata__"]
    where = {k: i for i, (k, _) in enumerate(entries)}
    return [where[k] for k in keys]


def write_shards(layout: list[OutputTensor], out: Path, max_shard_size: int, progress: bool,
                 parameters: int | None = None) -> dict[str, str]:
    """Write ``layout`` (in save order) into shards of at most ``max_shard_size`` bytes, split and named as
    ``save_pretrained`` splits a state dict in that order, each file laid out as ``safetensors`` lays it out,
    plus the index when there is more than one; each tensor is produced only when it is written. ``parameters``:
    the index's ``total_parameters`` (``save_pretrained`` writes the model's parameter count, buffers left out;
    default: every written element). Returns the weight map."""
    from tqdm.auto import tqdm

    sizes = [nbytes(dtype, shape) for _key, dtype, shape, _ in layout]
    shards = split_shards(sizes, max_shard_size)
    total = len(shards)
    names = (
        ["model.safetensors"]
        if total == 1
        else [f"model-{k + 1:05d}-of-{total:05d}.safetensors" for k in range(total)]
    )
    weight_map: dict[str, str] = {}
    bar = tqdm(
        total=sum(sizes),
        unit="B",
        unit_scale=True,
        desc="streaming tensors",
        disable=None if progress else True,
        leave=False,
    )
    try:
        for name, idx in zip(names, shards, strict=True):
            idx = [idx[j] for j in file_order([(layout[i][0], layout[i][1]) for i in idx])]
            w = ShardWriter(out / name, [(layout[i][0], layout[i][1], layout[i][2]) for i in idx])
            try:
                for i in idx:
                    key, _, _, produce = layout[i]
                    tensor = produce()
                    w.write(key, tensor)
                    weight_map[key] = name
                    del tensor
                    bar.update(sizes[i])
            except BaseException:
                w.close(complete=False)
                raise
            w.close()
    finally:
        bar.close()
    if total > 1:
        numel = sum(sz // itemsize(layout[i][1]) for i, sz in enumerate(sizes))
        io.write_json(
            out / "model.safetensors.index.json",
            {
                "metadata": {"total_size": sum(sizes), "total_parameters": numel if parameters is None else parameters},
                "weight_map": dict(sorted(weight_map.items())),
            },
        )
    return weight_map


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def check_written(out: Path, expected: dict[str, torch.Tensor], *, what: str,
                  rename: Callable[[str], str | None] | None = None) -> None:
    """Read back the safetensors ``out`` holds and compare them with ``expected`` (name -> tensor, as the
    model to load them into names them): the same names, each tensor with the same dtype, shape and
    bytes (so NaNs compare too), one tensor in memory at a time. A name the files lack is fine only
    when its tensor is another name's (a tie, which loading ties again). ``rename``: a file's name as
    loading names it (transformers renames some on load), or None for a tensor loading converts (fused
    or split: not compared). Raises one line naming the first difference: a checkpoint normswap writes
    loads back equal, or is not written."""
    safe, _ = io.weight_files(out)
    entries = scan(safe)
    to_model = {k: (rename(k) if rename is not None else k) for k in entries}

    def refuse(problem: str) -> NormswapError:
        return NormswapError(f"{what} would not load back equal ({problem}); nothing was written. Please report "
                             "this with the model's class")

    def where(t: torch.Tensor) -> tuple:
        return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)

    extra = [k for k, m in to_model.items() if m is not None and m not in expected]
    if extra:
        raise refuse(f"the files hold `{extra[0]}`, which the model has no tensor for"
                     + (f", and {len(extra) - 1} more" if len(extra) > 1 else ""))
    held = {m for m in to_model.values() if m is not None}
    if None not in to_model.values():  # (a converted tensor fills names this cannot tell)
        stored = {where(t) for name, t in expected.items() if name in held and t.device.type != "meta"}
        for name, t in expected.items():
            if name not in held and (t.device.type == "meta" or where(t) not in stored):
                raise refuse(f"`{name}` is not in the files")
    reader = Reader(entries)
    try:
        for key, name in to_model.items():
            if name is None:
                continue
            got, want = reader.get(key), expected[name]
            if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
                raise refuse(f"`{key}` is {got.dtype} {list(got.shape)} in the files, {want.dtype} "
                             f"{list(want.shape)} in the model")
            if not torch.equal(_bytes(got), _bytes(want)):
                raise refuse(f"`{key}` holds other values than the model's")
    finally:
        reader.close()
