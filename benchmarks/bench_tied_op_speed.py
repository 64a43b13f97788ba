"""What the tied embedding's centering op costs: original vs ``convert``'s default (head tied, one op) vs ``--untie``.

Since round 52 ``convert`` keeps a head tied to the input embedding: the table is not centered by weights
(the head shares it), so one centering op (a forward hook after ``wte``: one mean per token) centers the
stream instead. ``--untie`` clones the head and centers the table by weights (no op, one more matrix).
This times the three side by side in one process, on a GPT-2-small-shaped LM (12 layers x 768, random
weights, LayerNorm γ/β and biases randomised, tied head; ``GPT2LMHeadModel``, the head included):

- ``decode``: torch eager, one token with a KV cache of ``--past`` tokens (``DynamicCache``, cropped back
  after each call so every call sees the same cache): the per-call host cost users feel in generation.
- ``prefill``: torch eager, ``--lengths`` tokens, logits of the last position (``logits_to_keep=1``, as
  ``generate`` asks).
- ``ort``: the prefill exported as docs/deployment.md says (``torch.onnx.export(dynamo=True)``, dynamic batch
  and sequence, logits of every position), ONNX Runtime's CPU provider at its default optimisation level.
- ``compile``: ``torch.compile`` (inductor, ``dynamic=True``) of the eager prefill.
- ``embed``: the op alone, per call: ``wte`` bare, with the default's hook, and as a module wrapper
  (``CenteredEmbedding``: no hook, same values), at the decode and prefill shapes.

Timing: per cell, palindromic rounds ``O C D U U D C O`` (O original, C a second copy of the original: the
A/A control, D default, U ``--untie``; ``--order`` permutes the first half), each variant's two calls summed;
ratio per round against O; the median and quartiles over rounds. ``--threads 1`` times the calling thread's
CPU time (every engine computes on it); other thread counts wall time. ORT sessions are created in the order
above and again reversed, rounds from both pooled (creation order moved one file's time by 2-7% in
bench_deploy_speed.py).

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/bench_tied_op_speed.py --threads 1 \\
        --json docs/results/tie53_speed_t1.json

Also prints what ORT's session optimiser makes of the op (its nodes after ``wte``'s ``Gather``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_deploy_speed as deploy  # noqa: E402 (the benchmarks folder is on the path only now)

import normswap  # noqa: E402

NAMES = ("original", "control", "default", "untie")
ORDER = list(NAMES)  # the palindrome's first half (``--order``); ratios are always against the original


def build(layers: int, width: int, heads: int, dtype: torch.dtype = torch.float32) -> dict[str, nn.Module]:
    """The original (tied, randomised), its A/A copy, and the two conversions (``patch`` defaults / ``untie=True``),
    all in ``dtype`` (converted in it: float64 for exactness checks)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=layers, n_embd=width, n_head=heads)
    original = deploy.randomise_(tf.GPT2LMHeadModel(config).to(dtype))
    models = {"original": original, "control": copy.deepcopy(original)}
    for name, kwargs in (("default", {}), ("untie", {"untie": True})):
        m = copy.deepcopy(original)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            normswap.patch(m, **kwargs)
        models[name] = m.eval()
    return models


def describe(models: dict[str, nn.Module]) -> dict[str, Any]:
    """Per variant: tied or not, forward hooks on the embedding, parameters, and the logits' agreement."""
    ids = torch.randint(100, 20000, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = models["original"](input_ids=ids, use_cache=False).logits
    out = {}
    for name, m in models.items():
        wte = m.transformer.wte
        with torch.inference_mode():
            logits = m(input_ids=ids, use_cache=False).logits
        out[name] = {"tied": m.lm_head.weight is wte.weight, "wte_forward_hooks": len(wte._forward_hooks),
                     "parameters": sum(p.numel() for p in m.parameters()),
                     "max_abs_logit_diff": float((logits - ref).abs().max())}
    return out


def rounds(calls: dict[str, Callable[[], object]], budget_s: float, min_rounds: int,
           clock: Callable[[], float]) -> dict[str, list[float]]:
    """Palindromic rounds over ``calls`` (in NAMES order, then reversed): per round each variant's summed time."""
    order = [n for n in ORDER if n in calls]
    seq = order + order[::-1]
    for n in seq:
        calls[n]()
    times: dict[str, list[float]] = {n: [] for n in order}
    start = time.perf_counter()
    while len(times[order[0]]) < min_rounds or time.perf_counter() - start < budget_s:
        acc = dict.fromkeys(order, 0.0)
        for n in seq:
            t0 = clock()
            calls[n]()
            acc[n] += clock() - t0
        for n in order:
            times[n].append(acc[n])
        if len(times[order[0]]) >= 300:
            break
    return times


def summarise(times: dict[str, list[float]]) -> dict[str, Any]:
    base = times["original"]
    out: dict[str, Any] = {"rounds": len(base), "original_ms": 1e3 * statistics.median(base) / 2}
    pairs = [(n, "original") for n in times if n != "original"] + [("default", "untie")]
    for num, den in pairs:
        if num not in times or den not in times:
            continue
        r = [a / b for a, b in zip(times[num], times[den], strict=True)]
        q = statistics.quantiles(r, n=4) if len(r) >= 2 else [r[0]] * 3
        out[f"{num}/{den}"] = {"median": statistics.median(r), "q1": q[0], "q3": q[2]}
    return out


def merge(a: dict[str, list[float]], b: dict[str, list[float]]) -> dict[str, list[float]]:
    return {n: a[n] + b[n] for n in a}


class Prefill(nn.Module):
    """input_ids, attention_mask -> logits (every position): the exported / compiled graph."""

    def __init__(self, model: nn.Module, last_only: bool) -> None:
        super().__init__()
        self.model, self.keep = model, (1 if last_only else 0)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        input_ids, attention_mask = tensors  # positional, as deploy.export's dynamic shapes name them
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                          logits_to_keep=self.keep).logits


