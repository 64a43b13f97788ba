"""What holding a model's downcasts (``normswap.analysis.precision.HoldCasts``) costs.

    python benchmarks/bench_hold_casts.py [--threads 1] [--runs 7] [--layers 12] [--seq 64]

On a GPT-2-small-shaped model (random init, float64, the working copy ``patch`` analyses), the median
wall time of:

* the traced analysis run (``trace.record``) without and with the hold mode stacked on the recorder
  (``patch`` always holds in this run; GPT-2 casts nothing down, so nothing is rewritten);
* a plain forward without and with the hold mode (``patch`` holds in the later forwards only when the
  traced run held a cast, so GPT-2's verification forwards do not pay this);
* the mode's own cost per torch call, on a loop of tiny ops (where nothing but the dispatch costs), and
  the number of torch calls one forward makes: their product is the added time per forward, which on a
  loaded shared machine is below the noise of the whole-forward timings.

Prints one JSON object. ``--threads 1`` keeps a shared machine's other jobs out of the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers as tf
from torch.overrides import TorchFunctionMode

from normswap import pipeline
from normswap.analysis import precision, trace, walker


def median_time(fn, runs: int) -> float:  # noqa: ANN001
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Count(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.calls += 1
        return func(*args, **(kwargs or {}))


def per_call_us(runs: int, calls: int = 20000) -> tuple[float, float]:
    """Microseconds per tiny op (``a + b`` on 4-element tensors), without and with the hold mode."""
    a, b = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)

    def loop() -> None:
        for _ in range(calls):
            a.add(b)

    def held() -> None:
        with precision.holding(torch.float64):
            loop()

    return median_time(loop, runs) / calls * 1e6, median_time(held, runs) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=args.layers, n_embd=768, n_head=12, vocab_size=50257)
    model = tf.GPT2LMHeadModel(config).double().eval()
    ids = torch.randint(0, config.vocab_size, (2, args.seq))
    snapshot = walker.candidates(model)

    def record(hold: bool) -> trace.Graph:
        with pipeline.default_dtype(torch.float64):
            return trace.record(model, (), {"input_ids": ids}, snapshot=snapshot,
                                hold=precision.HoldCasts(torch.float64) if hold else None)

    def forward(hold: bool) -> None:
        with torch.no_grad(), pipeline.running(torch.float64, hold):
            model(input_ids=ids)

    graph = record(True)
    with torch.no_grad(), pipeline.default_dtype(torch.float64), _Count() as counter:
        model(input_ids=ids)
    plain_us, held_us = per_call_us(args.runs)
    result = {
        "model": f"gpt2 {args.layers}x768, float64, batch 2 x {args.seq} tokens",
        "ops_recorded": len(graph.ops),
        "torch_calls_per_forward": counter.calls,
        "us_per_call": plain_us,
        "us_per_call_hold": held_us,
        "hold_ms_per_forward": (held_us - plain_us) * counter.calls / 1e3,
        "casts_held": dict(graph.held_casts),
        "trace_s": median_time(lambda: record(False), args.runs),
        "trace_hold_s": median_time(lambda: record(True), args.runs),
        "forward_s": median_time(lambda: forward(False), args.runs),
        "forward_hold_s": median_time(lambda: forward(True), args.runs),
        "threads": args.threads,
        "torch": torch.__version__,
    }
    result["trace_overhead"] = result["trace_hold_s"] / result["trace_s"] - 1
    result["forward_overhead"] = result["forward_hold_s"] / result["forward_s"] - 1
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
