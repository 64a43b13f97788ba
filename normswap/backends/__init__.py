"""RMSNorm backends and the rule that picks one.

A backend is a module with ``name``, ``available() -> (bool, reason)``,
``supports(x, weight, bias) -> bool`` and ``rms_norm(x, normalized_shape, weight, bias, eps)``.
They all compute the same function (see ``eager`` for the cast order); they differ in speed.

Backends: ``eager`` (pure PyTorch), ``native`` (``F.rms_norm``), ``cpu`` (fused C++ kernel built at
first use), ``triton`` (our CUDA kernels; CPU only under ``TRITON_INTERPRET=1``).

``auto`` asks :func:`select` for the fastest available backend for this device, dtype and shape (the
rule is in :func:`select_for`). The environment variable ``NORMSWAP_BACKEND`` overrides ``auto``
globally (e.g. ``eager`` to rule out a kernel while debugging); an explicit ``backend=`` argument other
than ``auto`` overrides both. A requested backend that cannot run the call (not available here, or it
does not support the tensors) falls back to ``auto``'s choice.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from normswap.backends import cpu, eager, native
from normswap.backends import triton as triton_backend
from normswap.backends._env import env_reader
from normswap.errors import NormswapError

BACKENDS: dict[str, ModuleType] = {"eager": eager, "native": native, "cpu": cpu, "triton": triton_backend}
ENV_VAR = "NORMSWAP_BACKEND"

# CUDA rule thresholds (see select_for). Published anchors (kernels.md section 7): PyTorch's fused
# CUDA RMSNorm reaches 54-62% of HBM bandwidth at N >= 4096, Liger-style row kernels 69-84%, while at
# small shapes host overhead dominates and native is the safer choice.
CUDA_TRITON_MIN_N = 2048
CUDA_TRITON_MIN_ELEMENTS = 1 << 20
# Longest row ``auto`` gives triton. Compiled for sm_90 without a GPU (normswap/backends/_triton_aot.py,
# tests/backends/test_triton_aot.py): up to 8192 a row fits in registers (no spill in the usual aligned
# launch, at most 24 bytes per thread in the generic one); at 16384 the backward spills 64-1008 bytes per
# thread (32768: up to 1152). ``backend="triton"`` still runs rows up to ``triton.MAX_N``.
CUDA_TRITON_MAX_N = 8192


def register(module: ModuleType) -> None:
    """Add a backend module (see the module docstring for the interface)."""
    BACKENDS[module.name] = module


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
    """``BACKENDS[backend].available()[0]``, evaluated once at trace time under ``torch.compile``.

    Availability can build a C++ kernel or import triton, which Dynamo must not trace; it does not
    change during a process's life, so it is safe to bake into a compiled graph as a constant.
    """
    return bool(BACKENDS[backend].available()[0])


@_constant_when_compiled
def _cpu_kernel_handles(dtype: torch.dtype) -> bool:
    k = cpu.kernel()  # built (or loaded) on first use
    return k.fn is not None and dtype in k.dtypes


def select_for(
    device_type: str,
    dtype: torch.dtype,
    rows: int,
    n: int,
    *,
    bias: bool = False,
    per_head: bool = False,
) -> tuple[str, str]:
    """The ``auto`` rule on tensor metadata: ``(backend name, why)``.

    * CUDA: ``triton`` when available and the call is bandwidth-bound (``n >= 2048`` and at least
      2^20 elements), or when it fuses something ``native`` does in extra passes (a bias or per-head
      weights) at that size; otherwise ``native`` (PyTorch's fused kernel, lower launch overhead).
      Rows longer than ``CUDA_TRITON_MAX_N`` (8192) go to ``native``: beyond it the backward kernel
      spills registers (checked by compiling for sm_90).
    * CPU: ``cpu`` (fused C++ kernel) when it built here and handles the dtype; otherwise the faster
      of the two PyTorch paths measured on CPU: ``native`` for float32/float64, ``eager`` for
      bfloat16/float16 (``F.rms_norm`` is slower there; see docs/backends.md).
    * Anything else (mps, xpu, ...): ``native``.

    Only constant-folded helpers are called, so Dynamo traces this without graph breaks.
    """
    if device_type == "cuda":
        if not is_available("triton"):
            return "native", "triton is not available"
        if dtype not in triton_backend._DTYPES:
            return "native", f"triton does not handle {dtype}"
        if n > CUDA_TRITON_MAX_N:
            return "native", f"rows of {n} > {CUDA_TRITON_MAX_N} elements: triton's backward kernel spills registers"
        if rows * n >= CUDA_TRITON_MIN_ELEMENTS and (n >= CUDA_TRITON_MIN_N or bias or per_head):
            return "triton", "bandwidth-bound shape: triton row kernel (bias and per-head weights fused)"
        return "native", "small shape: PyTorch's fused kernel has the lower launch overhead"
    if device_type == "cpu":
        if _cpu_kernel_handles(dtype):
            return "cpu", "fused C++ kernel: one read and one write of x"
        if dtype in (torch.bfloat16, torch.float16):
            return "eager", "cpu kernel unavailable for this dtype; eager beats F.rms_norm for half types"
        return "native", "cpu kernel unavailable for this dtype; F.rms_norm beats eager for float32 on CPU"
    return "native", f"{device_type}: PyTorch's own rms_norm"


def select(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> ModuleType:
    """The ``auto`` rule for a call (see :func:`select_for`)."""
    if x.is_cpu and _cpu_kernel_handles(x.dtype) and cpu.supports(x, weight, bias):
        return cpu  # the common CPU case, without the general rule's bookkeeping
    n = weight.shape[-1] if weight is not None else x.shape[-1] if x.dim() else 1
    rows = x.numel() // n if n else 0
    per_head = weight is not None and weight.dim() > 1
    choice, _ = select_for(x.device.type, x.dtype, rows, n, bias=bias is not None, per_head=per_head)
    module = BACKENDS[choice]
    if module.supports(x, weight, bias):
        return module
    return native if x.device.type != "cpu" or x.dtype in (torch.float32, torch.float64) else eager


_read_backend_env = env_reader(ENV_VAR)


def env_backend() -> str:
    """``NORMSWAP_BACKEND`` or ``"auto"``. Under compilation through ``os.environ`` (Dynamo traces it)."""
    if torch.compiler.is_compiling():
        return os.environ.get(ENV_VAR, "auto") or "auto"
    return _read_backend_env() or "auto"


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


_REPRESENTATIVE = (
    ("cpu", torch.float32, 2048, 4096),
    ("cpu", torch.bfloat16, 2048, 4096),
    ("cuda", torch.bfloat16, 8192, 4096),
    ("cuda", torch.bfloat16, 16, 4096),
)


def describe() -> list[dict]:
    """One dict per backend (``name``, ``available``, ``reason``) plus one per representative call
    (``name="auto"``, ``device``, ``dtype``, ``shape``, ``picks``, ``why``), for ``normswap backends``."""
    out: list[dict] = []
    for bname, module in BACKENDS.items():
        ok, reason = module.available()
        out.append({"name": bname, "available": bool(ok), "reason": reason})
    env = os.environ.get(ENV_VAR, "")
    for device, dtype, rows, n in _REPRESENTATIVE:
        picks, why = select_for(device, dtype, rows, n)
        if why.endswith("not available") or "unavailable" in why:  # say why it is not
            blocked = "triton" if device == "cuda" else "cpu"
            why = f"{why}; {blocked}: {BACKENDS[blocked].available()[1]}"
        if env and env != "auto":
            why = f"{ENV_VAR}={env} overrides auto where it can run; otherwise: {why}"
        out.append({
            "name": "auto", "device": device, "dtype": str(dtype).replace("torch.", ""),
            "shape": [rows, n], "picks": picks, "why": why,
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
    ``rms_norm``. ``auto`` uses the fused kernel on CUDA from 2^20 elements, where the saved pass
    over memory matters.
    """
    shape = (int(normalized_shape),) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    requested = backend if backend != "auto" else env_backend()
    fused_ok = is_available("triton") and triton_backend.supports_residual(x, residual, shape, weight, bias)
    if fused_ok and (
        requested == "triton"
        or (requested == "auto" and x.is_cuda and x.numel() >= CUDA_TRITON_MIN_ELEMENTS)
    ):
        return triton_backend.rms_norm_residual(x, residual, shape, weight, bias, float(eps))
    h = x + residual
    module = resolve(backend, h, weight, bias)
    return module.rms_norm(h, shape, weight, bias, float(eps)), h
