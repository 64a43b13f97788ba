"""RMSNorm backends and the rule that picks one.

A backend is a module with ``name``, ``available() -> (bool, reason)``,
``supports(x, weight, bias) -> bool`` and ``rms_norm(x, normalized_shape, weight, bias, eps)``, and
optionally ``bind(x, normalized_shape, weight, bias, grad)`` (a launcher specialised for calls like
this one; see README.md in this directory).
They all compute the same function with the same cast order (the LayerNorm one: float32 arithmetic,
one rounding of the output; see ``eager``); they differ in speed.

Backends: ``eager`` (pure PyTorch), ``native`` (``F.rms_norm``), ``cpu`` (fused C++ kernel built at
first use), ``triton`` (our CUDA kernels; CPU only under ``TRITON_INTERPRET=1``).

``auto`` asks :func:`select` for the fastest available backend for this device, dtype and shape (the
rule is in :func:`select_for`). The environment variable ``NORMSWAP_BACKEND`` overrides ``auto``
globally (e.g. ``eager`` to rule out a kernel while debugging); an explicit ``backend=`` argument other
than ``auto`` overrides both. A requested backend that cannot run the call (not available here, or it
does not support the tensors) falls back to ``auto``'s choice.

When changes take effect (host cost per call: nothing below is recomputed on a call's path):

* ``NORMSWAP_BACKEND`` is read once per process, at the first RMSNorm call (or the first call of
  :func:`env_backend`); an invalid value fails there with the list of valid names. Availability
  (``find_spec``, ``torch.cuda.is_available``, the device name, the C++ build) is also computed once.
* Each ``normswap.RMSNorm`` module caches its decision per (tensor type, device, dtype, grad state); the shape
  class (rows) and CUDA-graph capture are thresholds inside the cached decision, and under
  ``torch.compile`` the module takes the traced path, which decides at trace time.
* :func:`refresh` re-reads the environment (``NORMSWAP_BACKEND``, ``TRITON_INTERPRET``), forgets
  availability and every module's cached decision. Setting ``module.backend``, moving or casting a
  module (``.to``, ``.half()``) or assigning its ``weight``/``bias``/``eps`` clears that module's cache.
* Tensor subclasses (a ``DTensor`` under FSDP2 or tensor parallelism) never reach the pointer-reading
  ``cpu``/``triton`` kernels: their ``supports`` refuse them and ``auto`` picks ``native``/``eager``,
  whose aten ops the subclass dispatches (``rows.dense``).
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable
from types import ModuleType

import torch

from normswap.backends import cpu, eager, native
from normswap.backends import triton as triton_backend
from normswap.backends.rows import wants_grad
from normswap.errors import NormswapError

BACKENDS: dict[str, ModuleType] = {"eager": eager, "native": native, "cpu": cpu, "triton": triton_backend}
ENV_VAR = "NORMSWAP_BACKEND"

#: A bound call: ``impl(x, weight, bias, eps)``; returns None when this call is not one the binding
#: covers (e.g. a wrongly shaped input), and the caller then takes the general path.
Impl = Callable[[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", float], "torch.Tensor | None"]

# ----------------------------------------------------------------------------- the CUDA rule's numbers
# All from an earlier H100 measurement (H100 80GB HBM3, torch 2.11, triton 3.6, a slow virtualised host
# where F.layer_norm costs ~18 us of host time); docs/backends.md has the tables. Not measured in the
# session that wrote this rule (it had no GPU): ``python benchmarks/gpu_targets.py`` re-checks it.
#
# Host time per eager call, microseconds: (backend, with backward).
HOST_US: dict[tuple[str, bool], float] = {
    ("native", False): 16.0,  # F.rms_norm 15.9, native.rms_norm 12.8-19.0
    ("native", True): 150.0,  # nn.RMSNorm module forward+backward 145-153
    ("triton", False): 76.0,  # normswap triton.rms_norm 76-89 (launch alone ~70)
    ("triton", True): 683.0,  # triton forward+backward 582-683
    ("add", False): 8.0,  # one more aten launch (estimate: half an F.rms_norm call; not measured alone)
    ("add", True): 30.0,  # the add's autograd node and the bias-gradient sum (estimate)
    # native's float32 route (half precision with a bias or per-head weights, so that it rounds once):
    # the upcast and the casting add are two more launches than native + add (estimate: 2 x "add")
    ("fp32_route", False): 16.0,
    ("fp32_route", True): 60.0,
}
# GPU time per element for 2-byte dtypes, picoseconds (bandwidth-bound, at 32768x4096 bf16; scale by
# itemsize / 2 for other dtypes): native forward 259 us, triton 180 us, copy 178 us; forward+backward
# native 867 us, triton 505 us. An extra elementwise pass (bias add, per-head weight multiply) moves two
# tensors like a copy; its backward (the bias gradient) reads dy once.
GPU_PS: dict[tuple[str, bool], float] = {
    ("native", False): 1.93,
    ("native", True): 6.46,
    ("triton", False): 1.34,
    ("triton", True): 3.76,
    ("add", False): 1.33,
    ("add", True): 2.0,
    # native's float32 route over native + add (estimate from bytes, not measured: the upcast writes
    # 4 bytes per element, the norm then reads and writes 4 instead of 2, the final add reads 4 instead
    # of 2: 12 more bytes per element at a copy's 1.33 ps per 4 bytes; the backward taken as twice that)
    ("fp32_route", False): 4.0,
    ("fp32_route", True): 8.0,
}
# Under torch.compile or CUDA-graph capture host time is paid once, so only GPU time counts; at small
# shapes the linear model above does not hold (triton loses: 2048x4096 forward 10.7 vs native 9.5 us,
# 8192x768 11.7 vs 9.2 us), so the graph rule uses the measured crossovers directly:
# Re-measured on an H200 (2026-11-26, torch 2.11, triton 3.6; docs/results/backends-gpu.md): triton's
# forward beat native at every measured shape from 8192x512 (6.3 vs 8.7 us; 8192x768 9.6 vs 10.7),
# forward+backward too (8192x512 26.4 vs 40.5 us). The earlier H100 figures above, from older kernels,
# had triton behind below 8192x4096; below 2^22 elements nothing was measured on the new code: native.
GRAPH_TRITON_MIN_FWD = 1 << 22  # forward: from 8192x512
GRAPH_TRITON_MIN_N_FWD = 512
GRAPH_TRITON_MIN_GRAD = 1 << 22  # forward+backward: from 8192x512
# Eager crossovers measured on the same H200 (2-byte dtypes, no bias, L2 flushed between calls): the
# additive host + GPU model above overestimates triton's cost there (its launch overlaps the GPU work
# queued before it), so where a crossover was measured it caps the model's threshold. Forward: triton
# 42.5 vs native 46.6 us at 8192x4096 (2^25), behind at 2048x4096 (80 vs 17 us). Backward: ahead at
# 32768x4096 (2^27; 457 vs 598 us), behind at 8192x8192 (467 vs 357 us).
EAGER_TRITON_MIN_FWD = 1 << 25
EAGER_TRITON_MIN_GRAD = 1 << 27
# Longest row ``auto`` gives triton. Compiled for sm_90 without a GPU (tests/backends/test_triton_aot.py):
# up to 8192 a row fits in registers; at 16384 the backward spills 64-1008 bytes per thread.
# ``backend="triton"`` still runs rows up to ``triton.MAX_N``.
CUDA_TRITON_MAX_N = 8192


def native_fp32_route(dtype: torch.dtype, extra_pass: bool) -> bool:
    """``native`` computes this call by its float32 route (a half-precision call with a bias or per-head
    weights: torch's op cannot apply those and still round once, see ``native``'s docstring)."""
    return extra_pass and dtype in (torch.bfloat16, torch.float16)


def eager_triton_min_elements(dtype: torch.dtype, *, grad: bool, extra_pass: bool,
                              fp32_route: bool | None = None) -> float:
    """Smallest ``x.numel()`` at which triton's saved GPU time exceeds its extra host time (eager).

    ``extra_pass``: the call has a bias or per-head weights, which ``native`` applies in one more
    elementwise op (whose host and GPU time triton saves too), in half precision through its float32
    route (:func:`native_fp32_route`), which costs more again. ``fp32_route`` overrides that
    derivation (the fused residual's extra pass is the add, not a bias). Never above the crossover
    measured for plain calls (``EAGER_TRITON_MIN_*``): the model is additive, a real stream overlaps.
    """
    scale = dtype.itemsize / 2
    saved_ps = GPU_PS[("native", grad)] - GPU_PS[("triton", grad)]
    extra_us = HOST_US[("triton", grad)] - HOST_US[("native", grad)]
    if extra_pass:
        saved_ps += GPU_PS[("add", grad)]
        extra_us -= HOST_US[("add", grad)]
    if native_fp32_route(dtype, extra_pass) if fp32_route is None else fp32_route:
        saved_ps += GPU_PS[("fp32_route", grad)]
        extra_us -= HOST_US[("fp32_route", grad)]
    saved_ps *= scale
    measured = (EAGER_TRITON_MIN_GRAD if grad else EAGER_TRITON_MIN_FWD) / scale
    if extra_us <= 0:
        return 0.0
    return min(measured, float("inf") if saved_ps <= 0 else extra_us * 1e6 / saved_ps)


def graph_triton_min_elements(n: int, *, grad: bool, extra_pass: bool) -> float:
    """Smallest ``x.numel()`` at which triton's GPU time beats ``native``'s (compile / graph capture)."""
    if extra_pass:
        return 0.0  # one fused kernel against native's two: measured ahead at every shape
    if grad:
        return float(GRAPH_TRITON_MIN_GRAD)
    return float(GRAPH_TRITON_MIN_FWD) if n >= GRAPH_TRITON_MIN_N_FWD else float("inf")


# ----------------------------------------------------------------- process-wide facts, computed once
_ENV: list[str | None] = [None]  # NORMSWAP_BACKEND as read (None: not read yet)
_AVAILABLE: dict[str, bool] = {}
_TRACKED: weakref.WeakSet = weakref.WeakSet()  # objects with a clear_decisions() method


def names() -> list[str]:
    return ["auto", *BACKENDS]


def check_name(backend: str) -> str:
    if backend != "auto" and backend not in BACKENDS:
        raise NormswapError(f"unknown RMSNorm backend {backend!r}; choose one of {', '.join(names())}")
    return backend


def _constant_when_compiled(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` (~1 s) here.

    That decorator only sets this attribute, which Dynamo reads when it traces a call
    (tests/backends/test_auto.py checks that this stays true).
    """
    fn._dynamo_marked_constant = True
    return fn


@_constant_when_compiled
def is_available(backend: str) -> bool:
    """``BACKENDS[backend].available()[0]``, computed once per process (until :func:`refresh`).

    Availability can build a C++ kernel, import triton or query the CUDA driver; it is a constant for
    ``torch.compile`` too (traced once, baked into the graph).
    """
    ok = _AVAILABLE.get(backend)
    if ok is None:
        ok = _AVAILABLE[backend] = bool(BACKENDS[backend].available()[0])
    return ok


@_constant_when_compiled
def _cpu_kernel_handles(dtype: torch.dtype) -> bool:
    k = cpu.kernel()  # built (or loaded) on first use
    return k.fn is not None and dtype in k.dtypes


@_constant_when_compiled
def env_backend() -> str:
    """``NORMSWAP_BACKEND`` (or ``"auto"``), read once per process; :func:`refresh` reads it again.

    An invalid value raises :class:`NormswapError` naming the valid ones, at the first read.
    """
    value = _ENV[0]
    if value is None:
        raw = (os.environ.get(ENV_VAR) or "auto").strip()
        if raw != "auto" and raw not in BACKENDS:
            raise NormswapError(f"{ENV_VAR}={raw!r} is not an RMSNorm backend; set it to one of "
                                f"{', '.join(names())} (or unset it)")
        value = _ENV[0] = raw
    return value


def track(obj: object) -> None:
    """Have :func:`refresh` call ``obj.clear_decisions()`` (``normswap.RMSNorm`` registers itself)."""
    _TRACKED.add(obj)


def refresh() -> None:
    """Re-read ``NORMSWAP_BACKEND`` and availability, and drop every module's cached decision.

    Call it after changing ``NORMSWAP_BACKEND`` or ``TRITON_INTERPRET`` in a running process.
    """
    _ENV[0] = None
    _AVAILABLE.clear()
    for obj in list(_TRACKED):
        obj.clear_decisions()


def _graph_mode(x: torch.Tensor) -> bool:
    """Compiling, or capturing a CUDA graph: host time is paid once, GPU time on every replay."""
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def select_for(
    device_type: str,
    dtype: torch.dtype,
    rows: int,
    n: int,
    *,
    bias: bool = False,
    per_head: bool = False,
    grad: bool = False,
    graph: bool = False,
) -> tuple[str, str]:
    """The ``auto`` rule on tensor metadata: ``(backend name, why)``.

    * CUDA: ``triton`` when available and it is faster overall, else ``native`` (PyTorch's fused
      kernel). Eager (``graph=False``): triton only where the GPU time it saves exceeds its extra
      host time (:func:`eager_triton_min_elements`); a bias or per-head weights count as the extra
      elementwise op ``native`` needs, so a biased norm is never slower than ``native`` plus one add.
      Under ``torch.compile`` or CUDA-graph capture (``graph=True``): GPU time alone
      (:func:`graph_triton_min_elements`). Rows longer than ``CUDA_TRITON_MAX_N`` go to ``native``.
    * CPU, eager (``graph=False``): ``cpu`` (fused C++ kernel) when it built here and handles the
      dtype; otherwise the faster of the two PyTorch paths measured on CPU: ``native`` for
      float32/float64, ``eager`` for bfloat16/float16 (``F.rms_norm`` is slower there; see
      docs/backends.md).
    * CPU under ``torch.compile`` (``graph=True``): a decomposable path, ``native`` for
      float32/float64 and ``eager`` for half precision. Inductor lowers both to its own loops and fuses
      the norm with its neighbours (the residual ``Add`` before it, the bias after it: one pass over
      memory), as it does the original's ``LayerNorm``; the ``cpu`` kernel would be an opaque extern
      call there, with the residual sum written out and read back around it (docs/backends.md).
    * Anything else (mps, xpu, meta, ...): ``native``.

    Only constant-folded helpers are called, so Dynamo traces this without graph breaks.
    """
    if device_type == "cuda":
        if not is_available("triton"):
            return "native", "triton is not available"
        if dtype not in triton_backend.DTYPES:
            return "native", f"triton does not handle {dtype}"
        if n > CUDA_TRITON_MAX_N:
            return "native", f"rows of {n} > {CUDA_TRITON_MAX_N} elements: triton's backward kernel spills registers"
        extra = bias or per_head
        numel = rows * n
        if graph:
            limit = graph_triton_min_elements(n, grad=grad, extra_pass=extra)
            if numel >= limit:
                return "triton", "compiled/graph: triton's GPU time is lower at this size"
            return "native", "compiled/graph: PyTorch's fused kernel is as fast or faster at this size"
        limit = eager_triton_min_elements(dtype, grad=grad, extra_pass=extra)
        if numel >= limit:
            return "triton", "eager: the GPU time triton saves exceeds its extra host time"
        return "native", (f"eager: below {limit:.3g} elements triton's extra host time exceeds the GPU time "
                          "it saves")
    if device_type == "cpu":
        if graph:  # inductor fuses the decomposed ops; the C++ kernel would be an unfusable extern call
            if dtype in (torch.float32, torch.float64):
                return "native", "compiled: inductor fuses F.rms_norm's decomposition with its neighbours"
            return "eager", "compiled: inductor fuses the eager ops (one rounding) with their neighbours"
        if _cpu_kernel_handles(dtype):
            return "cpu", "fused C++ kernel: one read and one write of x"
        if dtype in (torch.bfloat16, torch.float16):
            return "eager", "cpu kernel unavailable for this dtype; eager beats F.rms_norm for half types"
        return "native", "cpu kernel unavailable for this dtype; F.rms_norm beats eager for float32 on CPU"
    return "native", f"{device_type}: PyTorch's own rms_norm"


def _metadata(x: torch.Tensor, weight: torch.Tensor | None) -> tuple[int, int, bool]:
    n = weight.shape[-1] if weight is not None else x.shape[-1] if x.dim() else 1
    rows = x.numel() // n if n else 0
    return rows, n, weight is not None and weight.dim() > 1


def select(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> ModuleType:
    """The ``auto`` rule for a call (see :func:`select_for`)."""
    if x.is_cpu and not torch.compiler.is_compiling() and _cpu_kernel_handles(x.dtype) and \
            cpu.supports(x, weight, bias):
        return cpu  # the common eager CPU case, without the general rule's bookkeeping
    rows, n, per_head = _metadata(x, weight)
    choice, _ = select_for(x.device.type, x.dtype, rows, n, bias=bias is not None, per_head=per_head,
                           grad=wants_grad(x, weight, bias), graph=_graph_mode(x))
    module = BACKENDS[choice]
    if module.supports(x, weight, bias):
        return module
    return native if x.device.type != "cpu" or x.dtype in (torch.float32, torch.float64) else eager


def resolve(
    backend: str, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> ModuleType:
    """Backend module for a call. Falls back to ``auto`` when the requested one cannot run here."""
    if backend == "auto":
        backend = env_backend()
    if backend != "auto":
        module = BACKENDS.get(backend)
        if module is None:
            raise NormswapError(f"unknown RMSNorm backend {backend!r}; choose one of {', '.join(names())}")
        if is_available(backend) and module.supports(x, weight, bias):
            return module
    return select(x, weight, bias)


# ------------------------------------------------------------------ cached decisions (module calls)
def _bound(module: ModuleType, x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None,
           bias: torch.Tensor | None, grad: bool) -> Impl:
    binder = getattr(module, "bind", None)
    impl = binder(x, shape, weight, bias, grad) if binder is not None else None
    if impl is not None:
        return impl
    run = module.rms_norm

    def call(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float) -> torch.Tensor:
        return run(x, shape, w, b, eps)

    return call


def bind(
    backend: str, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    normalized_shape: tuple[int, ...],
) -> Impl:
    """The decision for calls like this one, as a callable ``impl(x, weight, bias, eps)``.

    ``normswap.RMSNorm`` caches it per (tensor type, device, dtype, grad state), so the rule, the availability
    checks and ``supports`` run once per module and key, not per call. On CUDA with ``auto`` the
    callable keeps the shape-class and graph-capture thresholds and compares ``x.numel()`` with them
    (the capture query runs only for sizes where eager and graph rules disagree).
    """
    grad = wants_grad(x, weight, bias)
    requested = backend if backend != "auto" else env_backend()
    if requested != "auto":
        module = BACKENDS[check_name(requested)]
        if is_available(requested) and module.supports(x, weight, bias):
            return _bound(module, x, normalized_shape, weight, bias, grad)
    if x.is_cuda and is_available("triton") and triton_backend.supports(x, weight, bias):
        return _bind_cuda(x, weight, bias, normalized_shape, grad)
    return _bound(select(x, weight, bias), x, normalized_shape, weight, bias, grad)


def _bind_cuda(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               shape: tuple[int, ...], grad: bool) -> Impl:
    _, n, per_head = _metadata(x, weight)
    fast = _bound(native, x, shape, weight, bias, grad)
    if x.dtype not in triton_backend.DTYPES or n > CUDA_TRITON_MAX_N:
        return fast
    extra = bias is not None or per_head
    eager_min = eager_triton_min_elements(x.dtype, grad=grad, extra_pass=extra)
    graph_min = graph_triton_min_elements(n, grad=grad, extra_pass=extra)
    tri = _bound(triton_backend, x, shape, weight, bias, grad)
    capturing = torch.cuda.is_current_stream_capturing

    def call(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float) -> torch.Tensor | None:
        numel = x.numel()
        if numel >= eager_min or (numel >= graph_min and capturing()):
            return tri(x, w, b, eps)
        return fast(x, w, b, eps)

    return call


_REPRESENTATIVE = (
    ("cpu", torch.float32, 2048, 4096, False),
    ("cpu", torch.bfloat16, 2048, 4096, False),
    ("cpu", torch.float32, 2048, 4096, True),
    ("cuda", torch.bfloat16, 8192, 4096, False),
    ("cuda", torch.bfloat16, 8192, 4096, True),
    ("cuda", torch.bfloat16, 16, 4096, False),
)


def describe() -> list[dict]:
    """One dict per backend (``name``, ``available``, ``reason``) plus one per representative call
    (``name="auto"``, ``device``, ``dtype``, ``shape``, ``mode`` (eager or compiled), ``picks``,
    ``why``, ``device_present``: whether this machine has that device: the rule for a device that is
    not here is what ``auto`` would do there), for ``normswap backends``."""
    out: list[dict] = []
    for bname, module in BACKENDS.items():
        ok, reason = module.available()
        out.append({"name": bname, "available": bool(ok), "reason": reason})
    env = env_backend()
    for device, dtype, rows, n, graph in _REPRESENTATIVE:
        picks, why = select_for(device, dtype, rows, n, graph=graph)
        if why.endswith("not available") or "unavailable" in why:  # say why it is not
            blocked = "triton" if device == "cuda" else "cpu"
            why = f"{why}; {blocked}: {BACKENDS[blocked].available()[1]}"
        if env != "auto":
            why = f"{ENV_VAR}={env} overrides auto where it can run; otherwise: {why}"
        if device == "cuda" and not why.startswith(("eager", "compiled")):
            why = f"{'compiled/graph' if graph else 'eager'}: {why}"
        out.append({
            "name": "auto", "device": device, "dtype": str(dtype).replace("torch.", ""),
            "shape": [rows, n], "mode": "compiled" if graph else "eager", "picks": picks, "why": why,
            "device_present": device == "cpu" or torch.cuda.is_available(),
        })
    return out


def rms_norm_residual(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: int | tuple[int, ...],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm residual step: ``h = x + residual`` and ``y = rms_norm(h)``; returns ``(y, h)``.

    The ``triton`` backend fuses both into one kernel (h is written once, read never again; the
    backward adds h's own gradient in the same kernel). Every other backend runs the add, then its
    ``rms_norm``. ``auto`` uses the fused kernel on CUDA where :func:`select_for`'s rule for a biased
    norm would pick triton (the add it saves is the same extra pass).
    """
    shape = (int(normalized_shape),) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    requested = backend if backend != "auto" else env_backend()
    fused_ok = is_available("triton") and triton_backend.supports_residual(x, residual, shape, weight, bias)
    if fused_ok and requested == "auto" and x.is_cuda:
        # the fused kernel saves native's separate add, as a bias does: the same rule as a biased norm
        grad = wants_grad(x, residual, weight, bias)  # under no_grad a residual that requires grad records nothing
        if _graph_mode(x):
            limit = graph_triton_min_elements(math.prod(shape), grad=grad, extra_pass=True)
        else:
            per_head = weight is not None and weight.dim() > 1
            limit = eager_triton_min_elements(x.dtype, grad=grad, extra_pass=True, fp32_route=native_fp32_route(
                x.dtype, bias is not None or per_head))
        fused_ok = x.numel() >= limit
    elif requested != "triton":
        fused_ok = False
    if fused_ok:
        return triton_backend.rms_norm_residual(x, residual, shape, weight, bias, float(eps))
    h = x + residual
    module = resolve(backend, h, weight, bias)
    return module.rms_norm(h, shape, weight, bias, float(eps)), h
