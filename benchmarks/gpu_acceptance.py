"""GPU acceptance in one command (issue 23): every GPU check of normswap, on one H100 or H200, in at
most 8 minutes of wall time, with a report that always gets written.

How a session that is lent a GPU runs it: one call of the device tool, from the repository root,
``timeout_s`` 540 (the script stops itself after ``--deadline`` seconds, 480 by default):

    python benchmarks/gpu_acceptance.py --out $OUT/gpu

The machine is bare and offline: the script installs the project from the working tree itself
(``pip install -e . --no-deps --no-build-isolation --no-index``; the stages put the working tree on
PYTHONPATH anyway), and a stage whose packages are missing is recorded as skipped, with their names,
instead of crashing. To bring packages the image lacks, download their wheels into an ignored folder
before the call and carry it (64 MiB in all); wheels of distributions not installed yet are then
installed from it (with dependencies found there; nothing installed is replaced unless the folder
holds a newer one). Liger, which the graph targets compare against, is one 1 MB pure-Python wheel
(and ``wheel`` lets an older setuptools build the editable install):

    pip download --no-deps -d out/wheelhouse liger-kernel==0.8.5 wheel
    python benchmarks/gpu_acceptance.py --out $OUT/gpu --wheelhouse out/wheelhouse   # carry out/wheelhouse

What comes back, under ``--out``: ``report.md`` (goals table, stages, measurements, the output tail of
every stage that did not pass), ``report.json`` (the same as data: device, driver, versions, per stage
status, timings and output tail, per target pass/fail), ``logs/STAGE.log`` (full output) and
``stages/`` (each stage's own JSON, the test shards' logs and JUnit XML). Both reports are rewritten
before and after every stage, so a run that is killed still leaves a partial report saying where it
stopped.

Then: record the figures in the results docs (the page the task names: device, driver, versions,
date, this command), and turn every failed goal into a fix or an issue. To rerun only what failed,
with more time, into another folder (a stage may also use time that earlier stages left unused, up
to its budget again; the last stage gets whatever is left before the deadline):

    python benchmarks/gpu_acceptance.py --out $OUT/gpu2 --stages compile-train,tests --budget tests=200 --deadline 280

``--plan`` prints the stages, their budgets and commands without running anything (no GPU needed).
Without a CUDA device the script exits 2 with one line.

Stages, in order (each a subprocess with its own time budget; one that fails or runs out of time is
recorded with its last lines of output and the next one still runs; those that are not benchmark
scripts are in ``gpu_acceptance_workers.py``):

* ``install``: the editable install above (stages run with the working tree on PYTHONPATH anyway);
* ``env``: device, driver, CUDA, memory, torch/triton/transformers/accelerate versions;
* ``host``: host cost per module call, ``normswap.RMSNorm`` against ``nn.LayerNorm``, fp32/bf16/fp16,
  with and without bias, with and without grad (``gpu_targets.py --parts host``);
* ``targets-eager`` and ``targets-graph``: ``gpu_targets.py`` on both clocks (eager per call, CUDA-graph
  replay), every target row;
* ``model``: ``bench_model.py`` against the original, GPT-2-small and Pythia-410M shapes: batch-1
  decode, prefill, eager bf16-autocast train step;
* ``compile-decode`` and ``compile-train``: the same with ``torch.compile`` (GPT-2-small);
* ``fsdp`` and ``ddp``: ``distill-causal-lm`` on a tiny toy GPT-2 for a few steps under
  ``accelerate launch`` with the shipped FSDP2 (1 process) and DDP configs (1 process per GPU: on
  one GPU accelerate does not wrap the model in DDP), then ``normswap.load`` of the saved model;
* ``tests``: the README test command, ``python -m pytest -q``, with CUDA visible, split by file into
  ``--test-shards`` concurrent processes (each with ``--continue-on-collection-errors``: a module that
  fails to import costs only its own tests; ``--test-shards 1``: the command verbatim); the last
  stage, it may use whatever time is left before the deadline.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

STARTED = time.monotonic()  # the deadline counts from here: the run's own start-up is in the 8 minutes
REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().with_name("gpu_acceptance_workers.py")  # install, env, fsdp, ddp, tests
DEADLINE_S = 480  # the whole run, install included: 8 minutes
GRACE_S = 10  # after SIGINT at a stage's budget, before SIGKILL (pytest writes its junit XML then)
TAIL_LINES = 40
CORE = ("torch", "transformers", "safetensors", "yaml")  # what `import normswap` and its benchmarks need
# (models, phases) of the bench_model stages; the goals expect a row for each pair
MODEL_RUNS = {
    "model": (("gpt2-small", "pythia-410m"), ("decode", "prefill", "train")),
    "compile-decode": (("gpt2-small",), ("decode-compile",)),
    "compile-train": (("gpt2-small",), ("compile",)),
}
PHASE_GOALS = {  # bench_model phase -> (goal, limit); prefill is measured, with no target
    "decode": ("decode at batch 1, eager: converted / original", 1.00),
    "decode-compile": ("decode at batch 1, compiled: converted / original", 1.00),
    "train": ("eager train step: converted / original", 0.99),
    "compile": ("compiled train step: converted / original", 1.00),
}
RECIPE_GOALS = {"fsdp": "FSDP2 recipe run finishes, saves a model normswap.load reads",
                "ddp": "DDP recipe run finishes, saves a model normswap.load reads"}


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: int
    what: str
    needs: tuple[str, ...] = CORE  # importable modules; a stage missing one is skipped, not run
    ok_codes: tuple[int, ...] = (0,)  # exit codes that mean "ran to the end" (1: some target missed)


STAGES = (
    Stage("install", 20, "pip install -e . from the working tree (no deps, no build isolation, no index)",
          needs=()),
    Stage("env", 15, "device, driver, CUDA, versions", needs=("torch",)),
    Stage("host", 30, "host cost per module call vs nn.LayerNorm (gpu_targets --parts host)", ok_codes=(0, 1)),
    Stage("targets-eager", 40, "gpu_targets --parts eager (eager per call, L2 flushed)",
          needs=(*CORE, "triton"), ok_codes=(0, 1)),
    Stage("targets-graph", 40, "gpu_targets --parts graph (CUDA-graph replay, GPU time only)",
          needs=(*CORE, "triton"), ok_codes=(0, 1)),
    Stage("model", 60, "bench_model: decode at batch 1, prefill, eager train step vs the original"),
    Stage("compile-decode", 55, "bench_model: compiled decode at batch 1 (static cache) vs the original"),
    Stage("compile-train", 60, "bench_model: torch.compile train step vs the original"),
    Stage("fsdp", 45, "distill-causal-lm under accelerate FSDP2, 1 process; normswap.load of the result",
          needs=(*CORE, "accelerate")),
    Stage("ddp", 35, "distill-causal-lm under accelerate DDP config; normswap.load of the result",
          needs=(*CORE, "accelerate")),
    Stage("tests", 60, "the README test command (python -m pytest -q), CUDA visible",
          needs=(*CORE, "pytest"), ok_codes=(0, 1)),
)
BY_NAME = {s.name: s for s in STAGES}


class UsageError(Exception):
    """A bad command line: one line on stderr, exit 2."""


# ------------------------------------------------------------------------------------------ arguments
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "out" / "gpu_acceptance"), help="report folder")
    ap.add_argument("--stages", default=",".join(BY_NAME),
                    help="comma-separated, from: " + ",".join(BY_NAME) + " (env always runs)")
    ap.add_argument("--budget", action="append", default=[], metavar="STAGE=SECONDS",
                    help="another time budget for a stage (repeatable)")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S,
                    help="wall seconds for the whole run; the selected budgets must fit in it")
    ap.add_argument("--test-shards", type=int, default=None,
                    help="concurrent pytest processes for the tests stage (default: cores - 4, at most 12)")
    ap.add_argument("--wheelhouse", default=None, help="a folder of wheels to install missing packages from")
    ap.add_argument("--plan", "--dry-run", dest="plan", action="store_true",
                    help="print the stages, budgets and commands; run nothing")
    return ap.parse_args(argv)


def select(args: argparse.Namespace) -> tuple[list[Stage], dict[str, float]]:
    """The stages to run, in the script's order, and their budgets; UsageError on a bad selection."""
    names = [n.strip() for n in args.stages.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        raise UsageError(f"unknown stage(s) {', '.join(unknown) or '(none given)'}; choose from {','.join(BY_NAME)}")
    stages = [s for s in STAGES if s.name in names or s.name == "env"]  # every report names its device
    budgets = {s.name: float(s.budget_s) for s in stages}
    for item in args.budget:
        name, _, value = item.partition("=")
        if name not in BY_NAME:
            raise UsageError(f"--budget {item}: unknown stage {name!r}; choose from {','.join(BY_NAME)}")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not seconds > 0:
            raise UsageError(f"--budget {item}: give STAGE=SECONDS with SECONDS > 0")
        if name in budgets:
            budgets[name] = seconds
    if sum(budgets.values()) > args.deadline:
        raise UsageError(f"the selected stages' budgets sum to {sum(budgets.values()):.0f} s, more than the "
                         f"{args.deadline:.0f} s deadline: select fewer stages or lower --budget")
    if args.test_shards is not None and args.test_shards < 1:
        raise UsageError("--test-shards must be at least 1")
    return stages, budgets


def default_shards() -> int:
    return max(1, min(12, (os.cpu_count() or 1) - 4))


def command(stage: Stage, out: Path, args: argparse.Namespace) -> list[str]:
    """The subprocess that runs ``stage`` (results under ``out/stages``)."""
    py, bench = sys.executable, REPO / "benchmarks"
    res = out / "stages"
    if stage.name in ("install", "env", "fsdp", "ddp", "tests"):
        cmd = [py, str(WORKERS), stage.name, "--out", str(out)]
        if stage.name == "install" and args.wheelhouse:
            cmd += ["--wheelhouse", str(Path(args.wheelhouse).resolve())]
        if stage.name == "tests":
            cmd += ["--test-shards", str(args.test_shards or default_shards())]
        return cmd
    if stage.name == "host":
        return [py, str(bench / "gpu_targets.py"), "--parts", "host", "--rounds", "15", "--out", str(res / "host.json")]
    if stage.name.startswith("targets-"):
        part = stage.name.removeprefix("targets-")
        return [py, str(bench / "gpu_targets.py"), "--parts", part, "--rounds", "5",
                "--out", str(res / f"{stage.name}.json")]
    models, phases = MODEL_RUNS[stage.name]
    return [py, str(bench / "bench_model.py"), "--device", "cuda", "--models", ",".join(models),
            "--phases", ",".join(phases), "--rounds", "5", "--out", str(res / stage.name)]


def result_path(out: Path, name: str) -> Path:
    if name in MODEL_RUNS:
        return out / "stages" / name / "bench_model_cuda.json"
    return out / "stages" / f"{name}.json"


def stage_env() -> dict[str, str]:
    """Offline, unbuffered, with the working tree importable even if the install stage failed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


# ---------------------------------------------------------------------------------------- running
def tail(text: str, lines: int = TAIL_LINES, chars: int = 4000) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


def default_sigint() -> None:
    """In the child before exec: SIGINT back to its default, so that Python turns it into
    KeyboardInterrupt even where this script was started with SIGINT ignored (a background job)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_stage(cmd: Sequence[str], timeout_s: float, log_path: Path, env: dict[str, str] | None = None,
              cwd: Path = REPO, grace_s: float = GRACE_S) -> dict:
    """Run ``cmd`` in its own process group, output to ``log_path``. At ``timeout_s`` the group gets
    SIGINT (Python unwinds, pytest writes its report), after ``grace_s`` more SIGKILL.
    Returns ``{"rc", "seconds", "timed_out", "tail"}``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(map(str, cmd)) + "\n")
        log.flush()
        try:
            proc = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=str(cwd), start_new_session=True, preexec_fn=default_sigint)
        except OSError as exc:
            log.write(f"could not start: {exc}\n")
            return {"rc": None, "seconds": 0.0, "timed_out": False, "tail": f"could not start: {exc}"}
        try:
            rc = proc.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.returncode
        try:  # what is left of the group once its leader is gone (shards, compile workers): end it
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    seconds = time.monotonic() - t0
    if timed_out:
        with open(log_path, "a") as log:
            log.write(f"\n[gpu_acceptance] stopped after {timeout_s:.0f} s (its time budget)\n")
    return {"rc": rc, "seconds": round(seconds, 1), "timed_out": timed_out,
            "tail": tail(log_path.read_text(errors="replace"))}


def stage_record(stage: Stage, budget: float, outcome: dict | None, missing: Sequence[str] = (),
                 note: str = "") -> dict:
    """One row of ``report["stages"]``. status: ok (ran to the end), failed, timeout, skipped
    (packages missing), not-run (no time left), running, pending."""
    rec = {"name": stage.name, "what": stage.what, "budget_s": budget, "status": "pending", "rc": None,
           "seconds": None, "tail": "", "note": note, "log": f"logs/{stage.name}.log"}
    if missing:
        rec.update(status="skipped", note=f"missing package(s): {', '.join(missing)}", log=None)
    elif outcome is not None:
        rc = outcome["rc"]
        status = "timeout" if outcome["timed_out"] else "ok" if rc in stage.ok_codes else "failed"
        rec.update(status=status, rc=rc, seconds=outcome["seconds"], tail=outcome["tail"])
        if status == "timeout":
            stopped = f"stopped at its time limit ({outcome.get('timeout_s', budget):.0f} s)"
            rec["note"] = f"{note}; {stopped}" if note else stopped
    return rec


def missing_modules(names: Sequence[str]) -> list[str]:
    importlib.invalidate_caches()
    out = []
    for name in names:
        try:
            if importlib.util.find_spec(name) is None:
                out.append(name)
        except (ImportError, ValueError):
            out.append(name)
    return out


def run_all(stages: Sequence[Stage], budgets: dict[str, float], out: Path, args: argparse.Namespace,
            deadline_s: float, runner: Callable[..., dict] = run_stage,
            find_missing: Callable[[Sequence[str]], list[str]] = missing_modules,
            environment: dict | None = None, started: float | None = None) -> dict:
    """Run every stage in turn, rewriting the report before and after each. A stage may run for its
    budget plus the time earlier stages left unused (at most its budget again); the last one, for
    whatever is left before the deadline (counted from ``started``, a ``time.monotonic()``; default now)."""
    t0 = time.monotonic() if started is None else started
    report = new_report(stages, budgets, deadline_s, environment or {})
    write_report(out, report)
    env = stage_env()
    planned = 0.0  # the sum of the budgets of the stages before this one
    for i, stage in enumerate(stages):
        elapsed = time.monotonic() - t0
        left = deadline_s - elapsed - GRACE_S
        ahead = max(0.0, planned - elapsed)
        budget = budgets[stage.name]
        planned += budget
        last = i == len(stages) - 1
        timeout = left if last else min(budget + min(ahead, budget), left)
        missing = find_missing(stage.needs)
        if missing:
            rec = stage_record(stage, budgets[stage.name], None, missing)
        elif left < 5:
            rec = stage_record(stage, budgets[stage.name], None, note="not run: no time left before the deadline")
            rec["status"] = "not-run"
        else:
            report["stages"][i]["status"] = "running"
            write_report(out, report)
            print(f"[gpu_acceptance] {stage.name}: up to {timeout:.0f} s ...", flush=True)
            result = result_path(out, stage.name)
            result.unlink(missing_ok=True)  # a result left by an earlier run in this folder is not this one's
            outcome = runner(command(stage, out, args), timeout, out / "logs" / f"{stage.name}.log", env=env)
            outcome["timeout_s"] = timeout
            rec = stage_record(stage, budgets[stage.name], outcome)
            if rec["status"] == "ok" and rec["rc"] != 0 and not result.exists():  # exit 1 of a crash
                rec.update(status="failed", note=f"exit {rec['rc']} and no result file")
        report["stages"][i] = rec
        print(f"[gpu_acceptance] {stage.name}: {rec['status']}"
              + (f" in {rec['seconds']} s" if rec["seconds"] is not None else "")
              + (f" ({rec['note']})" if rec["note"] else ""), flush=True)
        try:  # a result this script cannot read must not cost the stages after it
            if stage.name == "env":
                report["environment"].update(load_json(result_path(out, "env")) or {})
            refresh(report, out)
        except Exception as exc:  # noqa: BLE001 - recorded in the report
            report.setdefault("errors", []).append(f"reading the results after {stage.name}: "
                                                   f"{type(exc).__name__}: {exc}")
        report["wall_s"] = round(time.monotonic() - t0, 1)
        write_report(out, report)
    report["finished"] = True
    report["wall_s"] = round(time.monotonic() - t0, 1)
    write_report(out, report)
    return report


# ------------------------------------------------------------------------------------------ report
def new_report(stages: Sequence[Stage], budgets: dict[str, float], deadline_s: float, environment: dict) -> dict:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return {"script": "benchmarks/gpu_acceptance.py", "command": " ".join(sys.argv), "started": now,
            "updated": now, "finished": False, "wall_s": 0.0, "deadline_s": deadline_s, "git": git_info(),
            "environment": dict(environment),
            "stages": [stage_record(s, budgets[s.name], None) for s in stages],
            "goals": [], "summary": {}, "measurements": {}}


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def refresh(report: dict, out: Path) -> None:
    """Re-read every finished stage's JSON and rebuild the measurements, goals and summary."""
    payloads = {s["name"]: load_json(result_path(out, s["name"])) for s in report["stages"]
                if s["status"] not in ("pending", "running")}
    try:
        report["measurements"] = measurements(payloads)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # the goals below still get read
        report["measurements"] = {}
        report.setdefault("errors", []).append(f"measurements tables: {type(exc).__name__}: {exc}")
    report["goals"] = goals(report["stages"], payloads)
    report["summary"] = summary(report)


def measurements(payloads: dict[str, dict | None]) -> dict:
    out: dict = {}
    host = payloads.get("host") or {}
    if host.get("host"):
        out["host"] = host["host"]
    rows = [dict(r, stage=name) for name in MODEL_RUNS for r in (payloads.get(name) or {}).get("results", [])]
    if rows:
        out["model"] = [{k: r.get(k) for k in ("stage", "model", "phase", "original_ms", "converted_ms", "ratio",
                                                "target")} for r in rows]
    if payloads.get("tests"):
        out["tests"] = payloads["tests"]
    recipes = {k: payloads[k] for k in ("fsdp", "ddp") if payloads.get(k)}
    if recipes:
        out["recipes"] = recipes
    return out


def _goal(goal: str, where: str, value: float | None, limit: float | None, ok: bool, bound: str = "<=",
          source: str = "", note: str = "") -> dict:
    if value is not None and not math.isfinite(value):
        ok = False
    return {"goal": goal, "where": where, "value": value, "limit": limit, "bound": bound, "ok": bool(ok),
            "source": source, "note": note}


def _why(stage: dict | None) -> str:
    if stage is None:
        return "not measured"
    if stage["status"] == "ok":
        return "not measured: the stage wrote no result for it"
    return f"not measured: stage {stage['name']} {stage['status']}" + (f" ({stage['note']})" if stage["note"] else "")


def _target_goals(name: str, stage: dict, data: dict | None) -> list[dict]:
    """gpu_targets' own checks (host, eager, graph), and a failed row for what it did not measure."""
    goal = "module host cost <= nn.LayerNorm" if name == "host" else f"gpu_targets {name[8:]} row passes"
    if not data or "checks" not in data:
        return [_goal(goal, "-", None, None, False, source=name, note=_why(stage))]
    rows = [_goal(goal, c["where"] if name == "host" else f"{c['target']}: {c['where']}", c["value"], c["limit"],
                  c["ok"], c.get("bound", "<="), name) for c in data["checks"]]
    rows += [_goal(goal, target, None, None, False, source=name, note="not measured")
             for target in data.get("missing", [])]
    if data.get("partial") or stage["status"] != "ok":  # cut short: the shapes after these
        rows.append(_goal(goal, "the shapes after those above", None, None, False, source=name, note=_why(stage)))
    return rows


def _model_goals(name: str, stage: dict, data: dict | None) -> list[dict]:
    """One row per (model, phase with a target) the stage runs; a missing row fails."""
    results = {(r["model"], r["phase"]): r for r in (data or {}).get("results", [])}
    models, phases = MODEL_RUNS[name]
    rows = []
    for model in models:
        for phase in (p for p in phases if p in PHASE_GOALS):
            goal, limit = PHASE_GOALS[phase]
            r = results.get((model, phase))
            if r is None:
                rows.append(_goal(goal, model, None, limit, False, source=name, note=_why(stage)))
            else:
                rows.append(_goal(goal, model, r["ratio"], limit, r["ratio"] <= limit, source=name))
    return rows


def _recipe_goals(name: str, stage: dict, data: dict | None) -> list[dict]:
    goal = RECIPE_GOALS[name]
    if not data:
        return [_goal(goal, "-", None, None, False, source=name, note=_why(stage))]
    ok = stage["status"] == "ok" and data.get("returncode") == 0 and bool(data.get("loaded")) and not data.get("error")
    where = f"{data.get('processes')} process(es), {data.get('steps_done')} steps"
    return [_goal(goal, where, None, None, ok, source=name,
                  note=data.get("error") or ("" if ok else _why(stage)) or data.get("note", ""))]


def _test_goals(name: str, stage: dict, data: dict | None) -> list[dict]:
    goal = "README test command green with a GPU present"
    if not data:
        return [_goal(goal, "-", None, None, False, source=name, note=_why(stage))]
    bad = data["failed"] + data["errors"]
    ok = stage["status"] == "ok" and bad == 0 and data["total"] > 0 and not data.get("interrupted")
    where = (f"{data['passed']} passed, {data['failed']} failed, {data['errors']} errors, {data['skipped']} skipped"
             + (" (interrupted)" if data.get("interrupted") else ""))
    return [_goal(goal, where, float(bad), 0.0, ok, source=name, note="" if ok or bad else _why(stage))]


GOAL_READERS: dict[str, Callable[[str, dict, dict | None], list[dict]]] = {
    "host": _target_goals, "targets-eager": _target_goals, "targets-graph": _target_goals,
    **{k: _model_goals for k in MODEL_RUNS}, "fsdp": _recipe_goals, "ddp": _recipe_goals, "tests": _test_goals,
}


def goals(stages: Sequence[dict], payloads: dict[str, dict | None]) -> list[dict]:
    """Pass/fail per target, for the stages that were selected, in stage order; a target that was not
    measured fails, and so does a stage whose result cannot be read (with why)."""
    rows: list[dict] = []
    for stage in stages:
        reader = GOAL_READERS.get(stage["name"])
        if reader is None:
            continue
        try:
            rows += reader(stage["name"], stage, payloads.get(stage["name"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            rows.append(_goal(f"results of stage {stage['name']}", "-", None, None, False, source=stage["name"],
                              note=f"unreadable result: {type(exc).__name__}: {exc}"))
    return rows


def summary(report: dict) -> dict:
    g = report["goals"]
    counts: dict[str, int] = {}
    for s in report["stages"]:
        counts[s["status"]] = counts.get(s["status"], 0) + 1
    return {"goals_passed": sum(x["ok"] for x in g), "goals_total": len(g),
            "all_passed": bool(g) and all(x["ok"] for x in g) and counts.get("ok", 0) == len(report["stages"]),
            "stages": counts}


def git_info() -> dict | None:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def _fmt(v: object, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(report: dict) -> str:
    env, s = report["environment"], report["summary"]
    running = [x["name"] for x in report["stages"] if x["status"] == "running"]
    state = "complete" if report["finished"] else (
        f"PARTIAL: stopped during stage {running[0]}" if running else "PARTIAL: in progress or killed")
    git = report.get("git") or {}
    lines = [
        "# GPU acceptance report", "",
        f"- status: {state}; wall {report['wall_s']:.0f} s of the {report['deadline_s']:.0f} s deadline",
        f"- started: {report['started']}; updated {report['updated']}",
        f"- device: {env.get('gpu') or '?'}, {_fmt(env.get('gpu_memory_gib'), 1)} GiB, driver "
        f"{env.get('driver') or '?'}, CUDA {env.get('cuda') or '?'}, compute capability {env.get('capability') or '?'}",
        "- versions: " + ", ".join(f"{k} {env.get(k) or 'not installed'}" for k in
                                   ("python", "torch", "triton", "transformers", "accelerate")),
        f"- normswap commit: {git.get('commit', 'unknown')}"
        + (" (with uncommitted changes)" if git.get("dirty") else ""),
        f"- command: `{report['command']}`",
        f"- goals: {s.get('goals_passed', 0)}/{s.get('goals_total', 0)} pass"
        + ("; ALL PASS" if s.get("all_passed") else ""),
    ]
    if env.get("missing_packages"):
        lines.append(f"- packages missing on this machine: {', '.join(env['missing_packages'])}")
    for error in report.get("errors", []):
        lines.append(f"- error of this script: {error}")
    lines += ["", "## Goals", "", "| goal | where | value | target | verdict |", "|---|---|---|---|---|"]
    for g in report["goals"]:
        target = "-" if g["limit"] is None else f"{g['bound']} {g['limit']:.2f}"
        verdict = ("pass" if g["ok"] else "**FAIL**") + (f" ({g['note']})" if g["note"] else "")
        lines.append(f"| {_cell(g['goal'])} | {_cell(g['where'])} | {_fmt(g['value'])} | {target} | {_cell(verdict)} |")
    lines += ["", "## Stages", "", "| stage | status | seconds | budget s | note |", "|---|---|---|---|---|"]
    for st in report["stages"]:
        lines.append(f"| {st['name']} | {st['status']} | {_fmt(st['seconds'], 1)} | {st['budget_s']:.0f} | "
                     f"{_cell(st['note'] or st['what'])} |")
    m = report["measurements"]
    if m.get("model"):
        lines += ["", "## Model benchmarks (converted / original)", "",
                  "| stage | model | phase | original ms | converted ms | ratio | target |",
                  "|---|---|---|---|---|---|---|"]
        for r in m["model"]:
            lines.append(f"| {r['stage']} | {r['model']} | {r['phase']} | {_fmt(r['original_ms'], 2)} | "
                         f"{_fmt(r['converted_ms'], 2)} | {_fmt(r['ratio'])} | {_fmt(r['target'], 2)} |")
    if m.get("host"):
        lines += ["", "## Host cost per module call (4x1024)", "",
                  "| dtype | bias | pass | nn.LayerNorm us | RMSNorm us | ratio |", "|---|---|---|---|---|---|"]
        for r in m["host"]:
            lines.append(f"| {r['dtype']} | {r['bias']} | {r['pass']} | {_fmt(r['layer_norm_us'], 2)} | "
                         f"{_fmt(r['rms_norm_us'], 2)} | {_fmt(r['ratio'])} |")
    if m.get("tests"):
        t = m["tests"]
        lines += ["", "## Test suite", "", f"`{t.get('command', 'python -m pytest -q')}` in {t.get('shards', 1)} "
                  f"concurrent shard(s) split by file ({t.get('threads_per_shard', 'default')} thread(s) each): "
                  f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
                  + (" (interrupted: counts are partial)" if t.get("interrupted") else "")]
        if t.get("failing"):
            lines += ["", "Failing:", ""] + [f"- `{f}`" for f in t["failing"]]
    if m.get("recipes"):
        lines += ["", "## Recipes", "", "| run | config | processes | steps | loads | RMSNorm | LayerNorm | sharded |",
                  "|---|---|---|---|---|---|---|---|"]
        for k, r in m["recipes"].items():
            lines.append(f"| {k} | {r.get('config')} | {r.get('processes')} | {r.get('steps_done')} | "
                         f"{r.get('loaded')} | {r.get('rmsnorm_modules')} | {r.get('layernorm_modules')} | "
                         f"{r.get('sharded')} |")
    bad = [st for st in report["stages"] if st["status"] in ("failed", "timeout") and st["tail"]]
    if bad:
        lines += ["", "## Output of stages that did not pass"]
        for st in bad:
            lines += ["", f"### {st['name']}: {st['status']} (exit code {st['rc']}; full log {st['log']})", "",
                      "```", st["tail"].replace("```", "'''"), "```"]
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict) -> None:
    """report.json and report.md, each replaced atomically (a killed run leaves the previous version)."""
    out.mkdir(parents=True, exist_ok=True)
    report["updated"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    try:
        markdown = render_markdown(report)
    except Exception as exc:  # noqa: BLE001 - the JSON still gets written, and says why
        markdown = f"# GPU acceptance report\n\nrendering failed ({type(exc).__name__}: {exc}): see report.json\n"
    for name, text in (("report.json", json.dumps(report, indent=2, default=str)), ("report.md", markdown)):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)


# -------------------------------------------------------------------------------------------- main
def plan_text(stages: Sequence[Stage], budgets: dict[str, float], out: Path, args: argparse.Namespace) -> str:
    lines = [f"gpu_acceptance plan: {len(stages)} stage(s), budgets {sum(budgets.values()):.0f} s of the "
             f"{args.deadline:.0f} s deadline (the last stage may use what is left); reports in {out}"]
    for s in stages:
        needs = f"; needs {', '.join(s.needs)}" if s.needs else ""
        lines.append(f"  {s.name:15} {budgets[s.name]:5.0f} s  {s.what}{needs}")
        shown = " ".join(command(s, out, args)).replace(sys.executable, "python").replace(f"{REPO}/", "")
        lines.append(f"  {'':15}          $ {shown}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out).resolve()
    try:
        stages, budgets = select(args)
    except UsageError as exc:
        print(f"gpu_acceptance: {exc}", file=sys.stderr)
        return 2
    if args.plan:
        print(plan_text(stages, budgets, out, args))
        return 0
    try:
        import torch
    except ImportError:
        print("gpu_acceptance: torch is not importable here; this script runs on a GPU machine with torch and "
              "CUDA installed (see its docstring)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_acceptance: no CUDA device; this script runs on a GPU machine (see the docstring of "
              "benchmarks/gpu_acceptance.py; --plan lists what it would run)", file=sys.stderr)
        return 2
    environment = {"torch": torch.__version__, "cuda": torch.version.cuda}  # the env stage adds the rest
    print(plan_text(stages, budgets, out, args), flush=True)
    report = run_all(stages, budgets, out, args, args.deadline, environment=environment, started=STARTED)
    s = report["summary"]
    print(f"[gpu_acceptance] goals {s['goals_passed']}/{s['goals_total']} pass; stages {s['stages']}; "
          f"wall {report['wall_s']:.0f} s; wrote {out / 'report.md'} and {out / 'report.json'}")
    failed = [g for g in report["goals"] if not g["ok"]]
    for g in failed[:40]:
        print(f"[gpu_acceptance] FAIL {g['goal']} | {g['where']} | {_fmt(g['value'])}"
              + (f" | {g['note']}" if g["note"] else ""))
    if len(failed) > 40:
        print(f"[gpu_acceptance] ... and {len(failed) - 40} more failed goals: see report.md")
    return 0 if s["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
