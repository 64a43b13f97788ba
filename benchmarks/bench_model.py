"""Model-level benchmark: a converted model (``normswap.patch``) against its LayerNorm original.

Random init (no download), real conversions: each model is built, copied, and the copy converted with
``normswap.patch`` (exact, verified, beta folded where it can be); both then run the same work in
interleaved rounds (the order alternates per round) and the ratio is the median of per-round ratios.

    python benchmarks/bench_model.py                    # CPU: batch-1 greedy decode, GPT-2-small and
                                                        # Pythia-160M shapes, float32
    python benchmarks/bench_model.py --device cuda      # GPU: GPT-2-small and Pythia-410M shapes:
                                                        # decode, eager bf16-autocast train step,
                                                        # torch.compile train step

Phases (``--phases``, comma-separated):

* ``decode``: greedy decode at batch 1 (``generate``, KV cache, ``--new-tokens`` tokens after an
  8-token prompt), inference dtype ``--dtype`` (default float32 on CPU, bfloat16 on CUDA);
* ``train``: one eager training step (forward, backward, AdamW) in float32 weights under bf16 autocast
  on CUDA (float32 on CPU), batch ``--batch`` x ``--seq``;
* ``compile``: the same step with ``torch.compile(model)`` (compiled once per model before timing).

Targets (issue 10): converted/original <= 1.00 for decode (CPU and GPU), <= 0.99 for the eager train
step, <= 1.00 compiled. ``--check`` exits 1 when a measured ratio misses its target.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

import normswap

TARGETS = {"decode": 1.00, "train": 0.99, "compile": 1.00}
MODELS = {
    # name: (family, layers, hidden, heads, intermediate)
    "gpt2-small": ("gpt2", 12, 768, 12, 3072),
    "pythia-160m": ("neox", 12, 768, 12, 3072),
    "pythia-410m": ("neox", 24, 1024, 16, 4096),
}
VOCAB = 50304


def build_model(name: str) -> nn.Module:
    """A randomly initialised float32 model with the named model's shapes (seeded)."""
    family, layers, hidden, heads, inter = MODELS[name]
    torch.manual_seed(0)
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_inner=inter, vocab_size=VOCAB,
                         n_positions=2048)
        model = GPT2LMHeadModel(cfg)
    else:
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        cfg = GPTNeoXConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            intermediate_size=inter, vocab_size=VOCAB, rotary_pct=0.25,
                            max_position_embeddings=2048, use_parallel_residual=True)
        model = GPTNeoXForCausalLM(cfg)
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 0
    return model.eval()


def convert(model: nn.Module) -> tuple[nn.Module, dict]:
    """A converted copy (``normswap.patch`` on CPU in float32, verified) and a summary of the report."""
    converted = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(converted)
    verdicts: dict[str, int] = {}
    for site in report.sites:
        verdicts[site.verdict] = verdicts.get(site.verdict, 0) + 1
    backends_used = sorted({m.backend for m in converted.modules() if isinstance(m, normswap.RMSNorm)})
    return converted, {"verdicts": verdicts, "max_abs_error": report.verification.get("max_abs_error"),
                       "module_backend": backends_used}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved(fns: dict[str, Callable[[], object]], device: str, rounds: int,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per call of each function, one call each per round, order alternating per round."""
    for f in fns.values():  # warm-up (and compilation, for compiled steps)
        f()
        f()
    keys = list(fns)
    out: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys if r % 2 == 0 else reversed(keys):
            _sync(device)
            t0 = clock()
            fns[k]()
            _sync(device)
            out[k].append(clock() - t0)
    return out


def decode_fn(model: nn.Module, device: str, dtype: torch.dtype, new_tokens: int) -> Callable[[], object]:
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0)).to(device)
    m = model.to(device=device, dtype=dtype)

    def run() -> object:
        with torch.no_grad():
            return m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    return run


def train_fn(model: nn.Module, device: str, batch: int, seq: int, compiled: bool) -> Callable[[], object]:
    m = model.to(device=device, dtype=torch.float32).train()
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    fwd = torch.compile(m) if compiled else m
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast(
        "cpu", enabled=False)

    def step() -> object:
        with autocast:
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--models", default=None,
                    help="comma-separated from " + ", ".join(MODELS) +
                    " (default: gpt2-small,pythia-160m on CPU; gpt2-small,pythia-410m on CUDA)")
    ap.add_argument("--phases", default=None, help="decode,train,compile (default: decode on CPU, all on CUDA)")
    ap.add_argument("--dtype", default=None, help="decode dtype (default float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="CPU: time with the thread's CPU clock (with --threads 1): robust on a shared machine")
    ap.add_argument("--check", action="store_true", help="exit 1 if a ratio misses its target")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "out", "benchmarks"))
    args = ap.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time and (device != "cpu" or torch.get_num_threads() != 1):
        raise SystemExit("--cpu-time measures one thread's CPU time: use it on CPU with --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    models = (args.models or ("gpt2-small,pythia-160m" if device == "cpu" else "gpt2-small,pythia-410m")).split(",")
    phases = (args.phases or ("decode" if device == "cpu" else "decode,train,compile")).split(",")
    dtype = getattr(torch, args.dtype or ("float32" if device == "cpu" else "bfloat16"))
    report: dict = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "clock": "thread CPU time" if args.cpu_time else "wall",
                    "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                    "rounds": args.rounds, "results": []}
    print(f"{'model':12} {'phase':8} {'original ms':>12} {'converted ms':>13} {'ratio':>7} {'target':>7}")
    misses = []
    for name in models:
        original = build_model(name)
        converted, summary = convert(original)
        for phase in phases:
            a, b = copy.deepcopy(original), copy.deepcopy(converted)
            if phase == "decode":
                fns = {"original": decode_fn(a, device, dtype, args.new_tokens),
                       "converted": decode_fn(b, device, dtype, args.new_tokens)}
                what = {"dtype": str(dtype).replace("torch.", ""), "new_tokens": args.new_tokens, "batch": 1}
            else:
                compiled = phase == "compile"
                fns = {"original": train_fn(a, device, args.batch, args.seq, compiled),
                       "converted": train_fn(b, device, args.batch, args.seq, compiled)}
                what = {"batch": args.batch, "seq": args.seq,
                        "autocast": "bfloat16" if device == "cuda" else None}
            times = interleaved(fns, device, args.rounds, clock)
            ratio = statistics.median(c / o for c, o in zip(times["converted"], times["original"], strict=True))
            row = {"model": name, "phase": phase, **what, **summary,
                   "original_ms": statistics.median(times["original"]) * 1e3,
                   "converted_ms": statistics.median(times["converted"]) * 1e3,
                   "ratio": ratio, "target": TARGETS[phase], "ok": ratio <= TARGETS[phase],
                   "samples_ms": {k: [t * 1e3 for t in v] for k, v in times.items()}}
            report["results"].append(row)
            if not row["ok"]:
                misses.append(f"{name} {phase}: {ratio:.3f} > {TARGETS[phase]:.2f}")
            print(f"{name:12} {phase:8} {row['original_ms']:12.1f} {row['converted_ms']:13.1f} {ratio:7.3f} "
                  f"{'<=' + format(TARGETS[phase], '.2f'):>7}  {'ok' if row['ok'] else 'MISS'}", flush=True)
            del a, b, fns
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_model_{device}.json")
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"wrote {path}")
    if misses:
        print("missed: " + "; ".join(misses), file=sys.stderr)
    if args.check and misses:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
