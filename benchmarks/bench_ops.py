"""RMSNorm op benchmark: every backend vs torch layer_norm / rms_norm / copy (and compile, Liger).

Thin script over :mod:`normswap.backends.bench`, which ``normswap bench`` also uses.

    python benchmarks/bench_ops.py                  # CPU: float32 + bfloat16, fwd and fwd+bwd
    python benchmarks/bench_ops.py --device cuda    # the GPU suite (adds float16 and larger shapes),
                                                    # then eager / GPU-only (graph replay) / host per shape
    python benchmarks/bench_ops.py --no-compile --shapes 4096x768 --dtype bfloat16
    python benchmarks/bench_ops.py --host --threads 1 --cpu-time   # host cost: RMSNorm module vs nn.LayerNorm
    python benchmarks/bench_ops.py --host --device cuda

Writes a table to stdout, and JSON plus a PNG plot to ``--out`` (default ``out/benchmarks/``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch

from normswap.backends import bench

GPU_SHAPES = "4096x768,2048x4096,256x2048,4096x4096,16384x4096,32768x4096,4096x8192,140x4096"


def host_cost(device: str, dtypes: list[str], rounds: int = 15, rows: int = 4, n: int = 1024,
              clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """Per-call time of module calls on a (rows, n) tensor, where the kernels' own work is ~1 us, so the
    figure is host time: ``normswap.RMSNorm`` (auto) against ``nn.LayerNorm`` (same bias setting),
    without gradients (forward) and with them (forward + backward via ``autograd.backward``).

    Interleaved rounds (every method once per round, each a block of back-to-back calls); the ratio is
    the median of the per-round ratios, so a slow phase of a shared machine slows both sides.
    """
    import statistics

    from torch import nn

    import normswap

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cpu":  # grad-mode calls use the C++ autograd operator once it is built: wait for it
        from normswap.backends import cpu

        cpu.autograd_op(wait=True)
        print(f"cpu grad-mode path: {cpu.op_reason()}")
    rows_out = []
    print(f"host cost per module call, {rows}x{n} on {device} (median over {rounds} interleaved rounds; "
          "ratio = median of per-round ratios)")
    print(f"{'dtype':9} {'bias':5} {'pass':8} {'LayerNorm us':>12} {'RMSNorm us':>11} {'ratio':>6}")
    for dname in dtypes:
        dtype = bench.parse_dtype(dname)
        for bias in (False, True):
            ln = torch.nn.LayerNorm(n, bias=bias, device=device, dtype=dtype)
            rms = normswap.RMSNorm(n, bias=bias, device=device, dtype=dtype)
            for grad in (False, True):
                x = torch.randn(rows, n, device=device, dtype=dtype, requires_grad=grad)
                gy = torch.randn(rows, n, device=device, dtype=dtype)

                def call(m: nn.Module, x: torch.Tensor = x, gy: torch.Tensor = gy, grad: bool = grad) -> None:
                    if grad:
                        m(x).backward(gy)
                    else:
                        with torch.no_grad():
                            m(x)

                reps = 200 if grad else 1000
                times: dict[str, list[float]] = {"ln": [], "rms": []}
                for m in (ln, rms):
                    for _ in range(reps // 4):
                        call(m)
                for _ in range(rounds):
                    for key, m in (("ln", ln), ("rms", rms)):
                        sync()
                        t0 = clock()
                        for _ in range(reps):
                            call(m)
                        sync()
                        times[key].append((clock() - t0) / reps * 1e6)
                ratio = statistics.median(a / b for a, b in zip(times["rms"], times["ln"], strict=True))
                row = {"device": device, "dtype": dname, "bias": bias, "pass": "fwd+bwd" if grad else "fwd",
                       "layer_norm_us": statistics.median(times["ln"]), "rms_norm_us": statistics.median(times["rms"]),
                       "ratio": ratio}
                rows_out.append(row)
                print(f"{dname:9} {str(bias):5} {row['pass']:8} {row['layer_norm_us']:12.2f} "
                      f"{row['rms_norm_us']:11.2f} {ratio:6.3f}", flush=True)
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", action="append",
                    help="repeatable (default: float32, bfloat16; +float16 on cuda)")
    ap.add_argument("--shapes", default=None, help="comma-separated ROWSxN (default: the issue's shapes)")
    ap.add_argument("--pass", dest="passes", action="append", choices=list(bench.PASSES))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--target-ms", type=float, default=5.0, help="length of one timing block")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow to build on CPU)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time with the thread's CPU clock (needs --threads 1): robust on a busy machine")
    ap.add_argument("--host", action="store_true",
                    help="host cost per module call (normswap.RMSNorm vs nn.LayerNorm) on a small tensor")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "out", "benchmarks"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.host:
        if args.cpu_time and (args.device != "cpu" or torch.get_num_threads() != 1):
            raise SystemExit("--cpu-time measures one thread's CPU time: use it on CPU with --threads 1")
        host_cost(args.device, args.dtype or ["float32", "bfloat16", "float16"], rounds=args.rounds,
                  clock=time.thread_time if args.cpu_time else time.perf_counter)
        return

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    default_dtypes = ["float32", "bfloat16"] + (["float16"] if args.device == "cuda" else [])
    dtypes = args.dtype or default_dtypes
    shapes = args.shapes or (GPU_SHAPES if args.device == "cuda" else "4096x768,2048x4096,256x2048")
    records = bench.run(
        args.device, [bench.parse_dtype(d) for d in dtypes], bench.parse_shapes(shapes),
        args.passes or ["fwd", "fwd+bwd"], rounds=args.rounds, target_ms=args.target_ms,
        compile_=not args.no_compile, clock="thread" if args.cpu_time else "wall",
    )
    env = bench.environment(args.device)
    env["clock"] = "thread CPU time" if args.cpu_time else "wall"
    print(json.dumps(env))
    print(bench.table(records))
    extra: dict = {}
    if args.device == "cuda":  # the other two clocks: GPU-only (graph replay, L2 rotated) and host per call
        import gpu_targets

        graph_rows = []
        for pass_ in args.passes or ["fwd", "fwd+bwd"]:
            for dname in dtypes:
                for rows, n in bench.parse_shapes(shapes):
                    graph_rows += gpu_targets.graph_methods(rows, n, bench.parse_dtype(dname),
                                                            "fwd+bwd" if pass_ != "fwd" else "fwd")
        extra["graph"] = graph_rows
        extra["eager"] = [r for r in bench.to_json(records, {})["results"] if r["dtype"] == "bfloat16"]
        x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
        import normswap

        with torch.no_grad():
            extra["host_ops_us"] = {
                "F.rms_norm": gpu_targets.host_per_call_us(lambda: torch.nn.functional.rms_norm(x, (1024,), w)),
                "normswap.rms_norm": gpu_targets.host_per_call_us(lambda: normswap.rms_norm(x, 1024, w)),
                "triton backend": gpu_targets.host_per_call_us(
                    lambda: normswap.backends.triton_backend.rms_norm(x, (1024,), w, None, 1e-6)),
            }
        print(gpu_targets.clocks_table(extra))
    os.makedirs(args.out, exist_ok=True)
    tag = f"{args.device}_{torch.get_num_threads()}t" + ("_cputime" if args.cpu_time else "")
    path = os.path.join(args.out, f"bench_ops_{tag}.json")
    with open(path, "w") as fh:
        json.dump({**bench.to_json(records, env), **{k: v for k, v in extra.items() if k != "eager"}}, fh,
                  indent=2)
    print(f"wrote {path}")
    png = path.replace(".json", ".png")
    if bench.plot(records, png):
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
