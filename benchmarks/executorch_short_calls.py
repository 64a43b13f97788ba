"""ExecuTorch (XNNPACK) float32 time of short and long calls, each program timed in its own processes.

Round 56's design (``executorch_gpt2_speed.py``: every program loaded once into one process, rounds rotating between
them) could not resolve short calls: at 8 tokens and one ExecuTorch thread two lowerings of the same original
differed by 1.34x, a property of where each program sat in that process's memory, fixed for the run. Here each
program is written once as a ``.pte`` file (the original twice: two independent lowerings, the A/A pair), and every
timing is a fresh process (``--worker``) that loads one ``.pte``, sets ExecuTorch's threadpool explicitly before
loading it (``_unsafe_reset_threadpool``: ``torch.set_num_threads`` does not reach it), runs warm-up calls and then
times single calls for ``--seconds``. A round starts one process per program and cell (token count and pool size) in
a random order (seeded); per round and cell, each program's per-call median over the original's. Placement then
differs from process to process and averages out over rounds instead of biasing a whole run. Reported per cell: the
median of the per-round ratios with a 95% bootstrap interval of the median, on three clocks: wall, the calling
thread's CPU (``time.thread_time``: at one ExecuTorch thread all of XNNPACK's work, and the clock least moved by
other jobs on a shared machine) and the process's CPU (``time.process_time``: every pool thread, for ``--threads
2``), with the 1-minute load average over the run.

Programs: ``original``, ``original A/A`` (a second lowering of the same model), ``converted`` (``normswap.patch``,
the default export form: one ``aten.rms_norm`` per norm) and one ``converted, FORM`` per ``--forms`` entry
(exported inside ``normswap.integrations.executorch.delegable_norms(model, FORM)``); ``--rewrite`` adds
``converted, rewritten`` (the default export, its ``aten.rms_norm`` nodes rewritten into the ``addmm`` form at
lowering time by ``normswap.integrations.executorch.delegable_program``). The model is
``bench_deploy_speed.build("gpt2", layers=--layers)`` (width 768, 12 heads, random weights, γ/β and biases
randomised), batch 1, no cache, one prefill of T tokens per call (``--tokens``; 1 is a decode-sized call).

Also per cell: ``pooled``, the ratio of the two programs' medians over rounds with an interval that resamples each
program's processes (no pairing: tighter when nothing drifts), and ``spread``, the process-to-process interquartile
range over the median (what placement alone moves a call by). ``--minutes`` starts no round that would end after
it. Lowering is deterministic here (the A/A pair's ``.pte`` files are byte-identical: ``sha256`` in the JSON), so
the A/A measures only the process, not the build.

    PYTHONPATH=.:benchmarks:$ET OMP_NUM_THREADS=1 python benchmarks/executorch_short_calls.py --tokens 1 8 128 \\
        --threads 1 2 --rounds 12 --seconds 0.5 --minutes 11.5 --json docs/results/executorch57_short_calls_quiet.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

CLOCKS = ("wall", "thread", "process")


def example(tokens: int):
    """The token ids of a ``tokens``-long call (the same in the builder and in every worker)."""
    import torch

    return torch.randint(0, 50257, (1, tokens), generator=torch.Generator().manual_seed(tokens))


def worker(pte: str, tokens: int, threads: int, seconds: float, warmup: int) -> None:
    """Set ExecuTorch's pool to ``threads``, load one ``.pte``, run ``warmup`` calls, then time single calls for
    ``seconds``; print the per-call medians (seconds) on each clock as one JSON line. (Resetting the pool after a
    delegate has run on it aborts the process now and then: one pool size per process.)"""
    import torch
    from executorch.extension.pybindings import _C  # the runtime alone: portable_lib imports all of exir

    torch.set_num_threads(1)
    _C._unsafe_reset_threadpool(threads)
    module = _C._load_for_executorch(pte)
    x = [example(tokens)]
    for _ in range(warmup):
        module.forward(x)
    times: dict[str, list[float]] = {c: [] for c in CLOCKS}
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times["wall"]) < 5:
        w, t, p = time.perf_counter(), time.thread_time(), time.process_time()
        module.forward(x)
        times["wall"].append(time.perf_counter() - w)
        times["thread"].append(time.thread_time() - t)
        times["process"].append(time.process_time() - p)
    print(json.dumps({c: statistics.median(v) for c, v in times.items()} | {
        "calls": len(times["wall"]), "pool": _C._threadpool_get_thread_count()}))


def median_ci(values: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """Median and a 95% percentile-bootstrap interval of the median (resampling rounds)."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return statistics.median(values), meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def build(args: argparse.Namespace, folder: Path) -> dict:
    """Lower every program for every token count into ``folder``; returns ``{tokens: {program: info}}``."""
    import torch
    from bench_deploy_speed import build as build_model
    from executorch_dinov2 import lower_program
    from executorch_gpt2_speed import LastHidden

    import normswap
    from normswap.integrations.executorch import delegable_norms

    torch.set_num_threads(1)
    original, _ = build_model("gpt2", layers=args.layers)
    converted = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(converted)
    base, conv = LastHidden(original).eval(), LastHidden(converted.eval()).eval()
    programs = {"original": (base, None), "original A/A": (base, None), "converted": (conv, None)}
    programs |= {f"converted, {f}": (conv, f) for f in args.forms}
    if args.rewrite:
        programs["converted, rewritten"] = (conv, "rewrite")
    built: dict = {}
    for tokens in args.tokens:
        x = example(tokens)
        built[str(tokens)] = cell = {}
        ref = None
        for label, (model, form) in programs.items():
            t0 = time.perf_counter()
            with delegable_norms(model, form) if form not in (None, "rewrite") else contextlib.nullcontext():
                ep = torch.export.export(model, (x,))
            if form == "rewrite":
                from normswap.integrations.executorch import delegable_program

                ep = delegable_program(ep)
            meth, outside, buffer = lower_program(ep)
            out = meth.execute([x])[0]
            ref = out if ref is None else ref
            path = folder / f"{tokens}-{label.replace(' ', '_').replace(',', '').replace('/', '')}.pte"
            path.write_bytes(buffer)
            cell[label] = {"pte": str(path), "sha256": hashlib.sha256(buffer).hexdigest()[:16],
                           "bytes": len(buffer), "outside": outside, "max_diff": float((out - ref).abs().max())}
            print(f"{tokens} tokens, {label}: lowered in {time.perf_counter() - t0:.0f} s, "
                  f"max |- original| {cell[label]['max_diff']:.1e}, outside the delegate {outside}", flush=True)
    return built


