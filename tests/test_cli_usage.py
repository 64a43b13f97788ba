"""Every command's usage errors alike: a path that names nothing (or a file where a directory is expected), an
output that is the input or lies in it, conflicting options, and click's own checks (unknown option, bad value).
Exit 2, one ``error:`` line and nothing else on stderr, no traceback, nothing written and nothing touched (the
table of docs/cli.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from normswap import presets
from normswap.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """A source model on disk, a text file, an empty directory and a non-empty one; ``held``, a finetune run
    directory holding models (at ``model``, in ``checkpoints``) and a data file (as ``metrics.jsonl``) that a
    run there would write over, and ``linked``, one whose ``model`` is a symlink to ``src``."""
    root = tmp_path_factory.mktemp("usage")
    presets.save("tiny-gpt2", root / "src")
    held = root / "held"
    presets.save("tiny-gpt2", held / "model")
    presets.save("tiny-gpt2", held / "checkpoints" / "base")
    (held / "checkpoints" / "step-000002").mkdir()
    (held / "checkpoints" / "step-000002" / "trainer_state.json").write_text("{}")
    (held / "metrics.jsonl").write_text('{"text": "hello world"}\n')
    (root / "linked").mkdir()
    (root / "prev").mkdir()  # an earlier output holding the files a new conversion reads
    (root / "prev" / "cal.txt").write_text("hello world\n" * 4)
    (root / "prev" / "inputs.safetensors").write_bytes(b"")
    (root / "prevlink").symlink_to(root / "prev", target_is_directory=True)
    (root / "linked" / "model").symlink_to(root / "src", target_is_directory=True)
    (root / "f.txt").write_text("hello world\n" * 4)
    (root / "d").mkdir()
    (root / "mine").mkdir()
    (root / "mine" / "notes.txt").write_text("mine")
    return root


def _ft(root: Path, *extra: str) -> list[str]:
    return ["finetune", "distill-causal-lm", f"model.source={root / 'src'}", f"data.path={root / 'f.txt'}",
            "data.seq_len=4", "data.batch_size=2", "train.steps=1", *extra]


# (name, arguments built from the fixture's directory, a fragment of the one error line)
CASES = [
    ("convert: MODEL missing", lambda r: ["convert", str(r / "nope"), "--out", str(r / "o")], "does not exist"),
    ("convert: MODEL a file", lambda r: ["convert", str(r / "f.txt"), "--out", str(r / "o")], "is a file"),
    ("convert: misspelt preset", lambda r: ["convert", "tiny-gpt3", "--out", str(r / "o")], "did you mean tiny-gpt2"),
    ("convert: --out is MODEL", lambda r: ["convert", str(r / "src"), "--out", str(r / "src")], "overlaps"),
    ("convert: --out a file", lambda r: ["convert", str(r / "src"), "--out", str(r / "f.txt")], "is a file"),
    ("convert: --out not empty", lambda r: ["convert", str(r / "src"), "--out", str(r / "mine")], "not empty"),
    # round 58: --overwrite replaces the whole --out, and an input read from inside it went with it (exit 0)
    ("convert: --calibration-data inside --out",
     lambda r: ["convert", str(r / "src"), "--out", str(r / "prev"), "--overwrite", "--calibration-data",
                str(r / "prev" / "cal.txt")], "--calibration-data"),
    ("convert: --sample inside --out",
     lambda r: ["convert", str(r / "src"), "--out", str(r / "prev"), "--overwrite", "--sample",
                str(r / "prev" / "cal.txt")], "lies inside --out"),
    ("convert: --example-inputs inside --out",
     lambda r: ["convert", str(r / "src"), "--out", str(r / "prev"), "--overwrite", "--example-inputs",
                str(r / "prev" / "inputs.safetensors")], "lies inside --out"),
    ("convert: --out a symlink to the directory holding --calibration-data",
     lambda r: ["convert", str(r / "src"), "--out", str(r / "prevlink"), "--overwrite", "--calibration-data",
                str(r / "prev" / "cal.txt")], "lies inside --out"),
    ("convert: --calibration-data missing",
     lambda r: ["convert", str(r / "src"), "--out", str(r / "o"), "--calibration-data", str(r / "nope.txt")],
     "does not exist"),
    ("convert: --calibration-data a directory",
     lambda r: ["convert", str(r / "src"), "--out", str(r / "o"), "--calibration-data", str(r / "d")],
     "is a directory"),
    ("convert: --low-memory with a preset", lambda r: ["convert", "tiny-gpt2", "--out", str(r / "o"), "--low-memory"],
     "is a preset"),
    ("convert: --low-memory with --sample",
     lambda r: ["convert", str(r / "src"), "--out", str(r / "o"), "--low-memory", "--sample", str(r / "f.txt")],
     "need the whole model in memory"),
    ("convert: --low-memory with --rotate",
     lambda r: ["convert", str(r / "src"), "--out", str(r / "o"), "--low-memory", "--rotate", "hadamard"],
     "--rotate needs the whole model"),
    # round 57: --rotate none turns no stream and folds no γ, so no bias slot is made; the library refused it
    # after loading the model (exit 1, in its own words)
    ("convert: --no-bias-slots with --rotate none",
     lambda r: ["convert", str(r / "src"), "--out", str(r / "o"), "--no-bias-slots", "--rotate", "none",
                "--online-hadamard"], "--no-bias-slots applies with --fold-gamma"),
    ("inspect: MODEL missing", lambda r: ["inspect", str(r / "nope")], "does not exist"),
    ("inspect: MODEL a file", lambda r: ["inspect", str(r / "f.txt")], "is a file"),
    ("inspect: --example-inputs missing", lambda r: ["inspect", str(r / "src"), "--example-inputs", str(r / "x.st")],
     "no such file"),
    ("inspect: --sample a directory", lambda r: ["inspect", str(r / "src"), "--sample", str(r / "d")],
     "is a directory"),
    ("inspect: --low-memory with a preset", lambda r: ["inspect", "tiny-gpt2", "--low-memory"], "is a preset"),
    ("inspect: --format compat --mode all", lambda r: ["inspect", str(r / "src"), "--format", "compat", "--mode",
                                                       "all"], "--format compat keeps LayerNorms"),
    ("verify: ORIGINAL missing", lambda r: ["verify", str(r / "nope"), str(r / "d")], "ORIGINAL"),
    ("verify: CONVERTED missing", lambda r: ["verify", str(r / "src"), str(r / "nope")], "CONVERTED"),
    ("verify: CONVERTED a file", lambda r: ["verify", str(r / "src"), str(r / "f.txt")], "is a file"),
    ("verify: CONVERTED is ORIGINAL", lambda r: ["verify", str(r / "src"), str(r / "src")], "the same directory"),
    ("verify: --data missing", lambda r: ["verify", str(r / "src"), str(r / "d"), "--data", str(r / "nope.txt")],
     "does not exist"),
    ("verify: --data and --sample", lambda r: ["verify", str(r / "src"), str(r / "d"), "--data", str(r / "f.txt"),
                                               "--sample", str(r / "f.txt")], "pass one"),
    ("finetune: RECIPE file missing", lambda r: ["finetune", str(r / "nope.yaml")], "does not exist"),
    ("finetune: RECIPE a directory", lambda r: ["finetune", str(r / "d")], "is a directory"),
    ("finetune: data.path missing", lambda r: [*_ft(r), f"data.path={r / 'nope.txt'}"], "does not exist"),
    ("finetune: output.dir a file", lambda r: _ft(r, f"output.dir={r / 'f.txt'}"), "is a file"),
    ("finetune: output.dir not empty", lambda r: _ft(r, f"output.dir={r / 'mine'}"), "not empty"),
    ("finetune: output.dir is model.source", lambda r: _ft(r, f"output.dir={r / 'src'}"), "model.source"),
    # round 58: an output.dir that holds a model or data the run reads, where the run writes or replaces (each
    # ran on before: output.overwrite removed the source model, resume would write over it)
    ("finetune: output.overwrite would replace model.source at output.dir/model",
     lambda r: _ft(r, f"model.source={r / 'held' / 'model'}", f"output.dir={r / 'held'}", "output.overwrite=true"),
     "which is or holds model.source"),
    ("finetune: checkpoint.resume would write over model.source under output.dir/checkpoints",
     lambda r: _ft(r, f"model.source={r / 'held' / 'checkpoints' / 'base'}", f"output.dir={r / 'held'}",
                   "checkpoint.resume=true"), "which is or holds model.source"),
    ("finetune: the final model would be written over model.student",
     lambda r: _ft(r, f"model.student={r / 'held' / 'model'}", f"output.dir={r / 'held'}", "checkpoint.resume=true"),
     "which is or holds model.student"),
    ("finetune: output.overwrite would remove data.path",
     lambda r: _ft(r, f"data.path={r / 'held' / 'metrics.jsonl'}", f"output.dir={r / 'held'}",
                   "output.overwrite=true"), "which is or holds data.path"),
    ("finetune: output.dir/model a symlink to model.source",
     lambda r: _ft(r, f"output.dir={r / 'linked'}", "output.overwrite=true"), "which is or holds model.source"),
    ("finetune: bad override", lambda r: _ft(r, "train.lr=abc", f"output.dir={r / 'o'}"), "train.lr"),
    ("bench: --json a directory", lambda r: ["bench", "--json", str(r / "d")], "is a directory"),
    # click's own checks, said in the same one line (they printed a usage block, a hint and `Error:` before)
    ("unknown command", lambda r: ["conver", "tiny-gpt2"], "Did you mean 'convert'?"),
    ("unknown option", lambda r: ["inspect", "tiny-gpt2", "--bogus"], "No such option '--bogus'"),
    ("bad choice", lambda r: ["inspect", "tiny-gpt2", "--mode", "bogus"], "inspect --help`)"),  # CliRunner: `main`
    ("missing argument", lambda r: ["verify", "tiny-gpt2"], "Missing argument 'CONVERTED'"),
    ("missing --out", lambda r: ["convert", "tiny-gpt2", str(r / "o")], "normswap convert tiny-gpt2 --out"),
]


def _tree(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("make_args, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_usage_error_is_one_line_exit_2_and_touches_nothing(place, make_args, fragment):
    before = _tree(place)
    res = CliRunner().invoke(main, make_args(place))
    err = res.stderr
    assert res.exit_code == 2, (res.exit_code, err[-1500:], res.exception)
    assert "Traceback" not in err and not (res.exception and not isinstance(res.exception, SystemExit))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
    assert _tree(place) == before  # nothing written, nothing touched


def test_finetune_into_a_directory_that_holds_a_run_is_refused_before_the_heavy_imports(place, tmp_path):
    """Fails before round 56: into a directory holding a run it exited 1 after importing the trainer; into
    one holding other files (or into the model's own directory) it trained and wrote there."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    before = _tree(tmp_path)
    for out, fragment in ((run_dir, "already holds a run"), (place / "mine", "exists and is not empty")):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "normswap", *_ft(place, f"output.dir={out}")],
                              capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
        ours = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
        assert proc.returncode == 2 and len(ours) == 1 and fragment in ours[0], proc.stderr[-2000:]
            # the recipe's schema imports torch; the trainer's libraries are not imported, no model is loaded
        heavy = [ln for ln in proc.stderr.splitlines() if ln.startswith("import time:")
                 and ln.rsplit("|", 1)[-1].strip() in ("transformers", "accelerate", "normswap.recipes.runner")]
        assert not heavy, (out, heavy)
    assert _tree(tmp_path) == before


