"""Time and peak memory of normswap.plan and normswap.patch (analysis + surgery + verification).

GPT-2-small-shaped model (124M parameters, random init) on CPU, float32 by default. Run:

    python benchmarks/bench_patch.py [--layers 12] [--hidden 768] [--json out.json]
    python benchmarks/bench_patch.py --dtype float64 --peer --rounds 3   # side by side with TransformerLens

``--peer`` times TransformerLens's processing of the same model, built offline (saved to a temporary
directory, never downloaded): ``TransformerBridge.boot_transformers(dir, hf_model=model)`` plus
``enable_compatibility_mode()`` (its LayerNorm folding and weight centering), in rounds interleaved
with normswap's ``patch`` (analysis + surgery + verification, on a fresh copy each round; who goes
first alternates), and prints the per-round ratio, the median, the machine and the versions, and the
rounds as a markdown table. The machine may be shared, so compare ratios from one run, not absolute
times.

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


def _time_normswap(model: torch.nn.Module) -> float:
    import copy

    work = copy.deepcopy(model)
    t0 = time.perf_counter()
    normswap.patch(work)
    return time.perf_counter() - t0


def _time_transformer_lens(model: torch.nn.Module, folder: str, dtype: torch.dtype) -> float:
    from transformer_lens.model_bridge import TransformerBridge

    t0 = time.perf_counter()
    bridge = TransformerBridge.boot_transformers(folder, hf_model=model, dtype=dtype, device="cpu")
    bridge.enable_compatibility_mode()
    return time.perf_counter() - t0


def machine() -> dict:
    """Where and with what the timings were taken (the figures mean nothing without it)."""
    import os
    import sys
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0], "torch": torch.__version__, "transformers": tf.__version__,
        "transformer_lens": version("transformer-lens"), "normswap": version("normswap"),
    }


def peer(layers: int, hidden: int, heads: int, dtype: torch.dtype, rounds: int) -> dict:
    """normswap.patch vs TransformerLens processing on the same random GPT-2, interleaved rounds."""
    import copy
    import os
    import tempfile

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformer_lens  # noqa: F401
    except ImportError:
        return {"peer": "transformer_lens not installed"}
    before = machine()
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0)
    model = tf.GPT2LMHeadModel(config).eval().to(dtype)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        for r in range(rounds):
            order = ("normswap", "tl") if r % 2 == 0 else ("tl", "normswap")
            times = {}
            for who in order:
                if who == "normswap":
                    times[who] = _time_normswap(model)
                else:
                    times[who] = _time_transformer_lens(copy.deepcopy(model), folder, dtype)
            rows.append(times)
            print(f"round {r}: normswap.patch {times['normswap']:.2f} s  TransformerLens {times['tl']:.2f} s  "
                  f"ratio {times['normswap'] / times['tl']:.2f}", flush=True)
    ratios = sorted(t["normswap"] / t["tl"] for t in rows)
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return {"peer_rounds": rows, "median_ratio_normswap_over_tl": median, "max_ratio": ratios[-1],
            "machine": before, "load_average_after": machine()["load_average"]}


def markdown(result: dict) -> str:
    """The rounds as the table benchmarks/RESULTS.md records."""
    lines = ["| round | first | normswap.patch | TransformerLens | ratio |", "|---|---|---|---|---|"]
    for r, t in enumerate(result["peer_rounds"]):
        first = "normswap" if next(iter(t)) == "normswap" else "TransformerLens"
        lines.append(f"| {r} | {first} | {t['normswap']:.2f} s | {t['tl']:.2f} s | {t['normswap'] / t['tl']:.2f} |")
    median, worst = result["median_ratio_normswap_over_tl"], result["max_ratio"]
    lines.append(f"| median | | | | **{median:.2f}** (max {worst:.2f}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if "--peer" in sys.argv:
        cli = argparse.ArgumentParser(description="normswap.patch vs TransformerLens processing")
        cli.add_argument("--peer", action="store_true")
        cli.add_argument("--layers", type=int, default=12)
        cli.add_argument("--hidden", type=int, default=768)
        cli.add_argument("--heads", type=int, default=12)
        cli.add_argument("--dtype", default="float64")
        cli.add_argument("--rounds", type=int, default=3)
        cli.add_argument("--json", default=None)
        a = cli.parse_args()
        out = peer(a.layers, a.hidden, a.heads, getattr(torch, a.dtype), a.rounds)
        print(out)
        if "peer_rounds" in out:
            print(markdown(out))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=2)
    else:
        main()