def spawn(pte: str, tokens: int, threads: int, args: argparse.Namespace, failures: list) -> dict:
    """One fresh process timing ``pte`` at one pool size; a process that dies is recorded and run again."""
    cmd = [sys.executable, __file__, "--worker", pte, "--tokens", str(tokens), "--threads", str(threads),
           "--seconds", str(args.seconds), "--warmup", str(args.warmup)]
    for _ in range(3):
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode == 0:
            return json.loads(out.stdout.strip().splitlines()[-1])
        failures.append({"pte": pte, "threads": threads, "returncode": out.returncode, "stderr": out.stderr[-500:]})
        print(f"worker {Path(pte).name} at {threads} threads exited {out.returncode}: run again", flush=True)
    raise SystemExit(f"{pte}: the worker failed three times")


def summarise(samples: list[dict], names: list[str]) -> dict:
    """Per program and clock: the per-round ratios to the original, their median and interval (``median`` etc.),
    the ratio of the two programs' medians over rounds with an interval resampling each program's processes
    (``pooled``: no pairing, tighter when nothing drifts), and each program's process-to-process spread
    (``spread``: the interquartile range of its per-process medians over their median)."""
    out: dict = {"original_ms": {c: statistics.median(s["original"][c] for s in samples) * 1e3 for c in CLOCKS}}
    rng = random.Random(0)
    for k in names[1:]:
        out[k] = {}
        for c in CLOCKS:
            ratios = [s[k][c] / s["original"][c] for s in samples]
            mine, ref = [s[k][c] for s in samples], [s["original"][c] for s in samples]
            draws = sorted(statistics.median(rng.choices(mine, k=len(mine)))
                           / statistics.median(rng.choices(ref, k=len(ref))) for _ in range(2000))
            out[k][c] = dict(zip(("median", "low", "high"), median_ci(ratios), strict=True)) | {
                "pooled": [statistics.median(mine) / statistics.median(ref), draws[50], draws[1949]],
                "spread": spread(mine), "rounds": ratios}
    out["original_spread"] = {c: spread([s["original"][c] for s in samples]) for c in CLOCKS}
    return out


