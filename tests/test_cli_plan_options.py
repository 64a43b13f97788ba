"""``inspect`` takes ``convert``'s options that shape the plan, defined once (``normswap.cli.plan_opts``), and
shows the plan ``convert`` writes with them (``--low-memory`` too: the streamed plan, without loading the model);
``convert`` into a non-empty ``--out`` is a usage error (exit 2)."""

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
from normswap.cli.plan_opts import MEMORY_OPTIONS, PLAN_OPTIONS, ROTATION_OPTIONS, SOURCE_OPTIONS

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def _params(command: str) -> dict[str, click.Parameter]:
    return {p.name: p for p in main.commands[command].params if isinstance(p, click.Option)}


def _shared_names() -> set[str]:
    def name(option) -> str:
        return option(click.Command("probe")).params[0].name

    return {name(o) for o in (*PLAN_OPTIONS, *ROTATION_OPTIONS, *SOURCE_OPTIONS, *MEMORY_OPTIONS)}


def test_inspect_takes_every_option_of_convert_that_shapes_the_plan_with_the_same_definition():
    convert, inspect = _params("convert"), _params("inspect")
    shared = _shared_names()
    for name in ("rotation", "writer_centering", "stem_centering", "untie", "fmt", "layer_scale", "beta_placement",
                 "carry_multiple", "no_constant_trades", "no_mean_carry", "per_norm_centering", "rotate_output",
                 "revision", "new_head", "low_memory"):
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


@pytest.fixture(scope="module")
def deep_gpt2(tmp_path_factory) -> Path:
    """A 6-layer GPT-2 on disk (deeper than the streamed plan's 3- and 4-layer proxies: the plan is
    extrapolated), its LayerNorms' γ and β randomised."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=6, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
    out = tmp_path_factory.mktemp("deep") / "gpt2-6"
    model.save_pretrained(out)
    return out


LOW_MEMORY_CASES = [[], ["--format", "compat"], ["--beta-placement", "fold"], ["--fold-gamma"],
                    ["--keep-tied", "--writer-centering", "op"]]


@pytest.mark.parametrize("args", LOW_MEMORY_CASES, ids=[" ".join(a) or "default" for a in LOW_MEMORY_CASES])
def test_inspect_low_memory_shows_the_plan_convert_low_memory_writes_without_loading_the_model(
        tmp_path, deep_gpt2, monkeypatch, args):
    """Fails without ``inspect --low-memory`` (an unknown option, exit 2): the plan it shows is the streamed
    conversion's (extrapolated from proxies, β placed on the checkpoint's tensors), equal to the manifest
    ``convert --low-memory`` writes, and the model is never loaded."""
    from normswap.checkpoint import source

    def no_loading(*a, **k):
        raise AssertionError("inspect --low-memory loaded the model")

    with monkeypatch.context() as m:
        m.setattr(source, "load_model", no_loading)
        code, out, err = run("inspect", str(deep_gpt2), "--json", "--low-memory", *args)
        assert code == 0, err
        shown = json.loads(out)
        code, table, err = run("inspect", str(deep_gpt2), "--low-memory", *args)
        assert code == 0, err
    assert "--low-memory plans it" in table.splitlines()[0] and "analysing a 3-layer proxy" in err
    assert shown["options"]["analysis"].startswith("low-memory: 3-layer proxy extrapolated")
    code, _, err = run("convert", str(deep_gpt2), "--out", str(tmp_path / "o"), "-q", "--low-memory", *args)
    assert code == 0, err
    written = json.loads((tmp_path / "o" / "config.json").read_text())[hf.MANIFEST_KEY]["plan"]
    assert _planned(shown) == _planned(written)


def test_inspect_plans_as_convert_streams_when_the_model_would_not_fit(deep_gpt2, monkeypatch):
    """Without --low-memory, inspect streams its plan where convert would (the in-memory peak does not fit),
    and says so; --in-memory loads the model whatever the prediction."""
    from normswap.checkpoint import conversion

    monkeypatch.setattr(conversion, "wants_low_memory", lambda src, dtype: True)
    code, out, err = run("inspect", str(deep_gpt2))
    assert code == 0, err
    assert "--low-memory plans it" in out.splitlines()[0] and "streaming conversion (--low-memory)" in err
    code, out, err = run("inspect", str(deep_gpt2), "--in-memory")
    assert code == 0, err
    assert out.splitlines()[0].endswith("(GPT2LMHeadModel), as convert --format native plans it")


@pytest.mark.parametrize("args, fragment", [
    (["--rotate", "hadamard"], "--rotate needs the whole model in memory"),
    (["--writer-centering", "auto"], "--writer-centering auto chooses each writer's centering"),
    (["--per-norm-centering"], "--per-norm-centering needs the whole model in memory"),
])
def test_inspect_low_memory_refuses_what_convert_low_memory_refuses_before_importing_torch(tmp_path, args, fragment):
    proc = _cli(tmp_path, "inspect", str(tmp_path), "--low-memory", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(_ours(proc)) == 1 and fragment in _ours(proc)[0], _ours(proc)
    assert not _imported_torch(proc)


def test_inspect_low_memory_refuses_approximate_norms_as_convert_does(tmp_path):
    """A Post-LN model's approximate norms need calibration on the whole model: convert --low-memory refuses
    them (exit 2 since round 59: an option, --mode exact, converts the model), and inspect --low-memory says the
    same; --mode exact streams the exact ones."""
    from normswap import presets

    bert = presets.save("tiny-bert", tmp_path / "bert")
    code, _, err = run("inspect", str(bert), "--low-memory")
    assert code == 2 and "approximate norm(s) need calibration on the whole model" in err, err
    code2, _, err2 = run("convert", str(bert), "--out", str(tmp_path / "o"), "--low-memory")
    assert code2 == 2 and err2.strip().splitlines()[-1] == err.strip().splitlines()[-1], (err, err2)


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
