"""The stages of ``benchmarks/gpu_acceptance.py`` that are not existing benchmark scripts: each runs
as its own subprocess (so that the orchestrator can stop it at its time budget) and writes its result
to ``OUT/stages/STAGE.json``.

    python benchmarks/gpu_acceptance_workers.py install --out DIR [--wheelhouse DIR]
    python benchmarks/gpu_acceptance_workers.py env --out DIR
    python benchmarks/gpu_acceptance_workers.py fsdp --out DIR       # or ddp
    python benchmarks/gpu_acceptance_workers.py tests --out DIR [--test-shards N]

Run them through ``gpu_acceptance.py`` (``--stages``), which gives each its time budget and reads
what they write into its report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_acceptance beside this file
from gpu_acceptance import GRACE_S, REPO, default_shards, default_sigint, result_path, tail  # noqa: E402


def _write(out: Path, name: str, data: dict) -> None:
    path = result_path(out, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))


def _dist_name(wheel: Path) -> str:
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def run_install(out: Path, wheelhouse: str | None) -> int:
    from importlib import metadata

    pip = [sys.executable, "-m", "pip", "install", "--no-input", "--disable-pip-version-check"]
    data: dict = {"wheels_installed": []}
    if wheelhouse:
        installed = {re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() for d in metadata.distributions()}
        wheels = [w for w in sorted(Path(wheelhouse).glob("*.whl")) if _dist_name(w) not in installed]
        if wheels:
            print(f"from {wheelhouse}: {', '.join(w.name for w in wheels)}", flush=True)
            # with their dependencies, from the wheelhouse or those installed (nothing else can be
            # reached); if that fails, each wheel alone
            rc = subprocess.run(pip + ["--no-index", "--find-links", wheelhouse, *map(str, wheels)]).returncode
            if rc != 0:
                rc = subprocess.run(pip + ["--no-index", "--no-deps", *map(str, wheels)]).returncode
            data["wheels_installed"] = [w.name for w in wheels] if rc == 0 else []
            data["wheelhouse_rc"] = rc
        else:
            print(f"{wheelhouse}: nothing to install (every wheel's distribution is installed)")
    rc = subprocess.run(pip + ["--no-index", "--no-deps", "--no-build-isolation", "-e", str(REPO)]).returncode
    data["editable_rc"] = rc
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run([sys.executable, "-c", "import normswap; print(normswap.__file__)"], env=env,
                           capture_output=True, text=True, cwd=tempfile.gettempdir())
    data["imports_from"] = probe.stdout.strip() or None
    data["from_this_tree"] = bool(data["imports_from"]) and Path(data["imports_from"]).resolve().is_relative_to(REPO)
    print(f"pip install -e: exit {rc}; import normswap without PYTHONPATH -> "
          f"{data['imports_from'] or probe.stderr[-300:]}")
    if rc != 0:
        print("(the other stages import the working tree through PYTHONPATH all the same; if pip could not "
              "build, e.g. \"invalid command 'bdist_wheel'\", add the `wheel` wheel to --wheelhouse)")
    _write(out, "install", data)
    return 0 if rc == 0 and data["from_this_tree"] else 1


def run_env(out: Path) -> int:
    import platform
    from importlib import metadata

    import torch

    info: dict = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "cudnn": torch.backends.cudnn.version(), "cpu_count": os.cpu_count()}
    for dist in ("triton", "transformers", "accelerate", "safetensors", "pytest", "hypothesis", "peft",
                 "liger-kernel", "datasets", "matplotlib", "onnx", "onnxruntime", "onnxscript",
                 "sentence-transformers", "x-transformers"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    info["missing_packages"] = [k for k in ("triton", "transformers", "accelerate", "safetensors", "pytest",
                                            "hypothesis", "peft", "liger-kernel", "datasets", "matplotlib", "onnx",
                                            "onnxruntime", "onnxscript", "sentence-transformers", "x-transformers")
                                if info[k] is None]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_count=torch.cuda.device_count(),
                    gpu_memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        first = smi.stdout.strip().splitlines()[0].split(", ") if smi.stdout.strip() else []
        if first:
            info.update(driver=first[0], smi_name=first[1], sm_clock_max=first[2], power_limit=first[3])
    except (OSError, subprocess.SubprocessError, IndexError):
        info["driver"] = None
    print(json.dumps(info, indent=2))
    _write(out, "env", info)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_recipe(out: Path, kind: str) -> int:
    """A few steps of distill-causal-lm on a toy GPT-2 under ``accelerate launch`` with the shipped
    config, then ``normswap.load`` of the saved model (on CPU)."""
    import shutil

    import torch

    import normswap
    from normswap.recipes import toy

    work = Path(tempfile.gettempdir()) / "normswap-gpu-acceptance" / "work"  # models and runs: not for --out
    source = work / "toy-gpt2"
    torch.set_num_threads(1)  # tiny matmuls: more threads only spin-wait on each other
    if not (source / "config.json").exists():  # shared by the two recipe stages
        toy.train_tiny_causal_lm(source, hidden=64, layers=2, steps=20)
    corpus = work / "corpus.txt"
    if not corpus.exists():
        toy.write_corpus(corpus, 400, seed=5)
    run = work / f"run-{kind}"
    shutil.rmtree(run, ignore_errors=True)
    processes = 1 if kind == "fsdp" else max(1, min(2, torch.cuda.device_count()))
    config = REPO / "recipes" / "accelerate" / f"{kind}.yaml"
    steps = 6
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
           "--num_processes", str(processes), "--main_process_port", str(_free_port()),
           "-m", "normswap.recipes", "distill-causal-lm", f"model.source={source}", f"data.path={corpus}",
           f"output.dir={run}", f"train.steps={steps}", "train.warmup_steps=1", "train.lr=3e-4",
           "train.mixed_precision=bf16", "data.seq_len=32", "data.batch_size=8", "data.eval_batch_size=16",
           "eval.every=3", "log.every=1", "log.progress_bar=false", "log.plot=false", "checkpoint.every=3"]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    lines = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:  # echoed as it comes: a stage stopped at its budget shows how far it got
            print(line, end="", flush=True)
            lines.append(line)
    text = "".join(lines)
    data: dict = {"recipe": "distill-causal-lm", "config": config.name, "processes": processes,
                  "returncode": proc.returncode, "launch_s": round(time.monotonic() - t0, 1), "loaded": False,
                  "sharded": "off under FSDP" in text, "steps_done": None}
    records = []
    if (run / "metrics.jsonl").exists():
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("split") == "train"]
    data["steps_done"] = train[-1]["step"] if train else 0
    if kind == "ddp" and processes == 1:
        data["note"] = ("one GPU, so 1 process: NCCL allows one rank per GPU, and accelerate wraps the model in "
                        "DDP only with 2 or more")
    evals = [r for r in records if r.get("split") not in ("train", "replicas")]
    data["last_eval"] = evals[-1] if evals else None
    if proc.returncode == 0:
        try:
            model = normswap.load(run / "model")
            ids = torch.randint(0, 20, (1, 8))
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            data.update(loaded=bool(torch.isfinite(logits).all()),
                        rmsnorm_modules=sum(isinstance(m, normswap.RMSNorm) for m in model.modules()),
                        layernorm_modules=sum(isinstance(m, torch.nn.LayerNorm) for m in model.modules()))
            if not data["loaded"]:
                data["error"] = "the loaded model's logits are not finite"
        except Exception as exc:  # noqa: BLE001 - recorded: this is what the stage checks
            data["error"] = f"normswap.load failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    else:
        data["error"] = f"accelerate launch exited {proc.returncode}"
    if kind == "fsdp" and data["loaded"] and not data["sharded"]:  # the recipe says so under FSDP
        data["error"] = "the run finished but not under FSDP (the recipe did not report sharded weights)"
    print(json.dumps(data, indent=2))
    _write(out, kind, data)
    return 0 if data["loaded"] and not data.get("error") else 1


def shard_files(files: Sequence[Path], shards: int) -> list[list[Path]]:
    """Test files into ``shards`` groups of similar total size (largest first, each to the lightest group)."""
    groups: list[list[Path]] = [[] for _ in range(max(1, min(shards, len(files))))]
    sizes = [0] * len(groups)
    for f in sorted(files, key=lambda p: (-p.stat().st_size, str(p))):
        i = sizes.index(min(sizes))
        groups[i].append(f)
        sizes[i] += f.stat().st_size
    return [sorted(g) for g in groups if g]


def junit_totals(paths: Sequence[Path], root: Path = REPO) -> dict:
    """Counts and failing test ids from pytest's JUnit XML files (missing or unreadable files are listed)."""
    tot = {"total": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failing": [], "unreadable": []}
    for path in paths:
        try:
            root_el = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            tot["unreadable"].append(path.name)
            continue
        for case in root_el.iter("testcase"):
            if not case.get("name"):  # the test running when pytest was interrupted: no verdict
                continue
            tot["total"] += 1
            kinds = {child.tag for child in case}
            if "failure" in kinds:
                tot["failed"] += 1
            elif "error" in kinds:
                tot["errors"] += 1
            elif "skipped" in kinds:
                tot["skipped"] += 1
                continue
            else:
                tot["passed"] += 1
                continue
            tot["failing"].append(node_id(case.get("classname", ""), case.get("name", ""), root))
    tot["failing"].sort()
    return tot


def node_id(classname: str, name: str, root: Path = REPO) -> str:
    """pytest's node id back from JUnit's dotted classname ("tests.backends.test_gpu.TestX"); a module
    that failed to import comes with no classname and its dotted name as the name."""
    if not classname:
        path = name.replace(".", "/") + ".py"
        return path if (root / path).exists() else name
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if (root / path).exists():
            return "::".join([path, *parts[i:], name])
    return f"{classname}::{name}" if classname else name


def run_tests(out: Path, shards: int, root: Path = REPO) -> int:
    """The suite under ``root/tests`` in ``shards`` concurrent pytest processes; counts and failing ids
    from their JUnit XML (written on SIGINT too, so a run cut at the budget still reports)."""
    files = sorted((root / "tests").rglob("test_*.py"))
    groups = shard_files(files, shards)
    res = out / "stages" / "tests"
    res.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.gettempdir()) / "normswap-gpu-acceptance"
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if len(groups) > 1 else dict(os.environ)
    procs, xmls = [], []
    for i, group in enumerate(groups):
        xml = res / f"shard-{i}.xml"
        xml.unlink(missing_ok=True)
        xmls.append(xml)
        cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={xml}"]
        if len(groups) > 1:  # concurrent runs: their own temp folders, no shared cache writes; a module
            # that fails to import fails alone instead of stopping its whole shard
            cmd += ["-p", "no:cacheprovider", "--continue-on-collection-errors", f"--rootdir={root}",
                    f"--basetemp={base / f'shard-{i}'}", *map(str, group)]
        log = open(res / f"shard-{i}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env,
                                       preexec_fn=default_sigint), log))
    interrupted = False
    try:
        for p, _ in procs:
            p.wait()
    except KeyboardInterrupt:  # the stage's budget: the shards got SIGINT too and write their XML
        interrupted = True
        until = time.monotonic() + GRACE_S - 2
        for p, _ in procs:
            try:
                p.wait(timeout=max(0.1, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
    for _, log in procs:
        log.close()
    data = junit_totals(xmls, root)
    data.update(command="python -m pytest -q", shards=len(groups), interrupted=interrupted,
                threads_per_shard=env.get("OMP_NUM_THREADS", "default"), shard_rcs=[p.returncode for p, _ in procs])
    _write(out, "tests", data)
    print(f"{data['passed']} passed, {data['failed']} failed, {data['errors']} errors, {data['skipped']} skipped "
          f"in {len(groups)} shard(s)" + (" (interrupted)" if interrupted else ""))
    for f in data["failing"]:
        print(f"FAILED {f}")
    for i, (p, _) in enumerate(procs):
        if p.returncode not in (0, None):
            print(f"--- shard {i} (exit {p.returncode}), last lines:")
            print(tail((res / f"shard-{i}.log").read_text(errors="replace"), 25, 3000))
    if interrupted:
        return 3
    rcs = {p.returncode for p, _ in procs}
    return 0 if rcs == {0} else 1 if rcs <= {0, 1} else 2


WORKERS = ("install", "env", "fsdp", "ddp", "tests")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=WORKERS)
    ap.add_argument("--out", required=True, help="the report folder of gpu_acceptance.py")
    ap.add_argument("--wheelhouse", default=None, help="install: a folder of wheels for missing packages")
    ap.add_argument("--test-shards", type=int, default=None, help="tests: concurrent pytest processes")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    if args.stage == "install":
        return run_install(out, args.wheelhouse)
    if args.stage == "env":
        return run_env(out)
    if args.stage == "tests":
        return run_tests(out, args.test_shards or default_shards())
    return run_recipe(out, args.stage)


if __name__ == "__main__":
    sys.exit(main())