def spread(values: list[float]) -> float:
    """Interquartile range over the median (0 for fewer than 4 values)."""
    if len(values) < 4:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 128])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="ExecuTorch threadpool sizes")
    ap.add_argument("--forms", nargs="*", default=["addmm"], help="delegable_norms forms, one program each")
    ap.add_argument("--rewrite", action="store_true", help="also the lowering-time rewrite (delegable_program)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=1.0, help="timed seconds per process")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, help="start no round that would end after this (lowering included)")
    ap.add_argument("--keep", type=Path, help="write the .pte files here (default: a temporary folder)")
    ap.add_argument("--reuse", action="store_true", help="time the --keep folder's programs instead of lowering")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.tokens[0], args.threads[0], args.seconds, args.warmup)
        return

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        manifest = folder / "manifest.json"
        if args.reuse and manifest.exists():
            built = json.loads(manifest.read_text())
        else:
            built = build(args, folder)
            manifest.write_text(json.dumps(built, indent=1))
        names = list(next(iter(built.values())))
        result: dict = {"layers": args.layers, "rounds": args.rounds, "seconds": args.seconds,
                        "warmup": args.warmup, "seed": args.seed, "build_s": time.perf_counter() - t0,
                        "programs": built, "cells": {}, "load": [os.getloadavg()[0]]}
        rng = random.Random(args.seed)
        samples: dict = {f"{t} tokens, {n} threads": [] for t in args.tokens for n in args.threads}
        result["failures"] = []
        started = time.perf_counter()
        for r in range(args.rounds):
            elapsed = time.perf_counter() - t0
            if args.minutes and r and elapsed + (time.perf_counter() - started) / r > args.minutes * 60:
                print(f"stopping after {r} rounds: another would pass --minutes {args.minutes}", flush=True)
                break
            jobs = [(t, n, k) for t in args.tokens for n in args.threads for k in names]
            rng.shuffle(jobs)  # one process per program, token count and pool size, in a random order
            got: dict = {key: {} for key in samples}
            for t, n, k in jobs:
                got[f"{t} tokens, {n} threads"][k] = spawn(built[str(t)][k]["pte"], t, n, args, result["failures"])
            for key, s in got.items():
                samples[key].append(s)
                result["cells"][key] = summarise(samples[key], names) | {"samples": samples[key]}
            result["load"].append(os.getloadavg()[0])
            print(f"round {r + 1}/{args.rounds} done at {time.perf_counter() - t0:.0f} s, "
                  f"load {result['load'][-1]:.1f}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))
    for key, cell in result["cells"].items():
        print(f"{key}: original {cell['original_ms']['wall']:.2f} ms wall, {cell['original_ms']['thread']:.2f} ms "
              "thread CPU per call", flush=True)
        for k in names[1:]:
            print(f"  {k:22s} " + "  ".join(f"{c} {cell[k][c]['median']:.3f} ({cell[k][c]['low']:.3f}-"
                                             f"{cell[k][c]['high']:.3f})" for c in CLOCKS), flush=True)
        print("  process-to-process spread of the original (IQR / median): " + "  ".join(
            f"{c} {cell['original_spread'][c]:.3f}" for c in CLOCKS), flush=True)


if __name__ == "__main__":
    main()
