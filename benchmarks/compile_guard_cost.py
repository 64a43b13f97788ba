"""What ``torch.compile`` pays for the online-op guard (round 65): first-compile CPU time and Dynamo's Python
object-aliasing guards, main's guard against this branch's, side by side; and the guard's eager cost per call.

Before round 65, Dynamo traced :class:`normswap.rotation.carry.OpsGuard`'s per-call comparison (a tuple of
``dict.get`` over the op modules' hook dictionaries, compared by identity with the hooks recorded). Those hooks and
hook dictionaries are reached a second time by the model's own path as Dynamo inlines the op modules' calls, so
Dynamo installed one object-aliasing guard per pair (``A is B``, with both sources spelled out), which it builds as
one Python lambda (``build_guard_function`` / ``ast`` unparsing of expressions thousands of characters long).
Since round 65 a compiled call evaluates the comparison at trace time as a constant
(``torch.compiler.assume_constant_result``) and guards on the guard's flag, its layout version and each op
module's hook-dictionary slot by ``id``: one path to each object, no aliasing guard of its own.

Measured, per model (GPT-2 architecture, random weights; ``tiny``: 2 layers, width 64; ``4x256``: 4 layers, width
256) and variant (``original``: the HF model as built; ``rotated``: ``normswap.patch`` + ``rotate(model, "none",
online=True)``; ``rotated+LoRA``: that model wrapped by PEFT LoRA on ``c_attn`` / ``c_proj`` / ``c_fc``):

* ``compile CPU s``: ``torch._dynamo.reset()``, ``torch.compile(model, backend="eager", fullgraph=True)`` and the
  first call (8 tokens), thread CPU time (``time.thread_time``), mean of the ``--rounds`` ABBA pairs per guard
  (main's ``__call__`` put back on the class for the ``main`` runs; the same model object);
* ``ratio``: this branch / main per round (ABBA: main, branch, branch, main), median; the ``original`` row is the
  A/A control (its first and last compile of each round against each other);
* ``aliasing guards`` / ``chars``: the object-aliasing expressions Dynamo put into its Python lambda guard, and
  their total length (those naming the guard's state: ``ours``).

And ``eager``: one forward of the rotated ``tiny`` model (8 tokens, no grad; ``--calls`` calls per timing) and
the guard called alone (``guard(model, ())``, 100 × ``--calls`` calls per timing), CPU microseconds per call,
main's ``__call__`` against this branch's in ABBA rounds (main, branch, branch, main), median of the per-round
ratios, with main's last against its first as the A/A.

    OMP_NUM_THREADS=1 python benchmarks/compile_guard_cost.py --json docs/results/guard65_compile_guards.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from normswap.rotation.carry import check_online_ops

SIZES = {"tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4}, "4x256": {"n_layer": 4, "n_embd": 256, "n_head": 4}}
STATE = ("dicts", "names", "modules", "slots", "loose")  # the guard's attributes a traced call may read
PROBE = {"input_ids": torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])}


def main_call(self, model: nn.Module, args: tuple) -> None:  # noqa: ANN001 - main's OpsGuard.__call__, verbatim
    """Main's (round 64's) ``OpsGuard.__call__``: the same comparison, traced by Dynamo."""
    if self.dirty or tuple(map(dict.get, self.dicts, self.names)) != self.modules:
        check_online_ops(model)
        self.watch(model)


def build(size: str, variant: str) -> nn.Module:
    """A random GPT-2 (``SIZES[size]``) as ``variant`` (see the module docstring), eval, float32."""
    import transformers as tf

    import normswap
    from normswap.rotation.rotate import rotate

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=1000, n_positions=64, **SIZES[size])).eval()
    if variant == "original":
        return model
    normswap.patch(model, beta_placement="keep")
    rotate(model, "none", online=True, seed=0)
    if variant == "rotated":
        return model
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = peft.LoraConfig(r=4, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
                                 init_lora_weights=False)
        return peft.get_peft_model(model, config).eval()


class Aliasing:
    """Collects the object-aliasing expressions Dynamo puts into its Python lambda guard (a spy on the builder)."""

    def __init__(self) -> None:
        from torch._dynamo import guards

        self.codes: list[str] = []
        self.builder = guards.GuardBuilder
        self.orig = guards.GuardBuilder.add_python_lambda_leaf_guard_to_root
        spy = self

        def add(builder, parts, *a, **k):  # noqa: ANN001, ANN002, ANN003
            spy.codes.extend(parts)
            return spy.orig(builder, parts, *a, **k)
        self.builder.add_python_lambda_leaf_guard_to_root = add

    def take(self) -> list[str]:
        out, self.codes = self.codes, []
        return out


def compile_once(model: nn.Module, spy: Aliasing) -> tuple[float, list[str]]:
    """Reset Dynamo, compile ``model`` (eager backend, full graph) and call it once: CPU s, aliasing expressions."""
    torch._dynamo.reset()
    spy.take()
    t = time.thread_time()
    with torch.no_grad():
        torch.compile(model, backend="eager", fullgraph=True)(**PROBE)
    return time.thread_time() - t, spy.take()


def with_call(call: Callable, fn: Callable[[], float]) -> float:
    """``fn()`` with ``call`` as ``OpsGuard.__call__``."""
    from normswap.rotation.carry import OpsGuard

    saved = OpsGuard.__call__
    OpsGuard.__call__ = call
    try:
        return fn()
    finally:
        OpsGuard.__call__ = saved


def main(argv: list[str] | None = None) -> dict:
    from normswap.rotation.carry import OpsGuard

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds per compile cell")
    ap.add_argument("--eager-rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=200, help="eager calls per timing")
    ap.add_argument("--eager-only", action="store_true", help="the eager cells alone (merged into --json)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    branch = OpsGuard.__call__
    spy = Aliasing()
    results: dict = {"compile": {}, "eager": {}}
    if not args.eager_only:
        compile_once(build("tiny", "original"), spy)  # warm-up: Dynamo's and transformers' first-use costs
    print(f"{'model':8} {'variant':13} {'main CPU s':>10} {'branch CPU s':>12} {'ratio':>6} "
          f"{'aliasing main':>13} {'chars main':>10} {'ours main':>9} {'aliasing br.':>12} {'chars br.':>9} "
          f"{'ours br.':>8}")
    if args.eager_only and args.json and args.json.exists():
        results = json.loads(args.json.read_text()) | {"eager": {}}
    for size in [] if args.eager_only else args.sizes:
        for variant in ("original", "rotated", "rotated+LoRA"):
            model = build(size, variant)
            times: dict[str, list[float]] = {"main": [], "branch": []}
            codes: dict[str, list[str]] = {}
            ratios = []
            for _ in range(args.rounds):
                run = {}
                for name in ("main", "branch", "branch", "main"):
                    t, c = with_call(main_call if name == "main" else branch, lambda m=model: compile_once(m, spy))
                    run.setdefault(name, []).append(t)
                    codes[name] = c
                if variant == "original":  # no guard: the two are the same code, first and last of the round
                    ratios.append(run["main"][1] / run["main"][0])
                else:
                    ratios.append(sum(run["branch"]) / sum(run["main"]))
                for name in run:
                    times[name] += run[name]
            row = {"main_cpu_s": statistics.mean(times["main"]), "branch_cpu_s": statistics.mean(times["branch"]),
                   "ratio_median": statistics.median(ratios), "ratios": ratios}
            for name in ("main", "branch"):
                ours = [c for c in codes[name] if any(f".{a}[" in c for a in STATE)]
                row[f"aliasing_{name}"] = len(codes[name])
                row[f"chars_{name}"] = sum(map(len, codes[name]))
                row[f"ours_{name}"] = len(ours)
            label = "(A/A)" if variant == "original" else ""
            results["compile"][f"{size}/{variant}"] = row
            print(f"{size:8} {variant + label:13} {row['main_cpu_s']:10.2f} {row['branch_cpu_s']:12.2f} "
                  f"{row['ratio_median']:6.3f} {row['aliasing_main']:13d} {row['chars_main']:10d} "
                  f"{row['ours_main']:9d} {row['aliasing_branch']:12d} {row['chars_branch']:9d} "
                  f"{row['ours_branch']:8d}", flush=True)
    torch._dynamo.reset()

    model = build("tiny", "rotated")

    def eager() -> float:
        with torch.no_grad():
            model(**PROBE)
            t = time.thread_time()
            for _ in range(args.calls):
                model(**PROBE)
            return (time.thread_time() - t) / args.calls * 1e6

    (guard,) = [h for h in model._forward_pre_hooks.values() if isinstance(h, OpsGuard)]

    def alone() -> float:
        n = args.calls * 100
        t = time.thread_time()
        for _ in range(n):
            guard(model, ())
        return (time.thread_time() - t) / n * 1e6

    for cell, fn in (("forward", eager), ("guard alone", alone)):
        ratios, control, us = [], [], {"main": [], "branch": []}
        for _ in range(args.eager_rounds):
            a1 = with_call(main_call, fn)
            b1 = with_call(branch, fn)
            b2 = with_call(branch, fn)
            a2 = with_call(main_call, fn)
            ratios.append((b1 + b2) / (a1 + a2))
            control.append(a2 / a1)
            us["main"] += [a1, a2]
            us["branch"] += [b1, b2]
        e = results["eager"][cell] = {
            "main_us": statistics.median(us["main"]), "branch_us": statistics.median(us["branch"]),
            "ratio_median": statistics.median(ratios), "aa_median": statistics.median(control),
            "ratios": ratios, "aa": control}
        print(f"eager {cell:11} (rotated tiny, 8 tokens): main {e['main_us']:8.2f} us, branch {e['branch_us']:8.2f} "
              f"us per call; branch/main {e['ratio_median']:.3f} (A/A main/main {e['aa_median']:.3f}), "
              f"{args.eager_rounds} ABBA rounds")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
