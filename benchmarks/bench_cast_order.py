"""Before/after of a change to the RMSNorm backends, in one process: old and new code side by side.

The one-rounding change (LayerNorm cast order) touched the ``eager`` and ``native`` math and the C++
kernel. Comparing two separate benchmark runs on a shared machine mixes the change with the load of
the moment, so this script loads the *old* versions from a git revision next to the current ones and
times each old/new pair back to back in interleaved rounds; the reported figure is the median over
rounds of new time / old time (below 1: the new code is faster).

* ``cpu``: the old ``csrc/rmsnorm.cpp`` is compiled (cached like the current one, keyed by its hash)
  and both kernels are called through the same launcher; forward, and forward+backward through the
  backward kernel (whose argument list gained a flags word, so each kernel gets its own).
* ``eager`` / ``native``: the old modules' source is executed as a module of its own.

    python benchmarks/bench_cast_order.py --before 905b0a5 --threads 1 --cpu-time
    python benchmarks/bench_cast_order.py --before 905b0a5 --threads 2 --pass fwd --rounds 11
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from normswap.backends import cpu, cpu_build, eager, native  # noqa: E402
from normswap.backends.cpu_build import DTYPE_CODES  # noqa: E402

EPS = 1e-6
SHAPES = ((4096, 768), (2048, 4096), (256, 2048))


def git_show(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout


def old_module(rev: str, path: str, name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    exec(compile(git_show(rev, path), f"{rev}:{path}", "exec"), mod.__dict__)  # noqa: S102 - our own history
    return mod


def old_kernel(rev: str) -> cpu_build.Kernel:
    source, saved = git_show(rev, "normswap/backends/csrc/rmsnorm.cpp"), cpu_build.SOURCE
    cpu_build.SOURCE = source
    try:
        k = cpu_build.build(lambda k: None)
    finally:
        cpu_build.SOURCE = saved
    if k.fn is None:
        raise SystemExit(f"old kernel did not build: {k.reason}")
    return k


def kernel_fwd_bwd(k: cpu_build.Kernel, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                   dy: torch.Tensor, flags_arg: bool) -> Callable[[], object]:
    """Forward with rstd, then the backward kernel (dx and fp32 dW/dB partials): what a training step
    runs per norm, minus the autograd bookkeeping (identical for both kernels)."""
    m, n = x.shape
    threads = torch.get_num_threads() if x.numel() >= (1 << 15) else 1
    dw = torch.empty((threads, 1, n), dtype=torch.float32)
    db = torch.empty((threads, 1, n), dtype=torch.float32) if b is not None else None
    dx = torch.empty_like(x)
    code = DTYPE_CODES[x.dtype]

    def step() -> object:
        y, rstd = cpu._run(k, x, (n,), w, b, EPS, want_rstd=True, pooled=True)
        args = [code, x.data_ptr(), dy.data_ptr(), m, n, n, n, w.data_ptr(), 1, rstd.data_ptr(), dx.data_ptr(),
                dw.data_ptr(), db.data_ptr() if db is not None else None, threads]
        if flags_arg:
            args.append(0)
        k.bwd(*args)
        return y

    return step


def method_pairs(pass_: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dy: torch.Tensor,
                 mods: dict[str, tuple[types.ModuleType, types.ModuleType]],
                 kernels: tuple[cpu_build.Kernel, cpu_build.Kernel]) -> dict[str, tuple[Callable, Callable]]:
    """``{backend: (old call, new call)}`` for one shape, dtype and parameter set."""
    n = x.shape[-1]
    k_old, k_new = kernels
    if pass_ == "fwd":
        pairs = {"cpu": tuple((lambda k=k: cpu._run(k, x, (n,), w, b, EPS, want_rstd=False, pooled=True))
                              for k in kernels)}
        for name, pair in mods.items():
            pairs[name] = tuple((lambda m=m: m.rms_norm(x, (n,), w, b, EPS)) for m in pair)
        return pairs
    pairs = {"cpu": (kernel_fwd_bwd(k_old, x, w, b, dy, False), kernel_fwd_bwd(k_new, x, w, b, dy, True))}
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    bg = b.clone().requires_grad_(True) if b is not None else None
    params = (xg, wg) if bg is None else (xg, wg, bg)
    for name, pair in mods.items():
        pairs[name] = tuple((lambda m=m: torch.autograd.grad(m.rms_norm(xg, (n,), wg, bg, EPS), params, dy))
                            for m in pair)
    return pairs


def time_block(fn: Callable[[], object], reps: int, clock: Callable[[], float]) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < 0.01:  # untimed warm-up, as normswap.backends.bench does
        fn()
    t0 = clock()
    for _ in range(reps):
        fn()
    return (clock() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="git revision holding the old code")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--pass", dest="passes", action="append", choices=["fwd", "fwd+bwd"])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--dtype", action="append", help="default: float32, bfloat16, float16")
    ap.add_argument("--shapes", default=None, help="comma-separated ROWSxN")
    ap.add_argument("--cpu-time", action="store_true", help="thread CPU time (needs --threads 1)")
    ap.add_argument("--target-ms", type=float, default=5.0)
    ap.add_argument("--backend", action="append", choices=["cpu", "eager", "native"], help="default: all three")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time and torch.get_num_threads() != 1:
        raise SystemExit("--cpu-time needs --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    shapes = SHAPES if args.shapes is None else tuple(
        tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
    dtypes = [getattr(torch, d) for d in (args.dtype or ["float32", "bfloat16", "float16"])]
    old_eager = old_module(args.before, "normswap/backends/eager.py", "old_eager")
    old_native = old_module(args.before, "normswap/backends/native.py", "old_native")
    k_new, k_old = cpu.kernel(), old_kernel(args.before)
    mods = {"eager": (old_eager, eager), "native": (old_native, native)}
    kernels = (k_old, k_new)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), clock "
          f"{'thread CPU time' if args.cpu_time else 'wall'}, {args.rounds} rounds; new kernel ISA {k_new.isa}, "
          f"old {k_old.isa}; figure = median over rounds of new/old time")
    print(f"{'pass':8} {'dtype':9} {'shape':10} {'params':6} {'backend':7} {'old us':>9} {'new us':>9} {'new/old':>8}")
    gen = torch.Generator().manual_seed(0)
    for pass_ in args.passes or ["fwd", "fwd+bwd"]:
        for dtype in dtypes:
            for rows, n in shapes:
                x = torch.randn(rows, n, generator=gen).to(dtype)
                w = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
                bias = (0.1 * torch.randn(n, generator=gen)).to(dtype)
                dy = torch.randn(rows, n, generator=gen).to(dtype)
                for b in (None, bias):
                    pairs = method_pairs(pass_, x, w, b, dy, mods, kernels)
                    for name, (old_fn, new_fn) in pairs.items():
                        if args.backend and name not in args.backend:
                            continue
                        ctx = torch.no_grad() if pass_ == "fwd" else torch.enable_grad()
                        with ctx:
                            for f in (old_fn, new_fn):
                                f()
                            one = max(time_block(old_fn, 1, time.perf_counter), 1e-7)
                            reps = int(min(max(args.target_ms / 1e3 / one, 2), 2000))
                            t_old, t_new = [], []
                            for r in range(args.rounds):  # alternate which goes first
                                order = ((old_fn, t_old), (new_fn, t_new)) if r % 2 == 0 else \
                                    ((new_fn, t_new), (old_fn, t_old))
                                for f, out in order:
                                    out.append(time_block(f, reps, clock))
                        ratio = statistics.median(a / c for a, c in zip(t_new, t_old, strict=True))
                        label = "w+b" if b is not None else "w"
                        print(f"{pass_:8} {str(dtype)[6:]:9} {f'{rows}x{n}':10} {label:6} {name:7} "
                              f"{statistics.median(t_old) * 1e6:9.1f} {statistics.median(t_new) * 1e6:9.1f} "
                              f"{ratio:8.3f}", flush=True)


if __name__ == "__main__":
    main()
