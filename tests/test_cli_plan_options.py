"""``inspect`` takes ``convert``'s options that shape the plan, defined once (``normswap.cli.plan_opts``), and
shows the plan ``convert`` writes with them; ``convert`` into a non-empty ``--out`` is a usage error (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from normswap.checkpoint import hf
from normswap.cli import main
from normswap.cli.plan_opts import PLAN_OPTIONS, ROTATION_OPTIONS, SOURCE_OPTIONS

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def _params(command: str) -> dict[str, click.Parameter]:
    return {p.name: p for p in main.commands[command].params if isinstance(p, click.Option)}


def _shared_names() -> set[str]:
    def name(option) -> str:
        return option(click.Command("probe")).params[0].name

    return {name(o) for o in (*PLAN_OPTIONS, *ROTATION_OPTIONS, *SOURCE_OPTIONS)}


def test_inspect_takes_every_option_of_convert_that_shapes_the_plan_with_the_same_definition():
    convert, inspect = _params("convert"), _params("inspect")
    shared = _shared_names()
    for name in ("rotation", "writer_centering", "stem_centering", "untie", "fmt", "layer_scale", "beta_placement",
                 "carry_multiple", "no_constant_trades", "no_mean_carry", "per_norm_centering", "rotate_output",
                 "revision", "new_head"):
        assert name in shared, name
    for name in sorted(shared):
        a, b = convert[name], inspect[name]
        assert (a.opts, a.secondary_opts, a.default, a.help, a.hidden, repr(a.type)) == \
            (b.opts, b.secondary_opts, b.default, b.help, b.hidden, repr(b.type)), name


# the fields convert fills in after planning: each norm's measured error and the RMSNorm's parameters, the
# rotation it applied, the calibration it ran
AFTER_PLANNING = {"error", "rms_weight", "rms_bias"}


def _planned(plan: dict) -> dict:
    plan = dict(plan)
    plan.pop("rotations", None)
    plan.pop("adapter_bases", None)  # recorded by the surgery as it edits the Linears, not planned
    plan["options"] = {k: v for k, v in plan["options"].items() if not k.startswith("calibration")}
    plan["sites"] = [{k: v for k, v in site.items() if k not in AFTER_PLANNING} for site in plan["sites"]]
    return json.loads(json.dumps(plan, default=str, sort_keys=True))


CASES = [
    ("tiny-gpt2", []),  # β kept in a checkpoint: inspect planned the in-memory patch's "rounding" before
    ("tiny-gpt2", ["--format", "compat"]),
    ("tiny-gpt2", ["--rotate", "hadamard", "--seed", "3"]),
    ("tiny-gpt2", ["--untie"]),
    ("tiny-vit", ["--writer-centering", "op", "--stem-centering", "weights"]),
    ("tiny-whisper", ["--format", "compat", "--rotate", "hadamard"]),
    ("tiny-bert", ["--per-norm-centering", "--no-mean-carry"]),
]


@pytest.mark.parametrize("preset, args", CASES, ids=[" ".join([p, *a]) for p, a in CASES])
def test_inspect_shows_the_plan_convert_writes_with_the_same_options(tmp_path, preset, args):
    code, out, err = run("inspect", preset, "--json", *args)
    assert code == 0, err
    shown = json.loads(out)
    code, _, err = run("convert", preset, "--out", str(tmp_path / "o"), "-q", *args)
    assert code == 0, err
    written = json.loads((tmp_path / "o" / "config.json").read_text())[hf.MANIFEST_KEY]["plan"]
    assert _planned(shown) == _planned(written)


def test_inspect_table_says_which_format_it_planned_for():
    code, out, err = run("inspect", "tiny-gpt2", "--format", "compat")
    assert code == 0, err
    assert out.splitlines()[0] == "tiny-gpt2 (GPT2LMHeadModel), as convert --format compat plans it"
    assert "stock LayerNorm bias(es)" in " ".join(out.split())  # the compat summary, as convert prints it


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "normswap", *args], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _ours(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]


def _imported_torch(proc: subprocess.CompletedProcess) -> bool:
    return any(line.rstrip().endswith("| torch") for line in proc.stderr.splitlines())


@pytest.mark.parametrize("args, fragment", [
    (["--writer-centering", "op", "--rotate", "hadamard"], "--writer-centering op keeps writers' weights"),
    (["--rotate", "none"], "--rotate none turns no stream"),
    (["--learn-bits", "4", "--rotate", "hadamard"], "--learn-bits applies to a learned rotation"),
    (["--format", "compat", "--mode", "all"], "--format compat keeps LayerNorms"),
    (["--new-head"], "--new-head adds a task head"),
])
def test_inspect_refuses_what_convert_refuses_before_importing_torch(tmp_path, args, fragment):
    proc = _cli(tmp_path, "inspect", "tiny-gpt2", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(_ours(proc)) == 1 and fragment in _ours(proc)[0], _ours(proc)
    assert not _imported_torch(proc)


def test_convert_into_a_non_empty_out_is_a_usage_error_before_anything_loads(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = _cli(tmp_path, "convert", "tiny-gpt2", "--out", str(out))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert _ours(proc) == [f"error: --out {out} exists and is not empty; pass --overwrite to replace it, or "
                           "choose a new directory"]
    assert not _imported_torch(proc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"] and [p.name for p in out.iterdir()] == ["notes.txt"]
    # a file as --out, and the source itself, are usage errors too
    (tmp_path / "f.txt").write_text("x")
    proc = _cli(tmp_path, "convert", "tiny-gpt2", "--out", str(tmp_path / "f.txt"))
    assert proc.returncode == 2 and "is a file" in proc.stderr, proc.stderr[-2000:]  # click's own check
    assert not _imported_torch(proc)
    proc = _cli(tmp_path, "convert", str(out), "--out", str(out / "sub"))
    assert proc.returncode == 2 and "overlaps the source model" in _ours(proc)[0], proc.stderr[-2000:]
    assert not _imported_torch(proc) and [p.name for p in out.iterdir()] == ["notes.txt"]
