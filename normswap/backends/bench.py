"""Op benchmark core, shared by ``benchmarks/bench_ops.py`` and ``normswap bench``.

For each shape and dtype it times, side by side in interleaved rounds:

* ``copy``: ``y.copy_(x)``, the achievable memory speed (same bytes as an RMSNorm forward);
* ``layer_norm``: ``F.layer_norm`` with weight and bias (what a conversion replaces);
* ``torch_rms_norm``: ``F.rms_norm``;
* each normswap backend that is available and supports the call (``eager``, ``native``, ``cpu``,
  ``triton``), with a weight and no bias (a converted norm, beta folded into the next Linear);
* ``auto``: the public call, ``normswap.rms_norm(x, n, weight)`` with ``backend="auto"``, so its
  Python dispatch (checks, backend choice, output allocation) is in the number users see;
* optionally ``compile`` (``torch.compile`` of the eager math) and ``liger`` (if installed, CUDA).

Each timed block starts with at least 10 ms of untimed calls, so every method is measured in its steady
state (its operands in cache as far as they fit), whatever ran before it in the round.

Absolute times on a shared machine are noisy, so every round times every method back to back and the
reported ratios (to ``layer_norm`` and to ``copy``) are medians of per-round ratios; a slow phase
then slows both sides of a ratio. Times are medians over rounds. The ratio of the fastest rounds
(``min_vs_*``) is reported too: on a machine other jobs keep busy, the minimum is the sample least
disturbed by them (multi-threaded ops suffer most: one descheduled thread stalls the others).

Passes: ``fwd``; ``bwd`` (one forward graph kept, only the backward timed); ``fwd+bwd``.
Bytes model (for GB/s): forward reads x and writes y, ``2 * M * N * itemsize``; backward reads x and
dy and writes dx, ``3 * M * N * itemsize``; forward+backward ``5 * M * N * itemsize`` (parameters are
negligible).
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from normswap import backends

DEFAULT_SHAPES = ((4096, 768), (2048, 4096), (256, 2048))
EPS = 1e-6
PASSES = ("fwd", "bwd", "fwd+bwd")
# Tensors of x's size moved per pass: fwd reads x, writes y; bwd reads x and dy, writes dx; fwd+bwd is
# both (x read twice). Parameters and per-row statistics are negligible.
BYTES_PER_ELEMENT = {"fwd": 2, "bwd": 3, "fwd+bwd": 5}
WARMUP_S = 0.01


@dataclass
class Record:
    """One method at one shape/dtype/pass."""

    device: str
    dtype: str
    rows: int
    n: int
    pass_: str
    method: str
    median_us: float
    min_us: float
    gbps: float
    vs_layer_norm: float | None  # median per-round time ratio method / layer_norm
    vs_copy: float | None  # median per-round time ratio method / copy (forward only)
    min_vs_layer_norm: float | None = None  # ratio of the fastest rounds (least disturbed by other load)
    min_vs_copy: float | None = None
    samples_us: list[float] = field(default_factory=list)


def environment(device: str) -> dict:
    """Versions, device and thread count, for the JSON output and RESULTS.md."""
    info = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "device": device,
        "cpu": _cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    cpu_kernel = backends.cpu.kernel()
    info["cpu_kernel"] = cpu_kernel.reason
    info["cpu_kernel_build_s"] = round(cpu_kernel.build_seconds, 3)
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


_L2_FLUSH: dict[str, torch.Tensor] = {}


def _time_block(fn: Callable[[], object], reps: int, device: str, clock: str = "wall") -> float:
    """Seconds per call over ``reps`` back-to-back calls.

    On CUDA each call is timed with its own events after overwriting a 256 MB buffer, so no call
    finds its operands in L2 (50 MB on H100), as ``triton.testing.do_bench`` does.
    ``clock="thread"`` (CPU, one thread only) counts the calling thread's CPU time, which time spent
    descheduled by other processes does not inflate.
    """
    # Untimed warm-up of at least WARMUP_S: brings this method's data back into cache after the other
    # methods of the round ran, and lets the machine settle. Measured on the CI kind: after a block of
    # heavy F.rms_norm calls, the next op's calls take ~1.5x their steady time and need ~10 calls
    # (~10 ms) to recover, so a single warm-up call biased whichever method came next in the round.
    start = time.perf_counter()
    for _ in range(10_000):
        fn()
        if time.perf_counter() - start >= WARMUP_S:
            break
    _sync(device)
    if device == "cuda":
        flush = _L2_FLUSH.setdefault("buf", torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        _sync(device)
        return sum(s.elapsed_time(e) for s, e in events) / 1e3 / reps
    now = time.thread_time if clock == "thread" else time.perf_counter
    t0 = now()
    for _ in range(reps):
        fn()
    return (now() - t0) / reps


def _calibrate(fn: Callable[[], object], device: str, target_s: float) -> int:
    for _ in range(2):
        fn()
    one = max(_time_block(fn, 1, device), 1e-7)
    return int(min(max(target_s / one, 2), 2000))


def _methods(x: torch.Tensor, n: int, pass_: str, include: Sequence[str], compile_: bool,
             liger: bool) -> dict[str, Callable[[], object]]:
    """Callables for one shape/dtype. Forward+backward ones return the gradients."""
    device, dtype = x.device, x.dtype
    gen = torch.Generator(device="cpu").manual_seed(0)
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(device=device, dtype=dtype)
    b = (0.1 * torch.randn(n, generator=gen)).to(device=device, dtype=dtype)
    train = pass_ != "fwd"
    if train:
        x = x.detach().requires_grad_(True)
        w.requires_grad_(True)
        b.requires_grad_(True)
    gy = torch.randn(x.shape, generator=gen).to(device=device, dtype=dtype)

    def wrap(f: Callable[[], torch.Tensor], params: tuple[torch.Tensor, ...]) -> Callable[[], object]:
        if pass_ == "fwd":
            return f
        if pass_ == "fwd+bwd":
            return lambda: torch.autograd.grad(f(), params, gy)
        y = f()  # "bwd": one forward graph, kept; only the backward is timed
        return lambda: torch.autograd.grad(y, params, gy, retain_graph=True)

    out = torch.empty_like(x)
    methods: dict[str, Callable[[], object]] = {}
    if not train:
        methods["copy"] = lambda: out.copy_(x)
    methods["layer_norm"] = wrap(lambda: F.layer_norm(x, (n,), w, b, EPS), (x, w, b))
    methods["torch_rms_norm"] = wrap(lambda: F.rms_norm(x, (n,), w, EPS), (x, w))
    for name in include:
        module = backends.BACKENDS[name]
        if module.available()[0] and module.supports(x, w, None):
            methods[name] = wrap(lambda m=module: m.rms_norm(x, (n,), w, None, EPS), (x, w))
    from normswap.nn.rmsnorm import rms_norm  # the public entry point (imported here: norm imports backends)

    methods["auto"] = wrap(lambda: rms_norm(x, (n,), w, None, EPS), (x, w))
    if compile_:
        torch._dynamo.reset()  # a fresh cache per shape: no recompile limit, no stale guards
        compiled = torch.compile(lambda x, w: backends.eager.rms_norm(x, (n,), w, None, EPS), dynamic=False)
        methods["compile"] = wrap(lambda: compiled(x, w), (x, w))
    if liger and device.type == "cuda":
        try:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            methods["liger"] = wrap(lambda: LigerRMSNormFunction.apply(x, w, EPS), (x, w))
        except ImportError:
            pass
    return methods


def _median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median over rounds of a's time / b's time in the same round."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def bench_shape(
    rows: int, n: int, dtype: torch.dtype, device: str = "cpu", *, pass_: str = "fwd",
    include: Sequence[str] = ("eager", "native", "cpu", "triton"), rounds: int = 7, target_ms: float = 20.0,
    compile_: bool = False, liger: bool = True, clock: str = "wall",
) -> list[Record]:
    """Time every method at one shape; returns one Record per method."""
    if clock == "thread" and (device != "cpu" or torch.get_num_threads() != 1):
        raise ValueError("clock='thread' measures one thread's CPU time: use it on CPU with 1 thread")
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    ctx = torch.no_grad() if pass_ == "fwd" else torch.enable_grad()
    with ctx:
        methods = _methods(x, n, pass_, include, compile_, liger)
        reps = {k: _calibrate(f, device, target_ms / 1e3) for k, f in methods.items()}
        times: dict[str, list[float]] = {k: [] for k in methods}
        for _ in range(rounds):
            for k, f in methods.items():  # interleaved: every method once per round
                times[k].append(_time_block(f, reps[k], device, clock))
    elem = x.element_size()
    nbytes = BYTES_PER_ELEMENT[pass_] * rows * n * elem
    records = []
    for k, ts in times.items():
        med = statistics.median(ts)

        def ratio(base: str, ts: list[float] = ts) -> float | None:
            if base not in times:
                return None
            return _median_ratio(ts, times[base])

        def min_ratio(base: str, ts: list[float] = ts) -> float | None:
            return min(ts) / min(times[base]) if base in times else None

        records.append(Record(
            device=device, dtype=str(dtype).replace("torch.", ""), rows=rows, n=n, pass_=pass_, method=k,
            median_us=med * 1e6, min_us=min(ts) * 1e6, gbps=nbytes / med / 1e9,
            vs_layer_norm=ratio("layer_norm"), vs_copy=ratio("copy"),
            min_vs_layer_norm=min_ratio("layer_norm"), min_vs_copy=min_ratio("copy"),
            samples_us=[t * 1e6 for t in ts],
        ))
    return records


def run(
    device: str = "cpu",
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES,
    passes: Sequence[str] = ("fwd", "fwd+bwd"),
    **kwargs,
) -> list[Record]:
    """All shapes x dtypes x passes."""
    out: list[Record] = []
    for pass_ in passes:
        for dtype in dtypes:
            for rows, n in shapes:
                out.extend(bench_shape(rows, n, dtype, device, pass_=pass_, **kwargs))
    return out


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"4096x768,2048x4096"`` -> ``[(4096, 768), (2048, 4096)]``."""
    shapes = []
    for part in text.replace(" ", "").split(","):
        if part:
            rows, n = part.lower().split("x")
            shapes.append((int(rows), int(n)))
    return shapes


