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

Programs: ``original``, ``original A/A`` (a second lowering of the same model; under int8 the original's bytes
again), ``converted`` (``normswap.patch``, the default export form: one ``aten.rms_norm`` per norm) and, in float32,
one ``converted, FORM`` per ``--forms`` entry (exported inside ``normswap.integrations.executorch.delegable_norms(
model, FORM)``); ``--rewrite`` adds ``converted, rewritten`` (the default export, its ``aten.rms_norm`` nodes
rewritten into the ``addmm`` form at lowering time by ``normswap.integrations.executorch.delegable_program``; under
int8 after ``convert_pt2e``: quantize-then-rewrite, the documented recipe).

Models (``--model``): ``gpt2``, ``bench_deploy_speed.build("gpt2", layers=--layers)`` (width 768, 12 heads, random
weights, γ/β and biases randomised), batch 1, no cache, one prefill of T tokens per call (``--tokens``; 1 is a
decode-sized call); ``dinov2``, the real DINOv2-small (``--dinov2 DIR``, ``executorch_dinov2.variant(...,
"native")``: what ``normswap convert`` writes; the CLS embedding) on ``--batch`` random ``--image``-px images per
call; ``dinov2-random``, the DINOv2-small-shaped random model of ``bench_quant_engines.dino`` (12 layers,
LayerScale, massive activations). ``--schemes``: ``fp32``, and ExecuTorch's ``XNNPACKQuantizer`` through torchao's
PT2E flow, weights int8 per channel: ``dyn`` (dynamic int8 activations) and ``static`` (calibrated on the call's
input and three permutations of it: structure, not accuracy; the converted programs with
``set_module_type(normswap.RMSNorm, None)``, the documented recipe). Under int8 the GPT-2 model has its ``Conv1D``
projections as ``nn.Linear`` (the quantizer annotates ``linear``, not ``addmm``) and its position ids and causal mask
as buffers (``Prefill``). Each program's ops left outside the XNNPACK delegate are recorded (``outside``).

