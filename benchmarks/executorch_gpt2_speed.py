"""ExecuTorch (XNNPACK) float32 time of a GPT-2-shaped decoder: the original, the normswap conversion, and the
conversion exported inside ``normswap.integrations.executorch.delegable_norms`` (each RMSNorm's mean of squares
as a matrix product, which XNNPACK delegates).

The model is ``bench_deploy_speed.build("gpt2", layers=--layers)`` (width 768, 12 heads, random weights with every
LayerNorm γ/β and bias randomised by ``randomise_``) and its ``normswap.patch`` conversion. Each program is
exported with ``torch.export`` (no cache: one prefill of ``T`` tokens, batch 1), lowered with ExecuTorch's
``to_edge_transform_and_lower`` + ``XnnpackPartitioner`` and run by ExecuTorch's runtime. The original is lowered
twice: its second copy is the A/A column (the noise floor of the run). Rounds rotate the programs' order and run it
forwards then backwards (ABBA for two); per round, each program's time over the original's. Reported per cell:
the median ratio with a 95% bootstrap interval of the median, on the wall clock and on the calling thread's CPU
clock (``time.thread_time``: less sensitive to other jobs on a shared machine; with ExecuTorch's threadpool at one
thread, ``--threads 1``, the default here, all of XNNPACK's work runs in the calling thread), and the 1-minute
load average before and after. Prints what stays outside the XNNPACK delegate.

``--dinov2 DIR`` adds the real DINOv2-small (``normswap convert``'s conversion, CLS embedding, ``--image`` px, one
cell per ``--batches`` entry) with the same columns.

    PYTHONPATH=.:benchmarks:ET_PKGS OMP_NUM_THREADS=1 python benchmarks/executorch_gpt2_speed.py \
        --dinov2 DINOV2_SMALL --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import statistics
import time
import warnings
from pathlib import Path

import torch


class LastHidden(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).last_hidden_state


def timed(meth, x: torch.Tensor, n: int) -> tuple[float, float]:
    """Seconds per call of ``meth`` on ``x`` over ``n`` calls after one warm-up call: (wall, thread CPU)."""
    meth.execute([x])
    w, c = time.perf_counter(), time.thread_time()
    for _ in range(n):
        meth.execute([x])
    return (time.perf_counter() - w) / n, (time.thread_time() - c) / n


def median_ci(values: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """Median and a 95% percentile-bootstrap interval of the median (resampling rounds)."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return statistics.median(values), meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def time_cell(methods: dict, ids: torch.Tensor, rounds: int, calls: int) -> dict[str, dict]:
    """``rounds`` rotated forward-and-back rounds over ``methods`` (the first is the reference); per program, the
    median ratio to the reference and its interval on both clocks, and its reference time in ms."""
    names = list(methods)
    ratios: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in names[1:]}
    ref_ms = []
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        wall = dict.fromkeys(names, 0.0)
        cpu = dict.fromkeys(names, 0.0)
        for k in order + order[::-1]:
            w, c = timed(methods[k], ids, calls)
            wall[k] += w
            cpu[k] += c
        ref_ms.append(wall[names[0]] / 2 * 1e3)
        for k in names[1:]:
            ratios[k]["wall"].append(wall[k] / wall[names[0]])
            ratios[k]["cpu"].append(cpu[k] / cpu[names[0]])
    out = {}
    for k in names[1:]:
        out[k] = {clock: dict(zip(("median", "low", "high"), median_ci(v), strict=True)) | {"rounds": v}
                  for clock, v in ratios[k].items()}
    out["original_ms"] = statistics.median(ref_ms)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="*", default=[8, 128], help="GPT-2 prefill lengths (none: DINOv2 only)")
    ap.add_argument("--forms", nargs="+", default=["addmm"], help="delegable_norms forms, one column each")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--calls", type=int, default=160, help="token-calls per timed block (calls = this / tokens)")
    ap.add_argument("--threads", type=int, default=1, help="ExecuTorch's threadpool size (its default: one per core)")
    ap.add_argument("--dinov2", type=Path, help="also the real DINOv2-small from this folder (CLS embedding)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="DINOv2 batch sizes")
    ap.add_argument("--image", type=int, default=112, help="DINOv2 image size")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from bench_deploy_speed import build
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
    from executorch_dinov2 import Cls, lower, variant

    import normswap

    torch.set_num_threads(1)
    _unsafe_reset_threadpool(args.threads)  # torch's thread setting does not reach ExecuTorch's own pool
    original, _ = build("gpt2", layers=args.layers)
    converted = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(converted)
    result: dict = {"layers": args.layers, "forms": args.forms, "rounds": args.rounds, "threads": args.threads,
                    "image": args.image, "cells": {}}
    cells = [(f"{tokens}", LastHidden(original).eval(), LastHidden(converted.eval()).eval(),
              torch.randint(0, 50257, (1, tokens), generator=torch.Generator().manual_seed(tokens)), tokens)
             for tokens in args.tokens]
    if args.dinov2:
        import transformers as tf

        dino = tf.Dinov2Model.from_pretrained(args.dinov2).eval()
        native = Cls(variant(dino, "native")).eval()  # what `normswap convert` writes
        gen = torch.Generator().manual_seed(0)
        cells += [(f"dinov2 batch {b}", Cls(dino).eval(), native, torch.randn(b, 3, args.image, args.image,
                                                                                  generator=gen),
                   b * (args.image // 14) ** 2)  # patch tokens, for the calls per timed block
                  for b in args.batches]
    for key, base, conv, example, tokens in cells:
        result["cells"][key] = run_cell(key, base, conv, example, args, max(2, args.calls // tokens), lower)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))


def run_cell(key: str, base: torch.nn.Module, conv: torch.nn.Module, example: torch.Tensor,
             args: argparse.Namespace, calls: int, lower) -> dict:
    """Lower the original (twice), the conversion and the conversion under each form; time them."""
    from normswap.integrations.executorch import delegable_norms

    programs = {"original": (base, None), "original A/A": (base, None), "converted": (conv, None)}
    programs |= {f"converted, {f} form": (conv, f) for f in args.forms}
    methods, outside, diffs = {}, {}, {}
    for label, (model, form) in programs.items():
        with delegable_norms(model, form) if form else contextlib.nullcontext():
            methods[label], outside[label] = lower(model, example)
    ref = methods["original"].execute([example])[0]
    for label, meth in methods.items():
        diffs[label] = float((meth.execute([example])[0] - ref).abs().max())
        mine, orig = outside[label], outside["original"]
        changed = {k: mine.get(k, 0) for k in mine.keys() | orig.keys() if mine.get(k, 0) != orig.get(k, 0)}
        print(f"{key} {label}: max |− original| {diffs[label]:.1e}; ops outside the delegate whose count "
              f"differs from the original's: {changed or 'none'}", flush=True)
    load = os.getloadavg()[0]
    cell = time_cell(methods, example, args.rounds, calls)
    cell |= {"load_before": load, "load_after": os.getloadavg()[0], "max_diff": diffs, "outside": outside}
    for label in list(methods)[1:]:
        w, c = cell[label]["wall"], cell[label]["cpu"]
        print(f"  {key} {label} / original: wall {w['median']:.3f} ({w['low']:.3f}-{w['high']:.3f}), "
              f"thread CPU {c['median']:.3f} ({c['low']:.3f}-{c['high']:.3f})", flush=True)
    print(f"  {key}: original {cell['original_ms']:.2f} ms per call; load average {load:.1f} -> "
          f"{cell['load_after']:.1f}", flush=True)
    return cell

if __name__ == "__main__":
    main()