def ids_for(batch: int, length: int) -> torch.Tensor:
    return torch.randint(100, 20000, (batch, length), generator=torch.Generator().manual_seed(batch * 1000 + length))


def decode_call(model: nn.Module, batch: int, past: int) -> Callable[[], object]:
    """One decode step on a cache of ``past`` tokens, the cache cropped back after it (same work each call)."""
    from transformers import DynamicCache

    ids = ids_for(batch, past + 1)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :past], cache=cache, use_cache=True)
    step, mask = ids[:, past:], torch.ones(batch, past + 1, dtype=torch.long)

    def run() -> object:
        with torch.inference_mode():
            out = model(input_ids=step, attention_mask=mask, cache=cache, use_cache=True).logits
            cache.crop(-1)
        return out

    return run


def prefill_call(fn: Callable[..., torch.Tensor], batch: int, length: int) -> Callable[[], object]:
    ids = ids_for(batch, length)
    mask = torch.ones_like(ids)

    def run() -> object:
        with torch.inference_mode():
            return fn(ids, mask)

    return run


def export_all(models: dict[str, nn.Module], cache: Path) -> dict[str, Path]:
    """Each variant's prefill (all positions' logits) exported once with ``deploy.export`` (dynamic batch/seq)."""
    cache.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, m in models.items():
        path = cache / f"{'original' if name == 'control' else name}.onnx"
        if name != "control":
            example = ids_for(2, 16)
            deploy.export(Prefill(m, last_only=False).eval(), (example, torch.ones_like(example)), path, None)
        paths[name] = path
    return paths


def ort_graph(path: Path, threads: int) -> dict[str, Any]:
    """Op counts of ORT's optimised graph (default level), and the nodes reading ``wte``'s Gather."""
    import onnx
    import onnxruntime as ort

    out = path.with_name(path.stem + f"-ortopt{threads}.onnx")
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(out)
    so.log_severity_level = 3
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    g = onnx.load(str(out), load_external_data=False).graph
    ops = Counter(n.op_type for n in g.node)
    gathers = [n for n in g.node if n.op_type == "Gather"]
    readers: dict[str, list[str]] = {}
    for gnode in gathers:
        readers[gnode.name] = [n.op_type for n in g.node if any(o in n.input for o in gnode.output)]
    return {"ops": dict(sorted(ops.items())), "gather_readers": readers}