Also per cell: ``pooled``, the ratio of the two programs' medians over rounds with an interval that resamples each
program's processes (no pairing: tighter when nothing drifts), and ``spread``, the process-to-process interquartile
range over the median (what placement alone moves a call by). ``--minutes`` starts no round that would end after
it. Lowering is deterministic here (the A/A pair's ``.pte`` files are byte-identical: ``sha256`` in the JSON), so
the A/A measures only the process, not the build.

    PYTHONPATH=.:benchmarks:$ET OMP_NUM_THREADS=1 python benchmarks/executorch_short_calls.py --tokens 1 8 128 \\
        --threads 1 2 --rounds 12 --seconds 0.5 --minutes 11.5 --json docs/results/executorch57_short_calls_quiet.json
    PYTHONPATH=.:benchmarks:$ET OMP_NUM_THREADS=1 python benchmarks/executorch_short_calls.py --model dinov2 \\
        --dinov2 DINOV2_SMALL --batch 1 8 --schemes fp32 dyn --forms --rewrite --threads 1 2 --keep DIR --json OUT
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


def example(spec: str):
    """The input of one call, from its spec (the same in the builder and in every worker): ``ids:T`` (token ids,
    batch 1, T tokens) or ``image:B:P`` (B random P x P images)."""
    import torch

    kind, *dims = spec.split(":")
    if kind == "ids":
        tokens = int(dims[0])
        return torch.randint(0, 50257, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    batch, px = (int(d) for d in dims)
    return torch.randn((batch, 3, px, px), generator=torch.Generator().manual_seed(1000 * batch + px))


def worker(pte: str, spec: str, threads: int, seconds: float, warmup: int) -> None:
    """Set ExecuTorch's pool to ``threads``, load one ``.pte``, run ``warmup`` calls, then time single calls for
    ``seconds``; print the per-call medians (seconds) on each clock as one JSON line. (The pool is set before the
    program is loaded and never again: resetting it under a loaded XNNPACK program leaves that program a destroyed
    pool, ``executorch_threadpool_crash.py``.)"""
    import torch
    from executorch.extension.pybindings import _C  # the runtime alone: portable_lib imports all of exir

    torch.set_num_threads(1)
    _C._unsafe_reset_threadpool(threads)
    module = _C._load_for_executorch(pte)
    x = [example(spec)]
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


def models(args: argparse.Namespace) -> tuple:
    """The original and converted modules (each returning one tensor) and ``[(label, spec)]`` of the cells'
    inputs, for ``--model``."""
    import torch

    import normswap

    if args.model == "gpt2":
        from bench_deploy_speed import build as build_model
        from executorch_gpt2_speed import LastHidden

        original, _ = build_model("gpt2", layers=args.layers)
        converted = copy.deepcopy(original)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            normswap.patch(converted)
        if any(s != "fp32" for s in args.schemes):  # XNNPACKQuantizer annotates linear, not Conv1D's addmm
            from quant_utils import conv1d_to_linear_

            conv1d_to_linear_(original)
            conv1d_to_linear_(converted)
        cells = [(f"{t} tokens", f"ids:{t}") for t in args.tokens]
        return LastHidden(original.eval()).eval(), LastHidden(converted.eval()).eval(), cells
    from executorch_dinov2 import Cls, variant

    if args.model == "dinov2":
        import transformers as tf

        if args.dinov2 is None:
            raise SystemExit("--model dinov2 needs --dinov2 DIR (the real checkpoint)")
        original = tf.Dinov2Model.from_pretrained(args.dinov2).eval()
    else:
        from bench_quant_engines import dino

        original = dino(12, 1, max(args.image))
    torch.manual_seed(0)
    cells = [(f"batch {b}, {px} px", f"image:{b}:{px}") for px in args.image for b in args.batch]
    return Cls(original).eval(), Cls(variant(original, "native")).eval(), cells


class Prefill:
    """Factory of GPT-2 wrappers for PT2E: position ids and the causal mask as constant buffers (``tokens`` long).

    torchao's ``prepare_pt2e`` turns the graph's Python scalars into float32 constants, which breaks transformers'
    integer position and mask arithmetic (the position embedding's indices become float); with both given as
    buffers that arithmetic is not in the graph. Outputs equal ``LastHidden``'s (checked: max |difference| 0)."""

    @staticmethod
    def wrap(model, tokens: int):
        import torch

        class _Prefill(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model
                self.register_buffer("pos", torch.arange(tokens)[None], persistent=False)
                self.register_buffer("mask", torch.full((tokens, tokens), float("-inf")).triu(1)[None, None],
                                     persistent=False)

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                return self.model(input_ids=ids, position_ids=self.pos, attention_mask=self.mask,
                                  use_cache=False).last_hidden_state

        return _Prefill().eval()


def quantized(model, x, scheme: str, calib: list, norms_float: bool):
    """``model`` exported at ``x``, PT2E-quantized by ExecuTorch's ``XNNPACKQuantizer`` (``dyn``: dynamic int8
    activations; ``static``: static, calibrated on ``calib``; weights per channel), the ``convert_pt2e`` module.
    ``norms_float``: ``set_module_type(normswap.RMSNorm, None)`` (the documented static recipe)."""
    import torch
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    import normswap

    graph = torch.export.export(model, (x,)).module()
    q = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True,
                                                                         is_dynamic=scheme == "dyn"))
    if norms_float:
        q.set_module_type(normswap.RMSNorm, None)
    graph = prepare_pt2e(graph, q)
    for c in calib:
        graph(c)
    return convert_pt2e(graph)


def build(args: argparse.Namespace, folder: Path) -> dict:
    """Lower every program for every cell input and scheme into ``folder``; returns ``{cell: {"spec": input spec,
    "programs": {program: info}}}``."""
    import torch
    from executorch_dinov2 import lower_program

    from normswap.integrations.executorch import delegable_norms, delegable_program

    torch.set_num_threads(1)
    base, conv, cells = models(args)
    built: dict = {}
    for label, spec in cells:
        x = example(spec)
        calib = [x] + [_shuffled(x, i) for i in range(3)]
        for scheme in args.schemes:
            key = label if scheme == "fp32" else f"{label}, {scheme} int8"
            built[key] = {"spec": spec, "programs": {}}
            cell = built[key]["programs"]
            if scheme == "fp32":
                programs = {"original": (base, None), "original A/A": (base, None), "converted": (conv, None)}
                programs |= {f"converted, {f}": (conv, f) for f in args.forms}
            else:  # the A/A is the original's bytes again (lowering is deterministic: round 57)
                programs = {"original": (base, None), "original A/A": (base, "copy"), "converted": (conv, None)}
            if args.rewrite:
                programs["converted, rewritten"] = (conv, "rewrite")
            ref = None
            for name, (model, form) in programs.items():
                t0 = time.perf_counter()
                path = folder / f"{key}-{name}".replace(" ", "_").replace(",", "").replace("/", "")
                path = path.with_name(path.name + ".pte")
                if form == "copy":
                    buffer, outside, out = cell["original"]["_buffer"], cell["original"]["outside"], ref
                else:
                    if scheme != "fp32":
                        if args.model == "gpt2":
                            model = Prefill.wrap(model.model, x.shape[1])
                        model = quantized(model, x, scheme, calib if scheme == "static" else [x],
                                          norms_float=scheme == "static" and name != "original")
                    with delegable_norms(model, form) if form not in (None, "rewrite") else contextlib.nullcontext():
                        ep = torch.export.export(model, (x,))
                    if form == "rewrite":  # after quantization: the quantizer saw the default form
                        ep = delegable_program(ep)
                    meth, outside, buffer = lower_program(ep)
                    out = meth.execute([x])[0]
                ref = out if ref is None else ref
                path.write_bytes(buffer)
                cell[name] = {"pte": str(path), "sha256": hashlib.sha256(buffer).hexdigest()[:16],
                              "bytes": len(buffer), "outside": outside, "max_diff": float((out - ref).abs().max()),
                              "_buffer": buffer}
                print(f"{key}, {name}: lowered in {time.perf_counter() - t0:.0f} s, max |- original| "
                      f"{cell[name]['max_diff']:.1e}, outside the delegate {outside}", flush=True)
            for info in cell.values():
                info.pop("_buffer")
    return built


def _shuffled(x, i: int):
    """A calibration input of ``x``'s shape and kind: its elements permuted (seeded by ``i``)."""
    import torch

    flat = x.flatten()
    return flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(i))].reshape(x.shape)