def parse_dtype(name: str) -> torch.dtype:
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp64": "float64"}
    dtype = getattr(torch, aliases.get(name, name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def table(records: Sequence[Record]) -> str:
    """Fixed-width text table, one block per (pass, dtype, shape)."""
    lines = [f"{'pass':8} {'dtype':9} {'shape':>11} {'method':15} {'median us':>10} {'min us':>9} "
             f"{'GB/s':>7} {'x layer_norm':>12} {'x copy':>7} {'(min: xLN':>10} {'x copy)':>8}"]

    def fmt(v: float | None, width: int) -> str:
        return f"{v:{width}.2f}" if v is not None else " " * width

    for r in records:
        lines.append(f"{r.pass_:8} {r.dtype:9} {f'{r.rows}x{r.n}':>11} {r.method:15} {r.median_us:10.1f} "
                     f"{r.min_us:9.1f} {r.gbps:7.1f} {fmt(r.vs_layer_norm, 12)} {fmt(r.vs_copy, 7)} "
                     f"{fmt(r.min_vs_layer_norm, 10)} {fmt(r.min_vs_copy, 8)}")
    return "\n".join(lines)


def to_json(records: Sequence[Record], env: dict) -> dict:
    rows = []
    for r in records:
        d = asdict(r)
        d["pass"] = d.pop("pass_")
        rows.append(d)
    return {"environment": env, "results": rows}


def plot(records: Sequence[Record], path: str) -> bool:
    """Bar chart of time relative to ``layer_norm`` (lower is better). False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = sorted({(r.pass_, r.dtype, r.rows, r.n) for r in records}, key=lambda g: (g[0] != "fwd", *g[1:]))
    methods = [m for m in dict.fromkeys(r.method for r in records) if m != "layer_norm"]
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(groups)), 4.5))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        vals = []
        for g in groups:
            hit = [r for r in records if (r.pass_, r.dtype, r.rows, r.n) == g and r.method == m]
            vals.append(hit[0].vs_layer_norm if hit and hit[0].vs_layer_norm else math.nan)
        ax.bar([j + i * width for j in range(len(groups))], vals, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{p}\n{d}\n{r}x{n}" for p, d, r, n in groups], fontsize=8)
    ax.set_ylabel("time / layer_norm time (lower is better)")
    ax.set_yscale("log")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
