"""The shipped accelerate configs launch a recipe to the end: two CPU processes over gloo.

``accelerate launch --config_file recipes/accelerate/ddp.yaml -m normswap.recipes ...`` on a machine
without a GPU must form one process group (not two unconnected runs that each write ``OUT/model``):
the main process alone prints, writes the metrics and the model; the other waits; the launch exits 0
with one model that loads. A refused run (the output directory already holds a run) says so once.

The DDP launch is made once (module fixture ``ddp_run``) and read by two tests: the shipped config's
behaviour, and data parallelism itself (sharded batches, reduced metrics, progressive swaps broadcast
from rank 0, which until round 60 had a torchrun launch of its own in test_recipe_distill.py: the same
``MULTI_CPU`` process group over gloo, the same code in normswap, one more pair of interpreters).

The launcher itself runs as a child of the warm fork server (``tests/warm_python.py``, round 65); the two
processes it launches are fresh interpreters, as ``accelerate launch`` starts them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import normswap

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "distill-masked-lm.yaml"


# ``python -m accelerate.commands.launch`` as a child of the warm fork server (``tests/warm_python.py``): the
# launcher's own interpreter start (torch and accelerate imported before it parses its arguments, ~3.5 CPU s a
# launch) is not what these tests are about; the two processes it launches are fresh interpreters as before
# (torch's elastic agent starts ``sys.executable -m normswap.recipes`` for each), with the environment set here
LAUNCHER = "import runpy\nrunpy.run_module('accelerate.commands.launch', run_name='__main__', alter_sys=True)\n"


def _launch(warm, config: str, out: Path, source: Path, corpus: Path, *extra: str) -> subprocess.CompletedProcess:
    args = ["--config_file", str(ROOT / "recipes" / "accelerate" / config), "--num_processes", "2", "-m",
            "normswap.recipes", str(RECIPE), f"model.source={source}", f"data.path={corpus}", f"output.dir={out}",
            "train.steps=6", "train.warmup_steps=1", "data.seq_len=32", "data.batch_size=8",
            "data.eval_batch_size=32", "eval.every=3", "log.every=3", "checkpoint.every=3", "log.plot=false", *extra]
    # no accelerator visible, whatever the machine has: the CPU-only path is the one under test
    env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return warm.run(LAUNCHER, *args, env=env, timeout=240, cwd=out.parent)


def _our_lines(text: str) -> list[str]:
    """normswap's own output lines: not torch's launcher chatter (which starts with a log prefix), nor torchao's
    import-time notes on its CUDA extensions, which every process that imports it prints on a CPU-only machine (the
    ``dev`` extra installs torchao; PEFT and accelerate import it when present)."""
    return [line for line in text.replace("\r", "\n").splitlines()
            if line.strip() and not line.startswith(("W1", "E1", "I1", "[W", "[I"))
            and not (line.startswith("Failed to load ") and "/torchao/" in line)]


def _check_run(proc: subprocess.CompletedProcess, out: Path) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = _our_lines(proc.stdout) + _our_lines(proc.stderr)
    repeated = sorted({line for line in lines if lines.count(line) > 1})
    assert not repeated, f"printed more than once: {repeated}"
    assert sum(line.startswith("done:") for line in lines) == 1
    assert not any(line.startswith("error") for line in lines), lines
    assert "\r" not in proc.stdout + proc.stderr  # piped: no progress bar redrawn with carriage returns
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["step"], r["split"]) for r in records]
    assert len(keys) == len(set(keys)), keys  # one writer
    assert [r for r in records if r["split"] == "replicas"][0]["processes"] == 2  # one process group of 2
    model = normswap.load(out / "model")
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000003", "step-000006"]


# progressive swapping (exact conversion first, the Post-LN norms swapped two at a time at steps 1, 3
# and 5): each swap is decided on rank 0 and broadcast, so a replica that missed one is out of sync
PROGRESSIVE = ("convert.mode=exact", "progressive.enabled=true", "progressive.group_size=2",
               "progressive.interval=2", "progressive.start_step=1")


@pytest.fixture(scope="module")
def ddp_run(tiny_bert, corpus, tmp_path_factory, warm_python):
    """One two-process launch of the shipped DDP config with progressive swapping:
    ``(CompletedProcess, out)``."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    return _launch(warm_python, "ddp.yaml", out, tiny_bert, corpus, *PROGRESSIVE), out


def test_ddp_config_on_two_cpu_processes(ddp_run, tiny_bert, corpus, warm_python):
    proc, out = ddp_run
    _check_run(proc, out)
    written = sorted(p.name for p in (out / "model").iterdir())

    # a second launch into the same directory is refused once, before anything is touched
    again = _launch(warm_python, "ddp.yaml", out, tiny_bert, corpus)
    assert again.returncode == 1  # the launcher's code for a failed process (each exits 2: a usage error)
    errors = [line for line in _our_lines(again.stderr) if line.startswith("error:")]
    assert len(errors) == 1 and "already holds a run" in errors[0], again.stderr[-3000:]
    assert sorted(p.name for p in (out / "model").iterdir()) == written


def test_two_process_data_parallel_on_cpu(ddp_run):
    """gloo on CPU: sharded batches, reduced metrics, progressive swaps broadcast from rank 0."""
    proc, out = ddp_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the main process reports, once; the other one has no model directory to name ("model in None")
    lines = proc.stdout.splitlines()
    assert len(lines) == len(set(lines)) and "model in None" not in proc.stdout, proc.stdout
    assert sum(ln.startswith("done:") for ln in lines) == 1, proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sync = [r for r in records if r["split"] == "replicas"]
    assert sync == [{"step": 6, "split": "replicas", "processes": 2, "in_sync": True}]
    train = [r for r in records if r["split"] == "train"]
    assert train[-1]["tokens"] == 6 * 2 * 8 * 32  # two processes, each its own 8 rows per step
    loaded = normswap.load(out / "model")
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in loaded.modules())


@pytest.mark.slow
def test_fsdp_config_on_two_cpu_processes(tiny_bert, corpus, tmp_path, warm_python):
    """FSDP needs an accelerator: on CPU the config runs as data parallelism, says so once, and ends."""
    out = tmp_path / "run"
    proc = _launch(warm_python, "fsdp.yaml", out, tiny_bert, corpus, "train.mixed_precision=no")
    _check_run(proc, out)
    assert "FSDP needs a GPU" in proc.stdout
