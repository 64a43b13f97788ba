"""Where one ``normswap.patch`` spends its time: cProfile buckets on a float64 GPT-2-124M.

    python benchmarks/profile_patch.py [--threads 1] [--runs 3] [--layers 12]

Each run is a fresh process-local model copy, profiled after one warm-up ``patch`` (one-time imports
and allocations excluded). Prints one JSON line per run and the per-bucket medians. ``--threads 1``
keeps a shared machine's other jobs out of the figures (with two threads on a loaded 2-core machine
every small op of a forward pass waits for the busy core, and forward passes dominate the noise).
To profile another version of normswap, put its tree first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import pstats
import statistics
import time

import torch
import transformers as tf

import normswap

# (file suffix, function name): cumulative seconds of each bucket; the forward pass is found below
BUCKETS = {
    "trace.record": ("normswap/analysis/trace.py", "record"),
    "preflight": ("normswap/pipeline.py", "preflight"),
    "working_copy": ("normswap/pipeline.py", "working_copy"),
    "own_written": ("normswap/pipeline.py", "own_written"),
    "apply_weight_edits": ("normswap/surgery/edits.py", "apply_weight_edits"),
    "untie": ("normswap/surgery/edits.py", "untie"),
    "compare": ("normswap/surgery/verify.py", "compare"),
    "_commit": ("normswap/pipeline.py", "_commit"),
}


def profile_once(model: torch.nn.Module) -> dict[str, float]:
    work = copy.deepcopy(model)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    normswap.patch(work)
    prof.disable()
    total = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]

    def cumulative(file: str, name: str) -> float:
        return sum(v[3] for k, v in stats.items() if k[0].endswith(file) and k[2] == name)

    forwards = [k for k in stats if k[0].endswith("modeling_gpt2.py") and k[2] == "forward"]
    top = max(forwards, key=lambda k: stats[k][3])  # GPT2LMHeadModel.forward: whole forward passes
    clones = sum(v[3] for k, v in stats.items() if "clone" in k[2] and "TensorBase" in k[2])
    out = {"total": total, "forward_passes": stats[top][3], "n_forward_passes": stats[top][1]}
    out.update({name: cumulative(*where) for name, where in BUCKETS.items()})
    out["tensor_clones"] = clones
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=args.layers, n_embd=768, n_head=12, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0)
    model = tf.GPT2LMHeadModel(config).eval().to(torch.float64)
    normswap.patch(copy.deepcopy(model))  # warm-up
    runs = []
    for _ in range(args.runs):
        runs.append(profile_once(model))
        print(json.dumps({k: round(v, 3) for k, v in runs[-1].items()}), flush=True)
    print(f"normswap at {normswap.__file__}, torch threads {torch.get_num_threads()}; medians over {args.runs}:")
    for key in runs[0]:
        print(f"  {key:22s} {statistics.median(r[key] for r in runs):8.2f}")


if __name__ == "__main__":
    main()
