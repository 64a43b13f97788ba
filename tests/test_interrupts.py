"""Ctrl-C and SIGTERM mean what docs/cli.md says: exit 130 and one true sentence about what is on disk.

The subprocess tests interrupt ``python -m normswap convert`` at a spread of moments (imports, loading,
analysis, verification, while the temporary directory is written, right after the rename into place)
and check each time: exit 130, no traceback, no "Exception ignored", no click "Aborted!", and the disk
as the sentence says (nothing and no temporary directory left, or the complete, loadable output). The
in-process tests pin the two mechanisms behind it: an interrupt inside a finaliser is not lost, and
one during the commit is held until the output is whole.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from normswap import interrupts
from normswap.checkpoint import io
from normswap.cli.common import handle_errors
from normswap.errors import NormswapError

ROOT = Path(__file__).resolve().parents[1]
NOTHING = "error: interrupted; nothing was written"
WRITTEN = "error: interrupted after the output was complete"


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handling for one in-process test, whatever ran before it in this worker: the default
    handler (``KeyboardInterrupt``), SIGINT not blocked in this thread, run in the main thread (where Python runs
    handlers). The tests raise the signal with ``signal.raise_signal``, in this thread and at once: ``os.kill`` on
    the process lets the kernel pick any thread that does not block it, and an xdist worker that has run engines
    holds many, so the interrupt could arrive after the moment the test means (two order-dependent failures,
    "DID NOT RAISE", in fresh-clone runs)."""
    assert threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, handler if handler is not None else signal.SIG_DFL)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _check(out: Path, rc: int, stderr: str) -> str:
    """Assert the outcome of one interrupted run; returns which sentence it printed."""
    assert rc == 130, f"exit {rc}:\n{stderr[-2000:]}"
    for bad in ("Traceback", "Exception ignored", "Aborted!"):
        assert bad not in stderr, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}{io.TMP_MARK}")]
    assert not leftovers, leftovers
    if last.startswith(NOTHING):
        assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())
        return "nothing"
    assert last.startswith(WRITTEN) and str(out) in last, last
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    return "written"