def test_finetune_resumes_and_overwrites_where_the_directory_allows_it(place, tmp_path):
    """What the refusals leave open: checkpoint.resume with a checkpoint to resume from, output.overwrite
    (which replaces the run's own files only), and a directory holding only what an early interrupt left."""
    from normswap.recipes.config import load_config
    from normswap.recipes.outdir import check_output

    out = tmp_path / "run"
    (out / "checkpoints" / "step-000002").mkdir(parents=True)
    (out / "checkpoints" / "step-000002" / "trainer_state.json").write_text("{}")
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "notes.txt").write_text("mine")
    base = [f"model.source={place / 'src'}", f"data.path={place / 'f.txt'}", f"output.dir={out}"]
    got, latest, replaced = check_output(load_config("distill-causal-lm", [*base, "checkpoint.resume=true"]))
    assert got == out and latest == out / "checkpoints" / "step-000002" and replaced == []
    _, latest, replaced = check_output(load_config("distill-causal-lm", [*base, "output.overwrite=true"]))
    assert latest is None and sorted(p.name for p in replaced) == ["checkpoints", "metrics.jsonl"]
    early = tmp_path / "early"
    early.mkdir()
    (early / "recipe.yaml").write_text("task: causal-lm\n")
    assert check_output(load_config("distill-causal-lm", [*base[:2], f"output.dir={early}"]))[1:] == (None, [])


