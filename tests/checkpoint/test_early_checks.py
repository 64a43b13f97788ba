"""Checks that come before the work: a config that does not fit its weights, a destination that cannot be written.

* ``config.json`` against the safetensors headers (:func:`normswap.checkpoint.source.check_config_fits`):
  a 2-layer meta copy of the config's model, no tensor read, so a config claiming GPT-3's size beside a
  tiny checkpoint is refused in one line on both paths, before any model is built (the loaders are
  replaced by ones that fail the test if called).
* The destination is probed by creating a directory in it (:func:`normswap.checkpoint.io.check_destination`):
  ``/proc/foo`` is refused with the system's reason (not "disk full, 0 B free" after the conversion),
  and so is any place where creating a directory fails, whatever the permission bits say.
"""

from __future__ import annotations

import errno
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from normswap import presets
from normswap.checkpoint import io, source, streaming
from normswap.cli import main
from normswap.errors import NormswapError


@pytest.fixture(scope="module")
def gpt2_src(tmp_path_factory) -> Path:
    return presets.save("tiny-gpt2", tmp_path_factory.mktemp("src") / "gpt2")


def _with_config(src: Path, tmp_path: Path, **changes) -> Path:
    d = Path(shutil.copytree(src, tmp_path / "src"))
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _refused(args: list[str]) -> str:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


@pytest.fixture()
def nothing_is_built(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a model was built before the config was checked against the weights")

    monkeypatch.setattr(source, "load_model", never)
    monkeypatch.setattr(streaming, "convert_streaming", never)


CLAIMS = {
    "wider": {"n_embd": 4096, "n_layer": 8},  # the 600 KB checkpoint that built 6.7 GB first
    "gpt3-sized": {"n_embd": 12288, "n_layer": 96, "n_head": 96},  # ended in a raw allocator error
    "deeper": {"n_layer": 8},  # the right width, more layers than the files hold
}


@pytest.mark.parametrize("flag", ["--in-memory", "--low-memory"])
@pytest.mark.parametrize("claim", sorted(CLAIMS))
def test_a_config_that_does_not_fit_its_weights_is_refused_before_building(
        gpt2_src, tmp_path, flag, claim, nothing_is_built):
    src = _with_config(gpt2_src, tmp_path, **CLAIMS[claim])
    out = tmp_path / "out"
    line = _refused(["convert", str(src), "--out", str(out), "-q", flag])
    assert "config.json does not match the weights" in line, line
    if claim == "deeper":
        assert "builds 8 layers in `transformer.h`, the weights hold 2" in line, line
    else:
        assert "`transformer.wte.weight` is [320, 64] in the weights" in line, line
        assert "by the config" in line and "memory" not in line, line
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_config_that_fits_passes_the_check(gpt2_src):
    source.check_config_fits(source.resolve(str(gpt2_src)))  # no error


def test_proc_is_refused_before_the_work_with_its_real_cause(nothing_is_built):
    if not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    line = _refused(["convert", "tiny-gpt2", "--out", "/proc/normswap-out", "-q"])
    assert "cannot write --out /proc/normswap-out: a directory cannot be created in /proc" in line, line
    assert "disk full" not in line


def test_a_place_that_refuses_a_directory_is_refused_whatever_the_permission_bits_say(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(NormswapError, match=r"a directory cannot be created in .* \(Permission denied\)"):
        io.check_destination(tmp_path / "out", overwrite=False)


def test_the_probe_leaves_nothing_behind(tmp_path):
    io.check_destination(tmp_path / "a" / "b", overwrite=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_inspect_and_verify_check_the_config_before_loading(gpt2_src, tmp_path, command):
    # a small wrong claim, so that a missing early check shows as the loader's own message
    # ("tensor shape(s) do not match the config") instead of building a huge model
    import normswap

    converted = normswap.convert(gpt2_src, tmp_path / "converted", verify=False).output if command == "verify" else ""
    src = _with_config(gpt2_src, tmp_path, n_embd=128)
    line = _refused(["inspect", str(src)] if command == "inspect" else ["verify", str(src), converted])
    assert "config.json does not match the weights: `transformer.wte.weight` is [320, 64]" in line, line