def ort_session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class CenteredEmbedding(nn.Module):
    """The op as a module wrapper instead of a hook: ``wte(ids)`` minus its per-token mean (same values)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embedding(ids)
        return e - e.mean(-1, keepdim=True)


def embed_cells(models: dict[str, nn.Module], args: argparse.Namespace, clock: Callable[[], float]) -> list[dict]:
    """The op alone, per call: ``wte`` without a hook (original), with the default's hook, and the wrapper.

    Each sample is ``--embed-calls`` calls (a decode step's one token per row, and a prefill's tokens), timed
    in the same palindromic rounds; microseconds per call and the increment over the bare embedding."""
    bare = models["original"].transformer.wte
    hooked = models["default"].transformer.wte
    assert len(hooked._forward_hooks) == 1 and not bare._forward_hooks
    wrapper = CenteredEmbedding(copy.deepcopy(bare))
    with torch.no_grad():  # the wrapper centers the raw table's rows itself, as the hook does the default's
        wrapper.embedding.weight.copy_(hooked.weight)
    rows = []
    for b, t in [(b, 1) for b in args.batches] + [(b, t) for b in args.batches for t in args.lengths]:
        ids = ids_for(b, t)
        probe = {n: m(ids) for n, m in (("hook", hooked), ("wrapper", wrapper))}
        assert torch.equal(probe["hook"], probe["wrapper"]), "the wrapper must give the hook's values"

        def repeat(m: nn.Module, ids: torch.Tensor = ids) -> Callable[[], object]:
            def go() -> None:
                with torch.inference_mode():
                    for _ in range(args.embed_calls):
                        m(ids)
            return go

        calls = {"original": repeat(bare), "control": repeat(copy.deepcopy(bare)), "default": repeat(hooked),
                 "untie": repeat(wrapper)}  # "untie" slot: the wrapper form
        times = rounds(calls, args.budget / 2, args.min_rounds, clock)
        us = {("wrapper" if n == "untie" else n): 1e6 * statistics.median(v) / 2 / args.embed_calls
              for n, v in times.items()}
        row = {"engine": "embed", "batch": b, "tokens": t, "us_per_call": us,
               "hook_minus_bare_us": us["default"] - us["original"],
               "wrapper_minus_bare_us": us["wrapper"] - us["original"]}
        print(f"embed    b{b} t{t:<4d} us/call " + ", ".join(f"{k} {v:.2f}" for k, v in us.items()), flush=True)
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    ORDER[:] = args.order.split(",")
    if sorted(ORDER) != sorted(NAMES):
        raise SystemExit(f"--order: a permutation of {','.join(NAMES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    clock = time.thread_time if threads == 1 else time.perf_counter
    models = build(args.layers, args.width, args.heads)
    result: dict[str, Any] = {"threads": threads, "clock": "thread_time" if threads == 1 else "wall",
                              "variants": describe(models), "cells": []}
    print(json.dumps(result["variants"], indent=1), flush=True)

    def record(engine: str, batch: int, tokens: int, times: dict[str, list[float]]) -> None:
        row = {"engine": engine, "batch": batch, "tokens": tokens, **summarise(times)}
        result["cells"].append(row)
        cells = "  ".join(f"{k} {v['median']:.3f} [{v['q1']:.3f}-{v['q3']:.3f}]" for k, v in row.items()
                          if isinstance(v, dict))
        print(f"{engine:8s} b{batch} t{tokens:<4d} O {row['original_ms']:.2f} ms, {row['rounds']} rounds: {cells}",
              flush=True)

    engines = args.engines.split(",")
    if "embed" in engines:
        result["cells"] += embed_cells(models, args, clock)
    if "decode" in engines:
        for b in args.batches:
            calls = {n: decode_call(m, b, args.past) for n, m in models.items()}
            record("decode", b, args.past, rounds(calls, args.budget, args.min_rounds, clock))
    if "prefill" in engines:
        for b in args.batches:
            for t in args.lengths:
                calls = {n: prefill_call(Prefill(m, last_only=True), b, t) for n, m in models.items()}
                record("prefill", b, t, rounds(calls, args.budget, args.min_rounds, clock))
    if "ort" in engines:
        logging.disable(logging.WARNING)
        paths = export_all(models, args.cache)
        logging.disable(logging.NOTSET)
        result["ort_graph"] = {n: ort_graph(paths[n], threads) for n in ("original", "default", "untie")}
        for n in ("original", "default", "untie"):
            print(n, "gather readers:", result["ort_graph"][n]["gather_readers"], flush=True)
        for b in args.batches:
            for t in args.lengths:
                ids = ids_for(b, t)
                feed_t = (ids, torch.ones_like(ids))
                halves = []
                for names in (list(NAMES), list(NAMES)[::-1]):
                    sessions = {n: ort_session(paths[n], threads) for n in names}
                    calls = {n: deploy.ort_call(sessions[n], feed_t) for n in NAMES}
                    halves.append(rounds(calls, args.budget / 2, max(1, args.min_rounds // 2), clock))
                    del sessions, calls
                    gc.collect()
                record("ort", b, t, merge(*halves))
    if "compile" in engines:
        compiled = {n: torch.compile(Prefill(m, last_only=True), dynamic=True) for n, m in models.items()}
        for b in args.compile_batches:
            for t in args.lengths:
                calls = {n: prefill_call(c, b, t) for n, c in compiled.items()}
                t0 = time.perf_counter()
                for c in calls.values():
                    c()  # compile (and recompile for a new shape) outside the timed rounds
                print(f"compile warm-up {time.perf_counter() - t0:.0f} s", flush=True)
                record("compile", b, t, rounds(calls, args.budget, args.min_rounds, clock))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="torch/ORT threads; 0: torch's default")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--engines", default="decode,prefill,ort,compile")
    ap.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4])
    ap.add_argument("--compile-batches", type=lambda s: [int(v) for v in s.split(",")], default=[4])
    ap.add_argument("--lengths", type=lambda s: [int(v) for v in s.split(",")], default=[32, 128])
    ap.add_argument("--past", type=int, default=64, help="KV-cache length of a decode step")
    ap.add_argument("--order", default=",".join(NAMES), help="the palindrome's first half (position check)")
    ap.add_argument("--embed-calls", type=int, default=200, help="calls per timed sample of the embed engine")
    ap.add_argument("--budget", type=float, default=10.0, help="seconds per cell")
    ap.add_argument("--min-rounds", type=int, default=6)
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "normswap-tied-op")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    t0 = time.time()
    result = run(args)
    result.update(args={k: str(v) for k, v in vars(args).items()}, seconds=round(time.time() - t0),
                  torch=torch.__version__, python=platform.python_version(), load_average=os.getloadavg())
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
