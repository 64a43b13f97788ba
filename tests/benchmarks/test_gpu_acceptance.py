"""``benchmarks/gpu_acceptance.py``'s CPU-side plumbing: the command line, the stage runner's time
budgets, and the report (goals table, stages, partial reports), on fake stage results.

The script's measurements need a CUDA device; what is tested here is everything around them, so that
the one run a lent GPU session gets is not lost to a plumbing bug.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_acceptance.py"
_spec = importlib.util.spec_from_file_location("gpu_acceptance", _PATH)
ga = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_acceptance", ga)  # dataclasses look their module up there
_spec.loader.exec_module(ga)
_wspec = importlib.util.spec_from_file_location("gpu_acceptance_workers", _PATH.with_name("gpu_acceptance_workers.py"))
gw = importlib.util.module_from_spec(_wspec)
_wspec.loader.exec_module(gw)  # imports gpu_acceptance: the module above, from sys.modules


# ------------------------------------------------------------------------------------ command line
def test_without_cuda_it_exits_2_with_one_line(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device, on a GPU machine too
    proc = subprocess.run([sys.executable, str(_PATH), "--out", str(tmp_path / "gpu")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_acceptance: no CUDA device"), proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "gpu").exists()  # nothing started, nothing half-written


def test_default_budgets_fit_in_eight_minutes_and_plan_lists_every_stage(capsys, tmp_path):
    stages, budgets = ga.select(ga.parse_args(["--out", str(tmp_path)]))
    assert [s.name for s in stages] == [s.name for s in ga.STAGES]
    assert sum(budgets.values()) <= 8 * 60 == ga.DEADLINE_S
    assert all(b > 0 for b in budgets.values())
    assert ga.main(["--plan", "--out", str(tmp_path)]) == 0
    plan = capsys.readouterr().out
    for s in ga.STAGES:
        assert f"  {s.name} " in plan
    assert "gpu_targets.py --parts graph" in plan and "bench_model.py --device cuda" in plan
    assert not any(tmp_path.iterdir())  # --plan runs nothing


def test_stage_selection_keeps_the_script_order_and_takes_budget_overrides():
    args = ga.parse_args(["--stages", "tests,host", "--budget", "tests=300", "--budget", "model=5"])
    stages, budgets = ga.select(args)
    assert [s.name for s in stages] == ["env", "host", "tests"]  # env always: the report names its device
    assert budgets == {"env": 15.0, "host": 30.0, "tests": 300.0}  # one for an unselected stage is ignored


@pytest.mark.parametrize(("argv", "message"), [
    (["--stages", "host,gpu-magic"], "unknown stage(s) gpu-magic"),
    (["--stages", ","], "unknown stage(s) (none given)"),
    (["--budget", "hots=10"], "unknown stage 'hots'"),
    (["--budget", "host=ten"], "SECONDS > 0"),
    (["--budget", "host=0"], "SECONDS > 0"),
    (["--budget", "tests=500"], "more than the 480 s deadline"),
    (["--stages", "tests", "--test-shards", "0"], "--test-shards"),
])
def test_bad_arguments_are_one_line_errors(capsys, tmp_path, argv, message):
    assert ga.main([*argv, "--out", str(tmp_path / "gpu")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu_acceptance: ") and message in err[0], err
    assert not (tmp_path / "gpu").exists()


def test_stage_commands_reuse_the_benchmark_scripts(tmp_path):
    args = ga.parse_args(["--out", str(tmp_path), "--wheelhouse", "wh", "--test-shards", "3"])
    cmds = {s.name: ga.command(s, tmp_path, args) for s in ga.STAGES}
    assert cmds["host"][1].endswith("gpu_targets.py") and cmds["host"][2:4] == ["--parts", "host"]
    assert cmds["targets-eager"][2:4] == ["--parts", "eager"] and cmds["targets-graph"][2:4] == ["--parts", "graph"]
    model = cmds["model"]
    assert model[1].endswith("bench_model.py") and model[model.index("--phases") + 1] == "decode,prefill,train"
    assert cmds["compile-decode"][cmds["compile-decode"].index("--phases") + 1] == "decode-compile"
    assert "--wheelhouse" in cmds["install"] and cmds["tests"][-2:] == ["--test-shards", "3"]
    for name in gw.WORKERS:  # the worker stages run gpu_acceptance_workers.py, which knows each of them
        assert cmds[name][1] == str(ga.WORKERS) and cmds[name][2] == name and ga.WORKERS.exists()
    spec = importlib.util.spec_from_file_location("bench_model_for_ga", _PATH.parent / "bench_model.py")
    bench_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_model)
    for models, phases in ga.MODEL_RUNS.values():  # every phase and model the stages ask for exists
        assert set(phases) <= set(bench_model.TARGETS) and set(models) <= set(bench_model.MODELS)
    for phase, (_, limit) in ga.PHASE_GOALS.items():  # the goals are the benchmark's own targets
        assert bench_model.TARGETS[phase] == limit


# ----------------------------------------------------------------------------------- stage runner
SLEEPER = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]


def test_runner_stops_a_stage_at_its_budget_and_keeps_its_output(tmp_path):
    log = tmp_path / "logs" / "s.log"
    out = ga.run_stage(SLEEPER, 2.0, log, grace_s=3.0)
    assert out["timed_out"] and out["seconds"] < 10  # SIGINT ended it well before the sleep
    assert "started" in out["tail"] and "stopped after 2 s" in out["tail"]
    assert out["rc"] != 0
    ok = ga.run_stage([sys.executable, "-c", "print('fine')"], 30.0, tmp_path / "ok.log")
    assert ok == {"rc": 0, "seconds": ok["seconds"], "timed_out": False, "tail": ok["tail"]} and "fine" in ok["tail"]
    ignoring = [sys.executable, "-c",
                "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('deaf', flush=True); "
                "time.sleep(60)"]
    hard = ga.run_stage(ignoring, 1.0, tmp_path / "hard.log", grace_s=1.0)  # SIGKILL after the grace
    assert hard["timed_out"] and hard["seconds"] < 10 and "deaf" in hard["tail"]


def test_partial_report_is_written_before_and_after_each_stage(tmp_path):
    """Real subprocesses (a sleeper) under the real runner: the first stage times out, the report on
    disk says which stage was running while it ran, and the next stage still runs."""
    out = tmp_path / "gpu"
    seen = []

    def runner(cmd, timeout, log, env=None):
        report = json.loads((out / "report.json").read_text())
        seen.append(([s["status"] for s in report["stages"]], (out / "report.md").read_text()))
        if log.stem == "env":
            return ga.run_stage(SLEEPER, timeout, log, env=env, grace_s=2.0)
        return ga.run_stage([sys.executable, "-c", "print('ran')"], timeout, log, env=env)

    stages = [ga.BY_NAME["env"], ga.BY_NAME["host"]]
    report = ga.run_all(stages, {"env": 1.5, "host": 20.0}, out, ga.parse_args([]), 60.0, runner=runner,
                        find_missing=lambda names: [])
    assert seen[0][0] == ["running", "pending"] and "PARTIAL: stopped during stage env" in seen[0][1]
    assert seen[1][0] == ["timeout", "running"]
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(report, default=str))
    env, host = on_disk["stages"]
    assert env["status"] == "timeout" and "started" in env["tail"] and "stopped at its time limit (2 s)" in env["note"]
    assert host["status"] == "ok" and host["rc"] == 0 and "ran" in host["tail"]
    assert on_disk["finished"] and (out / "logs" / "env.log").exists()
    goal = [g for g in on_disk["goals"] if g["source"] == "host"]
    assert goal and not goal[0]["ok"] and "wrote no result" in goal[0]["note"]  # ran, measured nothing
    md = (out / "report.md").read_text()
    assert "status: complete" in md and "### env: timeout" in md


def test_the_last_stage_gets_the_time_left_and_a_late_stage_is_not_run(tmp_path):
    calls = {}

    def runner(cmd, timeout, log, env=None):
        calls[log.stem] = timeout
        return {"rc": 0, "seconds": 0.0, "timed_out": False, "tail": ""}

    stages = [ga.BY_NAME["env"], ga.BY_NAME["host"], ga.BY_NAME["model"], ga.BY_NAME["tests"]]
    ga.run_all(stages, {"env": 10.0, "host": 10.0, "model": 5.0, "tests": 20.0}, tmp_path, ga.parse_args([]),
               200.0, runner=runner, find_missing=lambda names: [])
    assert calls["env"] == 10.0 and calls["tests"] > 150  # the last one: what is left, not its budget
    assert 19 < calls["host"] <= 20  # env left its 10 s unused: host may use them
    assert 9.5 < calls["model"] <= 10  # 20 s ahead of plan, but at most twice its own budget
    calls.clear()
    stages = [ga.BY_NAME["env"], ga.BY_NAME["tests"]]
    report = ga.run_all(stages, {"env": 10.0, "tests": 20.0}, tmp_path, ga.parse_args([]), 12.0, runner=runner,
                        find_missing=lambda names: ["pytest"] if "pytest" in names else [])
    assert calls == {}  # 12 s deadline - 10 s grace: under 5 s left for env; tests lacks a package
    statuses = {s["name"]: s["status"] for s in report["stages"]}
    assert statuses == {"env": "not-run", "tests": "skipped"}
    assert "pytest" in report["stages"][1]["note"] and "no time left" in report["stages"][0]["note"]


# ----------------------------------------------------------------------------------------- report
def _write_result(out: Path, name: str, data: dict) -> None:
    path = ga.result_path(out, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _fake_payloads() -> dict[str, dict]:
    """What each stage would write (bench_model rows, gpu_targets checks, worker JSON)."""
    payloads = {}

    def write(name, data):
        payloads[name] = data

    host = [{"dtype": d, "bias": b, "pass": p, "layer_norm_us": 10.0, "rms_norm_us": 10.0 * r, "ratio": r}
            for d, b, p, r in [("float32", False, "fwd", 0.8), ("bfloat16", True, "fwd+bwd", 1.3)]]
    write("host", {"host": host, "missing": [], "checks": [
        {"target": "host: RMSNorm / LayerNorm module call", "where": f"{r['pass']} {r['dtype']} "
         f"{'bias' if r['bias'] else 'no bias'}", "value": r["ratio"], "limit": 1.0, "ok": r["ratio"] <= 1.0,
         "bound": "<="} for r in host]})
    write("targets-eager", {"partial": True, "missing": [], "checks": [  # written before its timeout
        {"target": "eager: auto / min(native, triton)", "where": "fwd bfloat16 1x4096", "value": 1.01,
         "limit": 1.05, "ok": True, "bound": "<="}]})
    write("targets-graph", {"checks": [
        {"target": "graph: forward+backward TB/s", "where": "fwd+bwd bfloat16 32768x4096", "value": 2.7,
         "limit": 2.6, "ok": True, "bound": ">="}], "missing": ["graph: auto / liger"]})
    write("model", {"results": [
        {"model": "gpt2-small", "phase": "decode", "ratio": 0.98, "original_ms": 100.0, "converted_ms": 98.0,
         "target": 1.0},
        {"model": "gpt2-small", "phase": "prefill", "ratio": 1.2, "original_ms": 5.0, "converted_ms": 6.0,
         "target": None},
        {"model": "gpt2-small", "phase": "train", "ratio": 0.995, "original_ms": 50.0, "converted_ms": 49.75,
         "target": 0.99},
        {"model": "pythia-410m", "phase": "decode", "ratio": float("nan"), "original_ms": 1.0,
         "converted_ms": 1.0, "target": 1.0}]})
    write("fsdp", {"config": "fsdp.yaml", "processes": 1, "returncode": 1, "loaded": False, "steps_done": 3,
                   "error": "accelerate launch exited 1"})
    write("ddp", {"config": "ddp.yaml", "processes": 1, "returncode": 0, "loaded": True, "steps_done": 6,
                  "rmsnorm_modules": 5, "layernorm_modules": 0, "sharded": False, "note": "one GPU, so 1 process"})
    write("tests", {"total": 10, "passed": 7, "failed": 2, "errors": 0, "skipped": 1, "interrupted": False,
                    "failing": ["tests/a/test_x.py::test_one", "tests/test_y.py::test_two[p]"], "shards": 2,
                    "command": "python -m pytest -q"})
    return payloads


def _outcomes() -> dict:
    ok = {"rc": 0, "seconds": 3.0, "timed_out": False, "tail": "fine"}
    return {
        "host": {**ok, "rc": 1, "tail": "1/2 checks passed"},  # gpu_targets: exit 1 = a target missed
        "targets-eager": {"rc": -9, "seconds": 40.0, "timed_out": True, "tail": "eager 512x4096 ...\nstopped"},
        "targets-graph": {**ok, "rc": 1},
        "model": ok,
        "compile-decode": {"rc": 1, "seconds": 9.0, "timed_out": False,
                           "tail": "Traceback ...\nBackendCompilerFailed: inductor raised ```boom```"},
        "fsdp": {"rc": 1, "seconds": 30.0, "timed_out": False, "tail": "NCCL error"},
        "ddp": ok,
        "tests": {**ok, "rc": 1},
    }


def test_report_from_fake_stage_results(tmp_path):
    out = tmp_path / "gpu"
    _write_result(out, "compile-decode", {"results": [{"model": "gpt2-small", "phase": "decode-compile",
                                                       "ratio": 0.5}]})  # an earlier run's: must not count
    payloads = _fake_payloads()
    outcomes = _outcomes()
    names = ["env", "host", "targets-eager", "targets-graph", "model", "compile-decode", "compile-train", "fsdp",
             "ddp", "tests"]
    stages = [ga.BY_NAME[n] for n in names]
    stages[6] = dataclasses.replace(stages[6], needs=("torch", "no_such_package_here"))  # compile-train

    def runner(cmd, timeout, log, env=None):
        if log.stem in payloads:
            _write_result(out, log.stem, payloads[log.stem])
        return dict(outcomes.get(log.stem, {"rc": 0, "seconds": 1.0, "timed_out": False, "tail": ""}))

    env = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "cuda": "12.8"}
    report = ga.run_all(stages, {s.name: float(s.budget_s) for s in stages}, out, ga.parse_args([]), 480.0,
                        runner=runner, find_missing=lambda need: [n for n in need if n.startswith("no_such")],
                        environment=env)
    status = {s["name"]: s["status"] for s in report["stages"]}
    assert status == {"env": "ok", "host": "ok", "targets-eager": "timeout", "targets-graph": "ok", "model": "ok",
                      "compile-decode": "failed", "compile-train": "skipped", "fsdp": "failed", "ddp": "ok",
                      "tests": "ok"}

    verdict = {(g["goal"], g["where"]): g for g in report["goals"]}
    host = "module host cost <= nn.LayerNorm"
    assert verdict[(host, "fwd float32 no bias")]["ok"]
    assert not verdict[(host, "fwd+bwd bfloat16 bias")]["ok"]
    assert verdict[("gpu_targets eager row passes", "eager: auto / min(native, triton): fwd bfloat16 1x4096")]["ok"]
    eager = verdict[("gpu_targets eager row passes", "the shapes after those above")]
    assert not eager["ok"] and "targets-eager timeout" in eager["note"]
    assert verdict[("gpu_targets graph row passes", "graph: forward+backward TB/s: fwd+bwd bfloat16 32768x4096")]["ok"]
    assert not verdict[("gpu_targets graph row passes", "graph: auto / liger")]["ok"]  # unmeasured target fails
    decode = "decode at batch 1, eager: converted / original"
    assert verdict[(decode, "gpt2-small")]["ok"]
    assert not verdict[(decode, "pythia-410m")]["ok"]  # NaN never passes
    train = verdict[("eager train step: converted / original", "gpt2-small")]
    assert not train["ok"] and train["limit"] == 0.99
    missing = verdict[("eager train step: converted / original", "pythia-410m")]
    assert not missing["ok"] and "wrote no result" in missing["note"]
    assert not any(g["where"] == "gpt2-small" and "prefill" in g["goal"] for g in report["goals"])  # no target
    compiled = verdict[("decode at batch 1, compiled: converted / original", "gpt2-small")]
    assert not compiled["ok"] and "compile-decode failed" in compiled["note"]
    skipped = verdict[("compiled train step: converted / original", "gpt2-small")]
    assert not skipped["ok"] and "missing package(s): no_such_package_here" in skipped["note"]
    assert not verdict[(ga.RECIPE_GOALS["fsdp"], "1 process(es), 3 steps")]["ok"]
    assert verdict[(ga.RECIPE_GOALS["ddp"], "1 process(es), 6 steps")]["ok"]
    tests = [g for g in report["goals"] if g["source"] == "tests"]
    assert len(tests) == 1 and not tests[0]["ok"] and tests[0]["value"] == 2.0
    s = report["summary"]
    assert s["goals_passed"] == sum(g["ok"] for g in report["goals"]) == 5 and not s["all_passed"]
    assert s["goals_total"] == len(report["goals"])

    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["environment"]["gpu"] == "NVIDIA H100 80GB HBM3" and on_disk["finished"]
    assert [x["name"] for x in on_disk["stages"]] == names
    assert on_disk["stages"][2]["tail"].endswith("stopped")
    md = (out / "report.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in md and f"goals: 5/{s['goals_total']} pass" in md
    assert "| module host cost <= nn.LayerNorm | fwd+bwd bfloat16 bias | 1.300 | <= 1.00 | **FAIL** |" in md
    assert "| module host cost <= nn.LayerNorm | fwd float32 no bias | 0.800 | <= 1.00 | pass |" in md
    assert "- `tests/test_y.py::test_two[p]`" in md
    assert f"| {ga.RECIPE_GOALS['ddp']} | 1 process(es), 6 steps | - | - | pass (one GPU, so 1 process) |" in md
    assert "| model | gpt2-small | prefill | 5.00 | 6.00 | 1.200 | - |" in md
    assert "### compile-decode: failed (exit code 1" in md and "'''boom'''" in md  # fences stay intact
    assert "### targets-eager: timeout" in md and "### fsdp: failed" in md
    assert "### ddp" not in md and "### compile-train" not in md  # ok / skipped: no tail shown
    assert md.count("```") % 2 == 0


def test_all_goals_pass_only_when_every_stage_ran_and_every_target_was_met(tmp_path):
    out = tmp_path / "gpu"

    def runner(cmd, timeout, log, env=None):
        if log.stem == "ddp":
            _write_result(out, "ddp", {"processes": 1, "returncode": 0, "loaded": True, "steps_done": 6})
        return {"rc": 0, "seconds": 1.0, "timed_out": False, "tail": ""}

    stages = [ga.BY_NAME["env"], ga.BY_NAME["ddp"]]
    report = ga.run_all(stages, {"env": 5.0, "ddp": 5.0}, out, ga.parse_args([]), 100.0, runner=runner,
                        find_missing=lambda need: [])
    assert report["summary"]["all_passed"] and "ALL PASS" in (out / "report.md").read_text()


# ------------------------------------------------------------------------------------ test stage
def test_junit_counts_and_node_ids(tmp_path):
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    (tmp_path / "tests" / "sub" / "test_m.py").write_text("")
    xml = tmp_path / "j.xml"
    xml.write_text(textwrap.dedent("""\
        <testsuites><testsuite>
          <testcase classname="tests.sub.test_m" name="test_ok" />
          <testcase classname="tests.sub.test_m.TestK" name="test_bad[a-1]"><failure message="x"/></testcase>
          <testcase classname="tests.sub.test_m" name="test_err"><error message="y"/></testcase>
          <testcase classname="tests.sub.test_m" name="test_skip"><skipped message="z"/></testcase>
          <testcase time="0.000" />
        </testsuite></testsuites>"""))
    tot = gw.junit_totals([xml, tmp_path / "absent.xml"], tmp_path)
    assert (tot["total"], tot["passed"], tot["failed"], tot["errors"], tot["skipped"]) == (4, 1, 1, 1, 1)
    assert tot["failing"] == ["tests/sub/test_m.py::TestK::test_bad[a-1]", "tests/sub/test_m.py::test_err"]
    assert tot["unreadable"] == ["absent.xml"]


def test_shards_cover_every_file_once_and_balance_sizes(tmp_path):
    files = []
    for i, size in enumerate([900, 500, 400, 300, 100, 100, 50]):
        f = tmp_path / f"test_{i}.py"
        f.write_text("#" * size)
        files.append(f)
    groups = gw.shard_files(files, 3)
    assert sorted(f for g in groups for f in g) == sorted(files)
    loads = sorted(sum(f.stat().st_size for f in g) for g in groups)
    assert loads[-1] == 900 and loads[0] >= 550
    assert gw.shard_files(files[:2], 8) == [[files[0]], [files[1]]]  # never an empty shard


def test_tests_worker_runs_shards_and_reports_failures(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # a faster start; the plugins are not the point
    root = tmp_path / "repo"
    (root / "tests").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "tests" / "test_good.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    (root / "tests" / "test_bad.py").write_text("def test_c():\n    assert 1 == 2\n")
    (root / "tests" / "test_unimportable.py").write_text("import no_such_module_here\n")
    out = tmp_path / "gpu"
    rc = gw.run_tests(out, 2, root)
    data = json.loads(ga.result_path(out, "tests").read_text())
    assert rc == 1 and data["shards"] == 2 and not data["interrupted"]
    # the module that does not import fails alone; the file sharing its shard still runs
    assert (data["passed"], data["failed"], data["errors"], data["total"]) == (2, 1, 1, 4)
    assert data["failing"] == ["tests/test_bad.py::test_c", "tests/test_unimportable.py"]


def test_a_crash_with_an_accepted_exit_code_but_no_result_is_a_failure(tmp_path):
    def runner(cmd, timeout, log, env=None):  # gpu_targets exits 1 on a missed target, and on a traceback
        return {"rc": 1, "seconds": 1.0, "timed_out": False, "tail": "Traceback ...\nRuntimeError: CUDA error"}

    report = ga.run_all([ga.BY_NAME["host"]], {"host": 5.0}, tmp_path, ga.parse_args([]), 100.0, runner=runner,
                        find_missing=lambda need: [])
    (st,) = report["stages"]
    assert st["status"] == "failed" and "no result file" in st["note"]
    assert "RuntimeError: CUDA error" in (tmp_path / "report.md").read_text()


def test_a_result_of_an_unexpected_shape_is_reported_and_the_next_stages_still_run(tmp_path):
    def runner(cmd, timeout, log, env=None):
        if log.stem == "model":  # rows without the fields the goals read
            _write_result(tmp_path, "model", {"results": [{"phase": "decode"}]})
        return {"rc": 0, "seconds": 1.0, "timed_out": False, "tail": ""}

    stages = [ga.BY_NAME["env"], ga.BY_NAME["model"], ga.BY_NAME["ddp"]]
    report = ga.run_all(stages, {"env": 5.0, "model": 5.0, "ddp": 5.0}, tmp_path, ga.parse_args([]), 100.0,
                        runner=runner, find_missing=lambda need: [])
    assert [s["status"] for s in report["stages"]] == ["ok", "ok", "ok"]  # ddp ran after the bad result
    assert report["finished"] and not report.get("errors")
    bad = [g for g in report["goals"] if g["source"] == "model"]
    assert len(bad) == 1 and not bad[0]["ok"] and "unreadable result: KeyError" in bad[0]["note"]
    ddp = [g for g in report["goals"] if g["source"] == "ddp"]  # the goals of later stages are still read
    assert len(ddp) == 1 and not ddp[0]["ok"] and "wrote no result" in ddp[0]["note"]
