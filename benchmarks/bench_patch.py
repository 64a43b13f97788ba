"""Time and peak memory of normswap.plan and normswap.patch (analysis + surgery + verification).

GPT-2-small-shaped model (124M parameters, random init) on CPU, float32. Run:

    python benchmarks/bench_patch.py [--layers 12] [--hidden 768] [--json out.json]

Peak memory is the process's max RSS (``resource.getrusage``) after each phase, minus the RSS
before the model was built, so it counts the float64 working copy that makes patch transactional.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time

import torch
import transformers as tf

import normswap


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    base = rss_mb()
    config = tf.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, bos_token_id=0,
                           eos_token_id=0, pad_token_id=0)
    model = tf.GPT2LMHeadModel(config).eval()
    params = sum(p.numel() for p in model.parameters())
    built = rss_mb()
    t0 = time.perf_counter()
    plan = normswap.plan(model)
    t_plan = time.perf_counter() - t0
    rss_plan = rss_mb()
    t0 = time.perf_counter()
    report = normswap.patch(model)
    t_patch = time.perf_counter() - t0
    rss_patch = rss_mb()
    result = {
        "model": f"gpt2 {args.layers}x{args.hidden} ({params / 1e6:.1f}M params, fp32)",
        "plan_s": round(t_plan, 2),
        "patch_s (analysis+surgery+verify)": round(t_patch, 2),
        "model_mb": round(built - base),
        "peak_rss_over_model_mb": round(max(rss_plan, rss_patch) - built),
        "verdicts": plan.counts(),
        "max_rel_error_fp64": report.verification["max_rel_error"],
        "max_rel_error_fp32": report.verification.get("in_model_dtype"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
    }
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k.ljust(width)}  {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