def spawn(pte: str, spec: str, threads: int, args: argparse.Namespace, failures: list) -> dict:
    """One fresh process timing ``pte`` at one pool size; a process that dies is recorded and run again."""
    cmd = [sys.executable, __file__, "--worker", pte, "--input", spec, "--threads", str(threads),
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


def table(result: dict, clock: str) -> str:
    """A result's cells as a markdown table on ``clock``: the original's ms per call, the process-to-process spread
    of its processes, rounds, then each program's median ratio to the original with its 95% interval."""
    names: list[str] = []
    for cell in result["cells"].values():
        names += [k for k in cell if k not in ("original_ms", "original_spread", "samples") and k not in names]
    rows = [f"| cell | original ms ({clock}) | spread | rounds | " + " | ".join(names) + " |",
            "|---|---|---|---|" + "---|" * len(names)]
    for key, cell in result["cells"].items():
        vals = [f"{cell[k][clock]['median']:.3f} ({cell[k][clock]['low']:.3f}-{cell[k][clock]['high']:.3f})"
                if k in cell else "" for k in names]
        rows.append(f"| {key} | {cell['original_ms'][clock]:.2f} | {cell['original_spread'][clock]:.2f} | "
                    f"{len(cell['samples'])} | " + " | ".join(vals) + " |")
    load = result.get("load") or [0.0]
    return "\n".join(rows) + f"\n\nload average (1 min) {min(load):.1f}-{max(load):.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--input", help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=("gpt2", "dinov2", "dinov2-random"), default="gpt2")
    ap.add_argument("--dinov2", type=Path, help="the real DINOv2-small directory (--model dinov2)")
    ap.add_argument("--layers", type=int, default=4, help="GPT-2 layers")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 128], help="GPT-2 cells")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="DINOv2 cells: images per call")
    ap.add_argument("--image", type=int, nargs="+", default=[112], help="DINOv2 cells: pixels")
    ap.add_argument("--schemes", nargs="+", choices=("fp32", "dyn", "static"), default=["fp32"],
                    help="float32, and XNNPACKQuantizer's dynamic / static int8 (PT2E)")
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
    ap.add_argument("--table", type=Path, help="print a result JSON as a markdown table (--clock) and exit")
    ap.add_argument("--clock", choices=CLOCKS, default="thread")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text()), args.clock))
        return
    if args.worker:
        worker(args.worker, args.input, args.threads[0], args.seconds, args.warmup)
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
        result: dict = {"model": args.model, "layers": args.layers, "rounds": args.rounds, "seconds": args.seconds,
                        "warmup": args.warmup, "seed": args.seed, "build_s": time.perf_counter() - t0,
                        "programs": built, "cells": {}, "load": [os.getloadavg()[0]]}
        rng = random.Random(args.seed)
        keys = {f"{c}, {n} threads": (c, n) for c in built for n in args.threads}
        samples: dict = {key: [] for key in keys}
        result["failures"] = []
        started = time.perf_counter()
        for r in range(args.rounds):
            elapsed = time.perf_counter() - t0
            if args.minutes and r and elapsed + (time.perf_counter() - started) / r > args.minutes * 60:
                print(f"stopping after {r} rounds: another would pass --minutes {args.minutes}", flush=True)
                break
            jobs = [(key, k) for key, (c, _) in keys.items() for k in built[c]["programs"]]
            rng.shuffle(jobs)  # one process per program, cell and pool size, in a random order
            got: dict = {key: {} for key in samples}
            for key, k in jobs:
                c, n = keys[key]
                got[key][k] = spawn(built[c]["programs"][k]["pte"], built[c]["spec"], n, args, result["failures"])
            for key, s in got.items():
                samples[key].append(s)
                result["cells"][key] = summarise(samples[key], list(built[keys[key][0]]["programs"])) | {
                    "samples": samples[key]}
            result["load"].append(os.getloadavg()[0])
            print(f"round {r + 1}/{args.rounds} done at {time.perf_counter() - t0:.0f} s, "
                  f"load {result['load'][-1]:.1f}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))
    for key, cell in result["cells"].items():
        print(f"{key}: original {cell['original_ms']['wall']:.2f} ms wall, {cell['original_ms']['thread']:.2f} ms "
              "thread CPU per call", flush=True)
        for k in [k for k in cell if k not in ("original_ms", "original_spread", "samples")]:
            print(f"  {k:22s} " + "  ".join(f"{c} {cell[k][c]['median']:.3f} ({cell[k][c]['low']:.3f}-"
                                             f"{cell[k][c]['high']:.3f})" for c in CLOCKS), flush=True)
        print("  process-to-process spread of the original (IQR / median): " + "  ".join(
            f"{c} {cell['original_spread'][c]:.3f}" for c in CLOCKS), flush=True)


if __name__ == "__main__":
    main()
