"""Model-level benchmark: a GPT-2-small-shaped model with LayerNorm vs the same model with RMSNorm.

Random init (no download): 12 layers, 768 hidden, 12 heads, 50257 vocabulary. The RMSNorm variants
swap every ``nn.LayerNorm`` for a ``normswap.RMSNorm`` of the same shape (``backend="auto"``), once
with weight only (a converted norm whose beta folded into the next Linear) and once with weight and
bias (beta kept). This measures speed only: the swap is not a conversion (normswap.patch does that).

    python benchmarks/bench_model.py                       # CPU, float32 and bfloat16 inference
    python benchmarks/bench_model.py --device cuda --batch 8 --seq 1024

Reports forward latency (no grad), one training step (forward, backward, AdamW) in float32, and the
norms' own share (all 25 norms of the model run alone at the model's activation shape). Variants are
timed in interleaved rounds; the ratio columns are medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
from torch import nn

import normswap


def build_model(dtype: torch.dtype, device: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
    return GPT2LMHeadModel(config).to(device=device, dtype=dtype).eval()


def swap_layernorms(model: nn.Module, *, bias: bool) -> int:
    """Replace every nn.LayerNorm by normswap.RMSNorm with the same shape, eps, weight (and bias)."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    for name, ln in targets:
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        rms = normswap.RMSNorm(ln.normalized_shape, eps=ln.eps, bias=bias and ln.bias is not None,
                               device=ln.weight.device, dtype=ln.weight.dtype)
        with torch.no_grad():
            rms.weight.copy_(ln.weight)
            if rms.bias is not None:
                rms.bias.copy_(ln.bias)
        setattr(parent, name.rsplit(".", 1)[-1], rms)
    return len(targets)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def interleaved(fns: dict, device: str, rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    for f in fns.values():
        for _ in range(warmup):
            f()
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            out[k].append(timed(f, device))
    return out


def summarize(times: dict[str, list[float]], base: str = "layernorm") -> list[dict]:
    rows = []
    for k, ts in times.items():
        ratio = statistics.median(a / b for a, b in zip(ts, times[base], strict=True))
        rows.append({"variant": k, "median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3,
                     "vs_layernorm": ratio})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", action="append", help="inference dtypes (default float32, bfloat16)")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "out", "benchmarks"))
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    device = args.device
    report: dict = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "batch": args.batch, "seq": args.seq, "rounds": args.rounds, "results": []}
    ids = torch.randint(0, 50257, (args.batch, args.seq), device=device)

    for dtype_name in args.dtype or ["float32", "bfloat16"]:
        dtype = getattr(torch, dtype_name)
        base = build_model(dtype, device)
        variants = {"layernorm": base}
        for name, bias in (("rmsnorm", False), ("rmsnorm+bias", True)):
            m = copy.deepcopy(base)
            n_swapped = swap_layernorms(m, bias=bias)
            variants[name] = m
        report["norms_per_model"] = n_swapped
        backend = normswap.backends.select(torch.empty(1, 768, dtype=dtype, device=device),
                                           torch.empty(768, dtype=dtype, device=device), None).name
        with torch.no_grad():
            fwd = {k: (lambda m=m: m(ids).logits) for k, m in variants.items()}
            rows = summarize(interleaved(fwd, device, args.rounds))
            # The norms alone: every norm of each model, at the model's activation shape.
            h = torch.randn(args.batch * args.seq, 768, device=device, dtype=dtype)
            norms = {k: [mod for mod in m.modules() if isinstance(mod, (nn.LayerNorm, normswap.RMSNorm))]
                     for k, m in variants.items()}
            only = {k: (lambda ms=ms, h=h: [mod(h) for mod in ms]) for k, ms in norms.items()}
            norm_rows = summarize(interleaved(only, device, args.rounds * 3))
        for r, nr in zip(rows, norm_rows, strict=True):
            r.update({"phase": "forward", "dtype": dtype_name, "backend": backend,
                      "norms_only_ms": nr["median_ms"], "norms_only_vs_layernorm": nr["vs_layernorm"]})
        report["results"].extend(rows)
        del variants, base

    if not args.no_train:
        base = build_model(torch.float32, device).train()
        variants = {"layernorm": base}
        for name, bias in (("rmsnorm", False), ("rmsnorm+bias", True)):
            m = copy.deepcopy(base)
            swap_layernorms(m, bias=bias)
            variants[name] = m
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in variants.items()}

        def step(k: str) -> None:
            m, opt = variants[k], opts[k]
            loss = m(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        rows = summarize(interleaved({k: (lambda k=k: step(k)) for k in variants}, device, args.rounds))
        for r in rows:
            r.update({"phase": "train step", "dtype": "float32"})
        report["results"].extend(rows)

    print(f"{'phase':11} {'dtype':9} {'variant':13} {'median ms':>10} {'x layernorm':>12} "
          f"{'norms only ms':>14} {'norms x LN':>11}")
    for r in report["results"]:
        extra = (f"{r['norms_only_ms']:14.2f} {r['norms_only_vs_layernorm']:11.2f}"
                 if "norms_only_ms" in r else "")
        print(f"{r['phase']:11} {r['dtype']:9} {r['variant']:13} {r['median_ms']:10.1f} "
              f"{r['vs_layernorm']:12.3f} {extra}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_model_{device}.json")
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