def _handler_installed(pid: int) -> bool:
    """Whether process ``pid`` catches SIGTERM yet: normswap's handler, installed with the SIGINT one
    before the command line is parsed (Python itself starts first, ~0.1 s, with its own handling)."""
    status = Path(f"/proc/{pid}/status")
    if not status.is_file():
        time.sleep(1.0)
        return True
    caught = next((ln.split()[1] for ln in status.read_text().splitlines() if ln.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


def _interrupt(out: Path, when: float | str, sig: int = signal.SIGINT, model: str = "tiny-gpt2") -> str:
    """Run ``convert MODEL --out OUT`` and send ``sig`` once normswap's handler is installed and then
    ``when`` seconds later, or when its temporary directory appears (``"tmp"``), or when OUT appears
    (``"out"``: the rename into place just happened)."""
    p = subprocess.Popen([sys.executable, "-m", "normswap", "convert", model, "--out", str(out), "-q"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=out.parent)
    deadline = time.monotonic() + 240
    while p.poll() is None and not _handler_installed(p.pid):
        assert time.monotonic() < deadline
        time.sleep(0.002)
    if when == "tmp":
        while p.poll() is None and not any(out.parent.glob(f".{out.name}{io.TMP_MARK}*")):
            assert time.monotonic() < deadline
            time.sleep(0.005)
    elif when == "out":
        while p.poll() is None and not out.exists():
            assert time.monotonic() < deadline
            time.sleep(0.002)
    else:
        time.sleep(float(when))
    if p.poll() is not None:  # finished before the signal: then it must have succeeded
        _, err = p.communicate()
        assert p.returncode == 0, err[-2000:]
        return "finished"
    p.send_signal(sig)
    _, err = p.communicate(timeout=240)
    if p.returncode == 0:  # the signal landed in interpreter shutdown, after the command: ignored, not -2
        assert (out / "config.json").is_file() and (out / "model.safetensors").is_file(), err[-2000:]
        return "finished"
    return _check(out, p.returncode, err)


@pytest.mark.slow
def test_convert_interrupted_at_a_spread_of_moments(tmp_path):
    # from the moment normswap's handler is installed (before that, Python itself is still starting):
    # at once (imports, argument parsing), then during loading, analysis and verification, while the
    # temporary directory is written, and the moment the rename into place is seen
    # (more moments, 12 in all, were tried by hand on tiny-gpt2 and tiny-whisper: the same outcomes)
    moments: list[float | str] = [0.0, 2.0, 8.0, "tmp", "out"]
    seen = [_interrupt(tmp_path / f"out{i}", when) for i, when in enumerate(moments)]
    assert seen[0] == "nothing" and seen[-2] == "nothing", seen
    assert seen[-1] in ("written", "finished"), seen
    import normswap

    written = [tmp_path / f"out{i}" for i, s in enumerate(seen) if s in ("written", "finished")]
    for out in written:  # "written in full" is true: it loads
        normswap.load(out)


def test_sigterm_and_an_early_interrupt_exit_130_with_one_line(tmp_path):
    assert _interrupt(tmp_path / "a", 0.0, signal.SIGTERM) == "nothing"
    assert _interrupt(tmp_path / "b", 0.05, signal.SIGINT) == "nothing"
    assert _interrupt(tmp_path / "c", 1.0, signal.SIGTERM) == "nothing"


_SCRIPT = """
import os, signal, sys, time, weakref
from normswap import interrupts
interrupts.install()
import click
from normswap.cli.common import handle_errors

class Noisy:
    def __del__(self):  # the signal arrives while a finaliser runs (regex's Group.__del__ did this)
        os.kill(os.getpid(), signal.SIGINT)
        total = 0
        for i in range(10000):
            total += i

class Plain:
    pass

def callback():  # a weakref.finalize callback: no __del__ frame to recognise
    os.kill(os.getpid(), signal.SIGINT)
    sum(range(10000))

@click.command()
@click.argument("how")
@handle_errors
def body(how):
    if how == "del":
        Noisy()
    else:
        obj = Plain()
        weakref.finalize(obj, callback)
        del obj
    end = time.monotonic() + 5
    while time.monotonic() < end:  # a run that carries on after the finaliser, unless interrupted
        time.sleep(0.001)
    print("finished")

body()
"""


@pytest.mark.parametrize("how", ["del", "finalize"])
def test_an_interrupt_inside_a_finaliser_is_not_swallowed(tmp_path, how):
    script = tmp_path / "body.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    r = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 130, r.stderr
    assert "finished" not in r.stdout
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == NOTHING


def test_an_interrupt_during_the_commit_is_held_until_the_output_is_whole(tmp_path, monkeypatch, python_sigint):
    out = tmp_path / "out"
    move = io._move_into_place

    def interrupted_move(tmp, dst, *, overwrite):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C here (python_sigint: Python's own handler)
        move(tmp, dst, overwrite=overwrite)

    monkeypatch.setattr(io, "_move_into_place", interrupted_move)
    monkeypatch.setattr(interrupts, "_committed", [])
    with pytest.raises(KeyboardInterrupt), io.atomic_directory(out, overwrite=False) as tmp:
        (tmp / "a.txt").write_text("complete")
    assert (out / "a.txt").read_text() == "complete"
    assert interrupts.written() == [str(out)]
    assert interrupts.sentence().startswith("interrupted after the output was complete")
    assert not list(tmp_path.glob(f".out{io.TMP_MARK}*"))


def test_an_interrupt_before_the_commit_removes_everything(tmp_path):
    out = tmp_path / "deep" / "out"
    with pytest.raises(KeyboardInterrupt), io.atomic_directory(out, overwrite=False) as tmp:
        (tmp / "a.txt").write_text("partial")
        raise KeyboardInterrupt
    assert not (tmp_path / "deep").exists()


def test_an_interrupt_as_the_temporary_directory_is_made_leaves_nothing(tmp_path, monkeypatch, python_sigint):
    """Ctrl-C the moment ``mkdtemp`` has made the directory (before its name is held anywhere) must not leave
    it behind: the case a CLI run interrupted when the directory appears hit under load."""
    made = tempfile.mkdtemp

    def interrupted_mkdtemp(*args, **kwargs):
        path = made(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # Ctrl-C here (python_sigint: Python's own handler)
        return path

    monkeypatch.setattr(io.tempfile, "mkdtemp", interrupted_mkdtemp)
    out = tmp_path / "deep" / "out"
    with pytest.raises(KeyboardInterrupt), io.atomic_directory(out, overwrite=False) as tmp:
        (tmp / "a.txt").write_text("never")
    assert not (tmp_path / "deep").exists()


def test_a_fine_tune_says_which_checkpoint_to_resume_from(tmp_path):
    from normswap.recipes.runner import on_disk

    out = tmp_path / "run"
    assert on_disk(out) == "nothing was written"
    (out / "checkpoints" / "step-000010").mkdir(parents=True)
    (out / "checkpoints" / "step-000010" / "trainer_state.json").write_text("{}")
    (out / "checkpoints" / "step-000020").mkdir()  # interrupted while saving: not complete
    (out / "metrics.jsonl").write_text("{}\n")
    said = on_disk(out)
    assert said == (f"checkpoints to resume from: {out / 'checkpoints' / 'step-000010'} "
                    "(resume with checkpoint.resume=true)"), said


@pytest.mark.slow
def test_an_interrupted_fine_tune_names_the_checkpoint_it_can_resume_from(tmp_path, warm_python):
    """``python -m normswap finetune`` interrupted in its training loop. The command runs as a child of the warm
    fork server (``tests/warm_python.py``: a new process that has imported torch and transformers, not normswap;
    the interrupt lands after two checkpoints, long after any import), ended by the interpreter's own shutdown."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the fox {i % 7} jumps over the dog {i % 5} by the river" for i in range(400)) + "\n")
    run = tmp_path / "run"
    # OpenMP read its thread count when the server imported torch: the child sets the one thread itself
    code = ("import torch, runpy\ntorch.set_num_threads(1)\n"
            "runpy.run_module('normswap', run_name='__main__', alter_sys=True)\n")
    p = warm_python.start(code, "finetune", "distill-causal-lm", "model.source=tiny-gpt2", f"data.path={corpus}",
                          "train.steps=100000", "checkpoint.every=2", "log.plot=false", "log.progress_bar=false",
                          "data.max_documents=200", "data.batch_size=4", f"output.dir={run}", cwd=tmp_path,
                          timeout=600)
    deadline = time.monotonic() + 300
    while p.poll() is None and not list(run.glob("checkpoints/step-*/trainer_state.json")):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert p.poll() is None, p.communicate()[1][-2000:]
    time.sleep(0.3)  # into the training loop again, possibly while the next checkpoint is saved
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    prefix = "error: interrupted; checkpoints to resume from: "
    assert last.startswith(prefix) and last.endswith(" (resume with checkpoint.resume=true)"), last
    named = Path(last[len(prefix):].split(" (resume")[0])
    complete = sorted(run.glob("checkpoints/step-*/trainer_state.json"))
    assert named == complete[-1].parent, (named, complete)  # the newest complete one


@pytest.mark.parametrize("error", [ModuleNotFoundError, OSError, NormswapError])
def test_an_error_the_interrupt_caused_still_exits_130_with_its_sentence(error, capsys):
    """transformers' lazy import turns a ``KeyboardInterrupt`` raised inside it into ``ModuleNotFoundError``
    ("Could not import module 'GPT2LMHeadModel'"): a fresh-clone run printed "internal error", exit 1. Whatever
    error the interrupt turned into on its way out, the command exits 130 with the interrupt's line."""

    def body() -> None:
        try:
            signal.raise_signal(signal.SIGINT)  # the command's handler raises KeyboardInterrupt here
        except KeyboardInterrupt as exc:
            raise error("Could not import module 'GPT2LMHeadModel'") from exc

    with pytest.raises(SystemExit) as exit_info:
        handle_errors(body)()
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == NOTHING


def test_the_same_error_without_an_interrupt_is_an_error():
    def body() -> None:
        raise ModuleNotFoundError("Could not import module 'GPT2LMHeadModel'")

    with pytest.raises(SystemExit) as exit_info:
        handle_errors(body)()
    assert exit_info.value.code == 1
