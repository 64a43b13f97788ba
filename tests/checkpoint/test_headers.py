"""A damaged safetensors file gets one diagnosis, whichever reader meets it first.

Each fault is built in a copy of a saved preset. ``convert`` (in memory and ``--low-memory``),
``inspect``, ``verify`` and ``normswap.load`` all answer with the same one line: the file, what is
wrong with it, and "fetch it again" (exit code 1), never a library error passed through or an
"internal error", and nothing is written.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

import normswap
from normswap import presets
from normswap.checkpoint import io, stream_io
from normswap.cli import main


def run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


@pytest.fixture(scope="module")
def gpt2_src(tmp_path_factory) -> Path:
    return presets.save("tiny-gpt2", tmp_path_factory.mktemp("src") / "gpt2")


def rewrite_header(path: Path, edit) -> None:
    """Apply ``edit(header, keys_in_offset_order)`` to ``path``'s header; the data stays as it was
    unless ``edit`` returns bytes to append."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    keys = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    extra = edit(header, keys) or b""
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :] + extra)


def _dtype(h, keys):
    h[keys[3]]["dtype"] = "F33"


def _reversed(h, keys):
    h[keys[3]]["data_offsets"].reverse()


def _overlap(h, keys):
    h[keys[4]]["data_offsets"] = [o - 4 for o in h[keys[4]]["data_offsets"]]


def _gap(h, keys):
    for k in keys[4:]:
        h[k]["data_offsets"] = [o + 8 for o in h[k]["data_offsets"]]
    return b"\0" * 8


def _shape(h, keys):
    h[keys[3]]["shape"][0] += 1


def _trailing(h, keys):
    return b"\0" * 16


def _not_an_object(h, keys):
    h.clear()
    h["x"] = 1  # a tensor entry that is not an object


def _metadata(h, keys):
    h["__metadata__"] = {"format": ["pt"]}


FAULTS = {
    "unknown dtype": (_dtype, "unknown dtype 'F33'"),
    "reversed offsets": (_reversed, "run backwards"),
    "overlapping offsets": (_overlap, "overlaps tensor"),
    "gap between tensors": (_gap, "leaving a gap"),
    "size does not match shape": (_shape, "needs"),
    "bytes after the last tensor": (_trailing, "bytes after its last tensor"),
    "entry not an object": (_not_an_object, "not described by a JSON object"),
    "metadata not strings": (_metadata, "__metadata__"),
}


def damaged_copy(gpt2_src: Path, tmp_path: Path, fault: str) -> Path:
    src = Path(shutil.copytree(gpt2_src, tmp_path / "src"))
    rewrite_header(src / "model.safetensors", FAULTS[fault][0])
    return src


def assert_diagnosis(code: int, err: str, src: Path, fault: str) -> None:
    assert code == 1, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert str(src / "model.safetensors") in line and FAULTS[fault][1] in line and "fetch it again" in line, line
    assert "internal error" not in line and "SafetensorError" not in line and "deserializ" not in line, line


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("flag", ["--in-memory", "--low-memory"])
def test_convert_names_the_file_and_the_fault_on_both_paths(tmp_path, gpt2_src, fault, flag):
    src = damaged_copy(gpt2_src, tmp_path, fault)
    code, _, err = run("convert", str(src), "--out", str(tmp_path / "out"), "-q", flag)
    assert_diagnosis(code, err, src, fault)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("fault", ["unknown dtype", "overlapping offsets"])
def test_every_other_reader_gives_the_same_diagnosis(tmp_path, gpt2_src, fault):
    src = damaged_copy(gpt2_src, tmp_path, fault)
    assert_diagnosis(*run("inspect", str(src))[::2], src, fault)
    converted = tmp_path / "converted"
    normswap.convert(str(gpt2_src), converted)
    assert_diagnosis(*run("verify", str(src), str(converted))[::2], src, fault)
    # a damaged converted checkpoint: normswap.load and verify's CONVERTED
    rewrite_header(converted / "model.safetensors", FAULTS[fault][0])
    with pytest.raises(normswap.NormswapError) as caught:
        normswap.load(converted)
    assert_diagnosis(1, f"error: {caught.value}", converted, fault)
    assert_diagnosis(*run("verify", str(gpt2_src), str(converted))[::2], converted, fault)


def test_well_formed_files_pass_the_checks(tmp_path, gpt2_src):
    """The checks mirror the format, not one writer: sharded files, zero-size tensors and every dtype."""
    import torch
    from safetensors.torch import save_file

    sharded = presets.save("tiny-bert", tmp_path / "bert", max_shard_size="100KB")
    for f in sorted(sharded.glob("*.safetensors")):
        io.read_safetensors_header(f)
    tensors = {name: torch.zeros(3, 2, dtype=dt) for name, dt in
               (("f64", torch.float64), ("bf16", torch.bfloat16), ("i8", torch.int8), ("b", torch.bool))}
    tensors["empty"] = torch.zeros(0, 4)
    save_file(tensors, tmp_path / "t.safetensors")
    header = io.read_safetensors_header(tmp_path / "t.safetensors")
    assert set(header) - {"__metadata__"} == set(tensors)


def test_a_tensor_the_library_cannot_read_is_diagnosed_like_a_bad_header(tmp_path, gpt2_src, monkeypatch):
    """The streaming reader's own failures (past the header checks) say the same: file, fault, fetch again."""
    import safetensors

    entries = stream_io.scan([gpt2_src / "model.safetensors"])

    def broken(*args, **kwargs):
        raise safetensors.SafetensorError("Error while deserializing header: something new")

    monkeypatch.setattr(safetensors, "safe_open", broken)
    reader = stream_io.Reader(entries)
    with pytest.raises(normswap.NormswapError) as caught:
        reader.get(next(iter(entries)))
    text = str(caught.value)
    assert str(gpt2_src / "model.safetensors") in text and "something new" in text and "fetch it again" in text


def test_a_header_length_past_the_end_is_named(tmp_path, gpt2_src):
    src = Path(shutil.copytree(gpt2_src, tmp_path / "src"))
    f = src / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])  # a length field larger than the file
    code, _, err = run("convert", str(src), "--out", str(tmp_path / "out"), "-q")
    assert code == 1 and str(f) in err and "points past the end of the file" in err and "fetch it again" in err
