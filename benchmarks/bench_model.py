"""Model-level benchmark: a converted model (``normswap.patch``) against its LayerNorm original.

Random init (no download), real conversions: each model is built, copied, and the copy converted with
``normswap.patch`` (exact, verified, beta folded where it can be); both then run the same work in
interleaved rounds (the order alternates per round) and the ratio is the median of per-round ratios.

    python benchmarks/bench_model.py                    # CPU: batch-1 greedy decode, GPT-2-small and
                                                        # Pythia-160M shapes, float32
    python benchmarks/bench_model.py --device cuda      # GPU: GPT-2-small and Pythia-410M shapes:
                                                        # decode, eager bf16-autocast train step,
                                                        # torch.compile train step
    python benchmarks/bench_model.py --device cuda --phases prefill,decode-compile

Phases (``--phases``, comma-separated):

* ``decode``: greedy decode at batch 1 (``generate``, KV cache, ``--new-tokens`` tokens after an
  8-token prompt), inference dtype ``--dtype`` (default float32 on CPU, bfloat16 on CUDA);
* ``decode-compile``: the same decode with a static KV cache, which makes ``generate`` compile the
  per-token forward (``torch.compile``, ``--compile-backend``; mode reduce-overhead with inductor,
  so CUDA graphs on a GPU); compiled once per model before timing;
* ``prefill``: one no-grad forward of a ``--prefill-seq``-token prompt at batch 1 (the step before
  decoding; logits of the last position only), inference dtype; measured, no target;
* ``train``: one eager training step (forward, backward, AdamW) in float32 weights under bf16 autocast
  on CUDA (float32 on CPU), batch ``--batch`` x ``--seq``;
* ``compile``: the same step with ``torch.compile(model)`` (compiled once per model before timing).

Targets (issue 10): converted/original <= 1.00 for decode (CPU and GPU), eager and compiled, <= 0.99
for the eager train step, <= 1.00 compiled. ``--check`` exits 1 when a measured ratio misses its target.
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

TARGETS: dict[str, float | None] = {"decode": 1.00, "decode-compile": 1.00, "prefill": None, "train": 0.99,
                                     "compile": 1.00}
MODELS = {
    # name: (family, layers, hidden, heads, intermediate)
    "gpt2-small": ("gpt2", 12, 768, 12, 3072),
    "pythia-160m": ("neox", 12, 768, 12, 3072),
    "pythia-410m": ("neox", 24, 1024, 16, 4096),
    "gpt2-tiny": ("gpt2", 2, 64, 4, 256),  # plumbing checks (tests), not a benchmark
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


def decode_fn(model: nn.Module, device: str, dtype: torch.dtype, new_tokens: int, compiled: bool = False,
              compile_backend: str = "inductor", compile_mode: str | None = "reduce-overhead") -> Callable[[], object]:
    """Greedy batch-1 decode of ``new_tokens`` after an 8-token prompt. ``compiled``: a static KV cache,
    with which ``generate`` compiles the per-token forward (on CPU too: the benchmark asks for it)."""
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0)).to(device)
    m = model.to(device=device, dtype=dtype)
    extra: dict = {}
    if compiled:
        from transformers import CompileConfig

        # inductor's reduce-overhead (CUDA graphs) is generate's own default; other backends take no mode
        config = CompileConfig(backend=compile_backend, mode=compile_mode if compile_backend == "inductor" else None)
        config._compile_all_devices = device != "cuda"  # generate compiles only on accelerators otherwise
        extra = {"cache_implementation": "static", "compile_config": config}

    def run() -> object:
        with torch.no_grad():
            return m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **extra)

    return run


def prefill_fn(model: nn.Module, device: str, dtype: torch.dtype, seq: int) -> Callable[[], object]:
    """One no-grad forward of a ``seq``-token prompt at batch 1, building the KV cache, last logits only
    (what ``generate`` does before its first token)."""
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(2)).to(device)
    m = model.to(device=device, dtype=dtype)

    def run() -> object:
        with torch.no_grad():
            return m(input_ids=ids, use_cache=True, logits_to_keep=1).logits

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
    ap.add_argument("--phases", default=None,
                    help=f"comma-separated from {','.join(TARGETS)} (default: decode on CPU, "
                    "decode,train,compile on CUDA)")
    ap.add_argument("--dtype", default=None, help="decode dtype (default float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-seq", type=int, default=512, help="prompt length of the prefill phase")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of decode-compile")
    ap.add_argument("--compile-mode", default="reduce-overhead",
                    help="torch.compile mode of decode-compile with inductor (reduce-overhead: CUDA graphs, "
                    "generate's default; 'default' without them)")
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
    unknown = [p for p in phases if p not in TARGETS] + [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"bench_model: unknown phase or model {unknown}; phases: {', '.join(TARGETS)}; "
                         f"models: {', '.join(MODELS)}")
    dtype = getattr(torch, args.dtype or ("float32" if device == "cpu" else "bfloat16"))
    report: dict = {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "clock": "thread CPU time" if args.cpu_time else "wall",
                    "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                    "rounds": args.rounds, "results": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_model_{device}.json")
    print(f"{'model':12} {'phase':14} {'original ms':>12} {'converted ms':>13} {'ratio':>7} {'target':>7}")
    misses = []
    for name in models:
        original = build_model(name)
        converted, summary = convert(original)
        for phase in phases:
            a, b = copy.deepcopy(original), copy.deepcopy(converted)
            if phase in ("decode", "decode-compile"):
                compiled = phase == "decode-compile"
                fns = {k: decode_fn(mod, device, dtype, args.new_tokens, compiled, args.compile_backend,
                                    args.compile_mode) for k, mod in (("original", a), ("converted", b))}
                what = {"dtype": str(dtype).replace("torch.", ""), "new_tokens": args.new_tokens, "batch": 1}
                if compiled:
                    what.update(compile_backend=args.compile_backend, compile_mode=args.compile_mode)
            elif phase == "prefill":
                fns = {k: prefill_fn(mod, device, dtype, args.prefill_seq) for k, mod in (("original", a),
                                                                                        ("converted", b))}
                what = {"dtype": str(dtype).replace("torch.", ""), "seq": args.prefill_seq, "batch": 1}
            else:
                compiled = phase == "compile"
                fns = {"original": train_fn(a, device, args.batch, args.seq, compiled),
                       "converted": train_fn(b, device, args.batch, args.seq, compiled)}
                what = {"batch": args.batch, "seq": args.seq,
                        "autocast": "bfloat16" if device == "cuda" else None}
            times = interleaved(fns, device, args.rounds, clock)
            ratio = statistics.median(c / o for c, o in zip(times["converted"], times["original"], strict=True))
            target = TARGETS[phase]
            row = {"model": name, "phase": phase, **what, **summary,
                   "original_ms": statistics.median(times["original"]) * 1e3,
                   "converted_ms": statistics.median(times["converted"]) * 1e3,
                   "ratio": ratio, "target": target, "ok": None if target is None else ratio <= target,
                   "samples_ms": {k: [t * 1e3 for t in v] for k, v in times.items()}}
            report["results"].append(row)
            with open(path, "w") as fh:  # after every row: a run cut short keeps what it measured
                json.dump(report, fh, indent=2)
            if row["ok"] is False:
                misses.append(f"{name} {phase}: {ratio:.3f} > {target:.2f}")
            verdict = "-" if target is None else "ok" if row["ok"] else "MISS"
            print(f"{name:12} {phase:14} {row['original_ms']:12.1f} {row['converted_ms']:13.1f} {ratio:7.3f} "
                  f"{'-' if target is None else '<=' + format(target, '.2f'):>7}  {verdict}", flush=True)
            del a, b, fns
    print(f"wrote {path}")
    if misses:
        print("missed: " + "; ".join(misses), file=sys.stderr)
    if args.check and misses:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
