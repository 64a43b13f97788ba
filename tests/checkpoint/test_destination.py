"""Where a checkpoint is written: full and read-only filesystems, mount points, file modes.

A full disk is reported with figures that agree with each other (what is needed, the headroom the
pre-check asks on top, what is free) and the path whose filesystem is short; a read-only filesystem
is named as read-only, before anything is loaded; an ``--out`` that is itself a mount point (a
Docker volume) is written into; every file of a checkpoint gets the mode a plain file create gives.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

import normswap
from normswap import presets
from normswap.checkpoint import io
from normswap.cli import main


def run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def error_line(code: int, err: str, expected: int) -> str:
    assert code == expected, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and "internal error" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def gpt2_src(tmp_path_factory) -> Path:
    return presets.save("tiny-gpt2", tmp_path_factory.mktemp("src") / "gpt2")


def fake_statvfs(monkeypatch, *, read_only_under: Path | None = None, free: int | None = None) -> None:
    """``os.statvfs`` (which ``shutil.disk_usage`` reads too) reporting a read-only filesystem for the
    paths under ``read_only_under`` and/or ``free`` bytes available everywhere."""
    real = os.statvfs

    def statvfs(path):
        st = real(path)
        fields = {name: getattr(st, name) for name in dir(st) if name.startswith("f_")}
        if read_only_under is not None and Path(path).resolve().is_relative_to(read_only_under.resolve()):
            fields["f_flag"] |= os.ST_RDONLY
        if free is not None:
            fields["f_bavail"] = fields["f_bfree"] = free // st.f_frsize
        return types.SimpleNamespace(**fields)

    monkeypatch.setattr(os, "statvfs", statvfs)


def fake_mount(monkeypatch, mount: Path) -> None:
    """``mount`` behaves like a mount point: ``ismount`` says so, and it cannot be removed or renamed
    over or away (EBUSY, as the kernel answers)."""
    import errno

    def is_it(p) -> bool:
        return Path(p).resolve() == mount.resolve()

    real_ismount, real_rmdir, real_rename = os.path.ismount, os.rmdir, os.rename

    def rmdir(p, *a, **k):
        if is_it(p):
            raise OSError(errno.EBUSY, "Device or resource busy", str(p))
        return real_rmdir(p, *a, **k)

    def rename(a, b, *args, **kwargs):
        if is_it(a) or is_it(b):
            raise OSError(errno.EBUSY, "Device or resource busy", str(b))
        return real_rename(a, b, *args, **kwargs)

    monkeypatch.setattr(os.path, "ismount", lambda p: is_it(p) or real_ismount(p))
    monkeypatch.setattr(os, "rmdir", rmdir)
    monkeypatch.setattr(os, "rename", rename)


# ------------------------------------------------------------------------------------ read-only
def test_read_only_filesystem_is_named_as_such_before_loading(tmp_path, monkeypatch):
    mount = tmp_path / "ro"
    mount.mkdir()
    fake_statvfs(monkeypatch, read_only_under=mount)
    fake_mount(monkeypatch, mount)
    load = []
    monkeypatch.setattr("normswap.checkpoint.source.load_model", lambda *a, **k: load.append(1))

    # --out inside the read-only mount (not there yet): the mount is named, not "permission denied"
    line = error_line(*run("convert", "tiny-gpt2", "--out", str(mount / "o"), "-q")[::2], 1)
    assert f"--out {mount / 'o'}" in line and f"mounted read-only (at {mount.resolve()})" in line, line
    assert "disk full" not in line and "permission" not in line
    # --out is the read-only mount itself (its parent is writable): still the real cause
    line = error_line(*run("convert", "tiny-gpt2", "--out", str(mount), "-q")[::2], 1)
    assert f"--out {mount}" in line and "read-only mount" in line and "disk full" not in line, line
    assert not load and os.listdir(mount) == [] and sorted(os.listdir(tmp_path)) == ["ro"]


def test_read_only_filesystem_found_while_writing(tmp_path, monkeypatch):
    import errno

    from normswap.checkpoint import writer

    def erofs(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(writer, "write_native", erofs)
    line = error_line(*run("convert", "tiny-gpt2", "--out", str(tmp_path / "o"), "-q")[::2], 1)
    assert "read-only" in line and str(tmp_path / "o") in line
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------ disk full
_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * _UNITS[unit]


@pytest.mark.parametrize("low_memory", [False, True], ids=["in-memory", "low-memory"])
def test_disk_full_figures_agree_and_name_the_output(tmp_path, gpt2_src, monkeypatch, low_memory):
    """The issue's case: ~600 KB to write, 1.05 MB free. The message shows the headroom it asks for,
    and its figures add up: needs = to write + headroom > free."""
    fake_statvfs(monkeypatch, free=1_050_000)
    monkeypatch.setattr(io, "SPACE_MARGIN_BYTES", 2 * 10**6)  # a headroom larger than the free space
    out = tmp_path / "new" / "o"
    flags = ("--low-memory",) if low_memory else ("--in-memory",)
    line = error_line(*run("convert", str(gpt2_src), "--out", str(out), "-q", *flags)[::2], 1)
    m = re.search(r"--out (\S+) needs ~([\d.]+ \w+) \(([\d.]+ \w+) to write \+ ([\d.]+ \w+) headroom\), "
                  r"and the filesystem of (\S+) has ([\d.]+ \w+) free", line)
    assert m, line
    assert m[1] == str(out) and m[5] == str(tmp_path.resolve())  # the output, and the first existing dir
    needs, write, headroom, free = (_bytes(m[i]) for i in (2, 3, 4, 6))
    assert abs(needs - (write + headroom)) <= 0.01 * needs  # rounding of the printed figures only
    assert free < needs and abs(free - 1_050_000) < 5_000
    assert write >= (gpt2_src / "model.safetensors").stat().st_size  # the weights, at least
    assert io.space_required(int(write)) == pytest.approx(needs, rel=0.01)  # the rule the message states
    assert sorted(os.listdir(tmp_path)) == []


def test_space_check_counts_side_files_and_a_small_headroom(tmp_path, gpt2_src):
    src = Path(shutil.copytree(gpt2_src, tmp_path / "src"))
    (src / "sub").mkdir()
    (src / "sub" / "big.txt").write_bytes(b"x" * 5000)
    (src / ".hidden").write_bytes(b"x" * 7000)  # not copied, not counted
    (src / "model.onnx").write_bytes(b"x" * 9000)  # a stale export: not copied, not counted
    expected = sum(f.stat().st_size for f in src.rglob("*") if f.is_file() and f.suffix != ".safetensors"
                   and f.name not in ("config.json", ".hidden", "model.onnx"))
    assert io.side_file_bytes(src) == expected
    copied = tmp_path / "copied"
    copied.mkdir()
    io.copy_side_files(src, copied)
    assert sum(f.stat().st_size for f in copied.rglob("*") if f.is_file()) == expected
    assert io.space_required(10**6) == 10**6 + 10**4 + io.SPACE_MARGIN_BYTES <= 2 * 10**6


# ------------------------------------------------------------------------------------ mount points
def test_out_that_is_a_mount_point_is_written_into(tmp_path, monkeypatch):
    """No rename can replace a mount point: the output is staged inside it and moved into place."""
    volume = tmp_path / "volume"
    volume.mkdir()
    fake_mount(monkeypatch, volume)
    code, _, err = run("convert", "tiny-gpt2", "--out", str(volume), "-q")
    assert code == 0, err
    names = sorted(os.listdir(volume))
    assert "model.safetensors" in names and "config.json" in names
    assert not [n for n in names if io.TMP_MARK in n] and sorted(os.listdir(tmp_path)) == ["volume"]
    model = normswap.load(volume)
    assert type(model).__name__.startswith("Normswap")
    (volume / "stale.txt").write_text("from an older run")
    code, _, err = run("convert", "tiny-gpt2", "--out", str(volume), "-q", "--mode", "exact", "--overwrite")
    assert code == 0, err
    assert "stale.txt" not in os.listdir(volume) and not [n for n in os.listdir(volume) if io.TMP_MARK in n]


def test_a_failed_move_into_a_mount_point_puts_everything_back(tmp_path, monkeypatch):
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "old.txt").write_text("keep me")
    fake_mount(monkeypatch, volume)
    mount_rename = os.rename

    def rename(a, b):
        if Path(b).name == "config.json" and Path(b).parent == volume:
            raise OSError(5, "Input/output error")
        mount_rename(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(normswap.NormswapError, match="I/O error"):
        with io.atomic_directory(volume, overwrite=True) as tmp:
            (tmp / "README.md").write_text("new")
            (tmp / "config.json").write_text("{}")
    assert sorted(os.listdir(volume)) == ["old.txt"] and (volume / "old.txt").read_text() == "keep me"


# ------------------------------------------------------------------------------------ file modes
def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_output_file_gets_one_mode_on_every_path(tmp_path, gpt2_src, umask):
    old = os.umask(umask)
    try:
        outs = {"in-memory": tmp_path / "mem", "low-memory": tmp_path / "low", "save": tmp_path / "saved"}
        for flag, out in (("--in-memory", outs["in-memory"]), ("--low-memory", outs["low-memory"])):
            code, _, err = run("convert", str(gpt2_src), "--out", str(out), "-q", flag)
            assert code == 0, err
        normswap.save(normswap.load(outs["in-memory"]), outs["save"])
    finally:
        os.umask(old)
    for name, out in outs.items():
        modes = _modes(out)
        assert modes.pop(".") == 0o777 & ~umask, name
        assert "model.safetensors" in modes
        assert set(modes.values()) == {0o666 & ~umask}, (name, {k: oct(v) for k, v in modes.items()})


def test_a_quota_that_runs_out_is_named_as_a_quota(tmp_path, monkeypatch):
    import errno

    from normswap.checkpoint import writer

    def edquot(*a, **k):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(writer, "write_native", edquot)
    line = error_line(*run("convert", "tiny-gpt2", "--out", str(tmp_path / "o"), "-q")[::2], 1)
    assert line.startswith("error: disk quota exceeded:") and f"--out {tmp_path / 'o'}" in line, line
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("target", ["empty", "full", "dangling"])
def test_out_that_is_a_symlink_is_written_where_it_points_and_stays_a_link(tmp_path, target):
    """An output directory kept on another disk behind a link: the result goes into the link's target
    (the link itself is neither removed nor replaced by a directory), an empty or absent target needs no
    overwrite, a full one is replaced only with it."""
    real = tmp_path / "disk" / "out"
    if target != "dangling":
        real.mkdir(parents=True)
    if target == "full":
        (real / "old.txt").write_text("old")
    link = tmp_path / "out"
    link.symlink_to(real)
    if target == "full":
        with pytest.raises(normswap.NormswapError, match="exists and is not empty"):
            io.check_destination(link, overwrite=False)
    io.check_destination(link, overwrite=target == "full")
    with io.atomic_directory(link, overwrite=target == "full") as tmp:
        (tmp / "model.safetensors").write_text("new")
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert sorted(p.name for p in real.iterdir()) == ["model.safetensors"]
    assert not [p for p in tmp_path.rglob(".*normswap-tmp*")]


def test_python_api_errors_on_an_unwritable_place_name_out_dir(tmp_path, monkeypatch):
    """The probe's refusal speaks to a Python caller (``out_dir``); the command line turns it into ``--out``."""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(io.tempfile, "mkdtemp", refuse)
    wording = r"cannot write out_dir .*\(Permission denied\); choose a writable out_dir"
    with pytest.raises(normswap.NormswapError, match=wording):
        io.check_destination(tmp_path / "o", overwrite=False)