def test_finetune_may_write_beside_a_model_it_reads_that_the_run_does_not_touch(tmp_path):
    """A model kept elsewhere under output.dir (not at a path the run writes or replaces) is no clash: with
    output.overwrite the run replaces its own files only, and the model stays out of what it replaces."""
    from normswap.recipes.config import load_config
    from normswap.recipes.outdir import check_output

    out = tmp_path / "run"
    presets.save("tiny-gpt2", out / "teacher")
    (out / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "f.txt").write_text("hello world\n")
    cfg = load_config("distill-causal-lm", [f"model.source={out / 'teacher'}", f"data.path={tmp_path / 'f.txt'}",
                                            f"output.dir={out}", "output.overwrite=true"])
    got, latest, replaced = check_output(cfg)
    assert got == out and latest is None and replaced == [out / "metrics.jsonl"]


# (arguments after `python -m normswap.recipes`, a fragment of the one error line): the module runs `finetune`
RECIPES_CASES = [
    (["--bogus"], "No such option '--bogus'"),
    (["distill-causal-lm", "--nope"], "No such option '--nope'"),
    ([], "missing RECIPE"),
    (["distill-causal-lm", "train.lr=abc"], "train.lr"),
]


@pytest.mark.parametrize("args, fragment", RECIPES_CASES, ids=[" ".join(c[0]) or "no RECIPE" for c in RECIPES_CASES])
def test_python_m_normswap_recipes_says_a_usage_error_in_one_line(tmp_path, monkeypatch, capsys, args, fragment):
    """``python -m normswap.recipes`` (for ``accelerate launch -m``) runs ``normswap finetune``, and says its usage
    mistakes as ``normswap`` does: one ``error:`` line, exit 2. Fails before round 57: click's usage block, a
    "Try ... --help" hint and an ``Error:`` line for click's own checks.

    In this process: the module's one statement, ``run_command(finetune, "python -m normswap.recipes")``, with
    these arguments (a fresh interpreter costs an import of torch, ~3 s of CPU, per case);
    ``test_python_m_normswap_recipes_lists_and_helps_as_finetune_does`` runs the module itself."""
    from normswap.cli import run_command
    from normswap.cli.finetune_cmd import finetune

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        run_command(finetune, "python -m normswap.recipes", list(args))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert exit_.value.code == 2 and len(lines) == 1, err[-2000:]
    assert lines[0].startswith("error: ") and fragment in lines[0], lines
    assert not list(tmp_path.iterdir())


def test_python_m_normswap_recipes_lists_and_helps_as_finetune_does(tmp_path, capsys):
    """The module run as a program (a fresh interpreter: its ``__main__`` and prog name), and its ``--list``."""
    from normswap.cli import run_command
    from normswap.cli.finetune_cmd import finetune

    with pytest.raises(SystemExit) as listed:
        run_command(finetune, "python -m normswap.recipes", ["--list"])
    out = capsys.readouterr()
    assert listed.value.code == 0 and "distill-causal-lm" in out.out, out.err[-2000:]
    helped = subprocess.run([sys.executable, "-m", "normswap.recipes", "--help"], capture_output=True, text=True,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert helped.returncode == 0 and helped.stdout.startswith("Usage: python -m normswap.recipes"), helped.stdout