@pytest.mark.parametrize("spelling", [".", "../here"])
def test_out_that_is_the_empty_working_directory_is_written_into(tmp_path, monkeypatch, spelling):
    """``cd empty && normswap convert ... --out .``: the files land in the working directory, which is
    not removed and replaced (the user's shell would be left in a deleted directory)."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    inode = here.stat().st_ino
    io.check_destination(spelling, overwrite=False)
    with io.atomic_directory(Path(spelling), overwrite=False) as tmp:
        (tmp / "model.safetensors").write_text("new")
    assert here.stat().st_ino == inode and Path.cwd().resolve() == here.resolve()
    assert [p.name for p in here.iterdir()] == ["model.safetensors"]
    assert (here / "model.safetensors").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["here"]


def test_an_empty_out_is_refused_not_read_as_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run("convert", "tiny-gpt2", "--out", "")
    assert code == 2 and "'--out': empty; give the directory to write to" in err, err
    with pytest.raises(normswap.NormswapError, match="out_dir is empty"):
        io.check_destination("", overwrite=False)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("code", "wording"), [(28, "disk full: the filesystem of"),
                                                (27, "a file is larger than its filesystem or your file-size limit")])
def test_a_safetensors_write_error_is_named_by_its_os_cause(tmp_path, code, wording):
    """safetensors' Rust writer (under save_pretrained) raises SafetensorError, not OSError: a disk that
    fills up, or a file past a FAT32 / ``ulimit -f`` limit, is still one line naming the cause, not an
    internal error, and nothing is left behind."""
    from safetensors import SafetensorError

    out = tmp_path / "out"
    with pytest.raises(normswap.NormswapError, match=wording) as info:
        with io.atomic_directory(out, overwrite=False, needed=1000) as tmp:
            (tmp / "partial").write_text("x")
            raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")
    assert "nothing was written" in str(info.value)
    assert list(tmp_path.iterdir()) == []
    other = ValueError("not an I/O error (os error 28)")  # only the writer's own type is read this way
    with pytest.raises(ValueError), io.atomic_directory(out, overwrite=False) as tmp:
        raise other


def test_an_out_dir_that_is_no_path_and_a_model_object_to_convert_are_one_line_errors(tmp_path):
    """Fails without the checks: ``out_dir=None`` raised TypeError from os.fspath, and
    ``normswap.convert(model, ...)`` an OSError "File name too long" quoting the model's repr."""
    model, _ = presets.build("tiny-gpt2")
    with pytest.raises(normswap.NormswapError, match="out_dir must be a directory path .*, not NoneType"):
        normswap.convert("tiny-gpt2", None)
    with pytest.raises(normswap.NormswapError, match=r"not a GPT2LMHeadModel; for a model in memory: "
                                                     r"normswap.patch\(model\), then normswap.save"):
        normswap.convert(model, tmp_path / "out")
    normswap.patch(model)
    with pytest.raises(normswap.NormswapError, match="out_dir must be a directory path .*, not int"):
        normswap.save(model, 3)
    assert not list(tmp_path.iterdir())
