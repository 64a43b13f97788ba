"""Triton RMSNorm: our own forward and backward kernels (``_triton_kernels.py``).

* fp32 arithmetic (fp64 for fp64 inputs) with one rounding of the output (``eager``'s cast order),
  ``rstd`` saved per row, optional bias, weight and bias of any dtype (upcast from their own dtype, as
  in ``eager``), per-head ``(H, D)`` parameters.
* Backward: a persistent grid writes fp32 dW/dB partials per program, summed on the host. No atomics,
  so dW is bitwise reproducible run to run.
* Strides: rows may have any row stride as long as the normalised dims are contiguous; no copy then.
* ``torch.compile``: forward and backward are ``torch.library.custom_op``s
  (``normswap::triton_rms_norm_fwd`` / ``_bwd``) with ``register_fake`` and ``register_autograd``, so
  ``fullgraph=True`` traces them with no graph break, and the fakes use symbolic row counts (no
  recompile as M varies). Outside compilation the op dispatcher is bypassed: ``rms_norm`` calls an
  ``autograd.Function`` (or, without grad, the launcher) directly, which saves the ~tens of
  microseconds per call that the dispatcher/functionalisation boundary costs on small shapes.
* Rows longer than ``MAX_N`` (whole row in registers) go to ``native`` instead.
* No autotuning: block sizes and warps follow a fixed rule (multi-config autotune cannot run under
  the interpreter, and a fixed rule keeps compile-time behaviour predictable).

Runs on CUDA; on CPU only under ``TRITON_INTERPRET=1`` (the tests use that to check numerics).
This module's name shadows nothing: ``import triton`` below is absolute and gets the real package.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch

from normswap.backends import eager, native
from normswap.backends.rows import as_rows, compute_dtype, dense, fake_grads, grad_launcher, param_grads, wants_grad

name = "triton"
MAX_N = 32768
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install 'normswap[triton]')"
    if torch.cuda.is_available():
        return True, f"triton kernels on CUDA ({torch.cuda.get_device_name()})"
    if _interpret():
        return True, "triton kernels under TRITON_INTERPRET=1 (CPU interpreter: correct but slow)"
    return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels in triton's CPU interpreter)"


def _device_ok(x: torch.Tensor) -> bool:
    return x.is_cuda or (x.device.type == "cpu" and _interpret())


def _param_ok(p: torch.Tensor | None, x: torch.Tensor) -> bool:
    """A parameter must equal x's trailing dims exactly (plain or per-head), on x's device."""
    return p is None or (
        p.dim() <= x.dim() and tuple(p.shape) == tuple(x.shape[x.dim() - p.dim():]) and p.device == x.device
    )


def supports(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    # no wrapper subclass: a DTensor (FSDP2, TP) goes to native, which it dispatches (rows.dense)
    return (x.dtype in DTYPES and _device_ok(x) and dense(x) and dense(weight) and dense(bias)
            and _param_ok(weight, x) and _param_ok(bias, x))


# ------------------------------------------------------------------------------------ launching
@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_warps(block_n: int) -> int:
    if block_n >= 32768:
        return 32
    if block_n >= 8192:
        return 16
    if block_n >= 2048:
        return 8
    return 4


# No FMA contraction: the GPU computes the fp32 roundings the code spells out, as the interpreter (which
# the CPU tests run), ``eager`` and the CPU kernel do; with contraction ``t * w + b`` would round once
# instead of twice in fp32, and the output could differ from theirs in its last bit. Passed explicitly,
# which also silences triton 3.9's warning that its default is changing.
FP_FUSION = False


# The forward's generic specialisation (scalar loads: an unaligned pointer, stride or row length) on
# blocks of this many elements gets 16 warps instead of 8: at 8 the ptxas of triton 3.6 spills 4 bytes
# per thread for bf16 rows of 4096 with a weight and no bias (registers 40, compiled for sm_90); at 16
# nothing spills for any dtype or parameter set, with triton 3.6 and 3.9 (tests/backends/test_triton_aot.py).
# The aligned (vectorised) launch, the one measured on an H100, keeps 8.
GENERIC_WIDE_BLOCK = 4096


def fwd_launch_config(n: int, aligned: bool = True) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of the forward kernel for rows of ``n`` elements.

    ``aligned``: the call gets triton's vectorised specialisation (every pointer 16-byte aligned, every
    stride and the row length multiples of 16; see :func:`_vectorised`).
    """
    block_n = triton_next_pow2(n)
    block_m = max(1, min(16, (256 if _interpret() else 2048) // block_n))
    if not aligned and block_n * block_m == GENERIC_WIDE_BLOCK:
        return block_m, block_n, 16
    return block_m, block_n, _num_warps(block_n * block_m)


def _vectorised(n: int, x2: torch.Tensor, r2: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a forward call's pointers (the outputs are fresh allocations: aligned), row strides and
    row length are all multiples of 16 (bytes for pointers), as triton's launcher checks to pick its
    vectorised specialisation."""
    return (n % 16 == 0 and x2.stride(0) % 16 == 0 and r2.stride(0) % 16 == 0
            and all(t.data_ptr() % 16 == 0 for t in (x2, r2, w, b)))


def bwd_launch_config(n: int) -> tuple[int, int]:
    """``(BLOCK_N, num_warps)`` of the backward kernel for rows of ``n`` elements."""
    block_n = triton_next_pow2(n)
    return block_n, _num_warps(block_n)


def _prep_param(p: torch.Tensor | None, n: int, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    if p is None:
        return x, 1  # dummy pointer, never read (HAS_* = 0)
    p = p.contiguous()
    return p, p.numel() // n


# Launch handles. ``kernel[grid](...)`` runs triton's whole launch path on every call (argument
# binding and specialisation, cache-key hashing, option parsing): most of the ~70 us of host time per
# forward measured on an H100 host. The compiled kernel it returns (a ``CompiledKernel``) can be launched
# directly with ``.run(...)``. We key it on exactly what triton specialises on: each tensor's dtype and
# 16-byte alignment, each int's ``== 1`` / ``% 16 == 0`` / 32-bit range, the constexprs and the device;
# the first call per key goes through triton (compiling if needed) and keeps the handle. Any failure
# of a direct launch turns handles off for the process (``HANDLES_ENABLED``) and falls back to
# ``kernel[grid]``. GPU only (the interpreter returns no handle); not measured in the session that
# wrote it (no GPU): ``benchmarks/gpu_targets.py`` measures the host cost.
HANDLES_ENABLED = [True]
_HANDLES: dict[tuple, object] = {}


def _spec_key(args: tuple) -> tuple:
    """What triton's launcher specialises a call on, for positional runtime args."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            key.append(("b", a))
        elif isinstance(a, int):
            key.append((a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31)))
        else:
            key.append(type(a))
    return tuple(key)


def current_stream(index: int | None) -> int:
    """The raw CUDA stream triton launches on for this device (what ``kernel[grid]`` uses)."""
    from triton.runtime import driver

    return driver.active.get_current_stream(index)


def launch_handles() -> int:
    """How many compiled-kernel handles are cached (0 without a GPU, or after a fallback)."""
    return len(_HANDLES)


def _launch_hooks_set() -> bool:
    knobs = getattr(__import__("triton"), "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    return runtime is not None and (getattr(runtime, "launch_enter_hook", None) is not None
                                    or getattr(runtime, "launch_exit_hook", None) is not None)


def launch(kernel, grid: tuple[int, ...], args: tuple, constexprs: dict, options: dict, device: torch.device):
    """``kernel[grid](*args, **constexprs, **options)``, through a cached launch handle where possible.

    ``args`` are the kernel's runtime parameters in order; ``constexprs`` follow them in the signature,
    in this order. Returns nothing.
    """
    if not HANDLES_ENABLED[0] or device.type != "cuda":
        kernel[grid](*args, **constexprs, **options)
        return
    key = (id(kernel), device.index, tuple(constexprs.values()), _spec_key(args))
    handle = _HANDLES.get(key)
    if handle is None:
        compiled = kernel[grid](*args, **constexprs, **options)
        if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            _HANDLES[key] = compiled
        return
    if _launch_hooks_set():  # a profiler wants triton's launch hooks: take triton's own path
        kernel[grid](*args, **constexprs, **options)
        return
    try:
        stream = current_stream(device.index)
        g = (*grid, 1, 1)
        handle.run(g[0], g[1], g[2], stream, handle.function, handle.packed_metadata, None, None, None,
                   *args, *constexprs.values())
    except Exception:  # noqa: BLE001 - an API this code does not know: fall back, for good
        HANDLES_ENABLED[0] = False
        _HANDLES.clear()
        kernel[grid](*args, **constexprs, **options)


def forward(
    x: torch.Tensor, normalized_shape: tuple[int, ...], weight: torch.Tensor | None,
    bias: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None, *, want_rstd: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the forward kernel: ``(y, rstd, h)``.

    ``y`` is contiguous with x's shape and dtype, ``rstd`` has one entry per row (None with
    ``want_rstd=False``: nothing allocated or stored), and ``h`` is ``x + residual`` (the tensor actually
    normalised) when a residual is given, else None.
    """
    from normswap.backends._triton_kernels import kernels

    fwd, _ = kernels()
    n = math.prod(normalized_shape)
    x2 = as_rows(x, n) if n else x.reshape(-1, 0)
    m = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    rstd = torch.empty(m, dtype=compute_dtype(x.dtype), device=x.device) if want_rstd else None
    if m == 0 or n == 0:
        if rstd is not None:
            rstd.fill_(1.0 / math.sqrt(eps) if eps > 0 else math.inf)
        return y, rstd, h
    r2 = as_rows(residual, n) if residual is not None else x2
    w, wrows = _prep_param(weight, n, x)
    b, brows = _prep_param(bias, n, x)
    param_rows = max(wrows, brows)
    block_m, block_n, warps = fwd_launch_config(n)
    if block_m * block_n == GENERIC_WIDE_BLOCK and not _vectorised(n, x2, r2, w, b):  # a few pointer reads
        block_m, block_n, warps = fwd_launch_config(n, aligned=False)
    grid = (triton_cdiv(m, block_m),)
    launch(fwd, grid, (
        x2, y, w, b, rstd if rstd is not None else y, r2, h if h is not None else y,
        x2.stride(0), n, r2.stride(0), n, m, n, float(eps),
        param_rows, n if wrows > 1 else 0, n if brows > 1 else 0,
    ), {"HAS_W": int(weight is not None), "HAS_B": int(bias is not None), "HAS_RES": int(residual is not None),
        "IS_FP64": int(x.dtype == torch.float64), "IS_BF16": int(x.dtype == torch.bfloat16),
        "BLOCK_M": block_m, "BLOCK_N": block_n, "HAS_RSTD": int(rstd is not None)},
        {"num_warps": warps, "enable_fp_fusion": FP_FUSION}, x.device)
    return y, rstd, h


def backward(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None, bias: torch.Tensor | None, dres: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward kernel: ``(dx, dweight or None, dbias or None)``.

    ``x`` is the normalised input (``h`` for the residual op); ``dres``, the gradient arriving at ``h``
    itself, is added to ``dx`` in the kernel.
    """
    from normswap.backends._triton_kernels import kernels

    _, bwd = kernels()
    n = math.prod(normalized_shape)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    w, wrows = _prep_param(weight, n, x)
    b, brows = _prep_param(bias, n, x)
    heads = max(wrows, brows)
    x2 = as_rows(x, n) if n else x.reshape(-1, 0)
    m = x2.shape[0]
    acc = compute_dtype(x.dtype)
    if m == 0 or n == 0:
        dw = torch.zeros(weight.shape, dtype=weight.dtype, device=x.device) if weight is not None else None
        db = torch.zeros(bias.shape, dtype=bias.dtype, device=x.device) if bias is not None else None
        return dx, dw, db
    dy2 = as_rows(dy, n)
    dres2 = as_rows(dres, n) if dres is not None else dy2
    per_head = m // heads
    block_n, warps = bwd_launch_config(n)
    if x.is_cuda:
        mult = 8 if block_n <= 1024 else 4 if block_n <= 2048 else 2 if block_n <= 4096 else 1
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        target = _sm_count(index) * mult
    else:
        target = 4
    programs = max(1, min(per_head, max(1, target // heads)))
    rows_per_prog = triton_cdiv(per_head, programs)
    programs = triton_cdiv(per_head, rows_per_prog)
    dw_part = torch.empty((programs, heads, n), dtype=acc, device=x.device) if weight is not None else rstd
    db_part = torch.empty((programs, heads, n), dtype=acc, device=x.device) if bias is not None else rstd
    launch(bwd, (programs, heads), (
        x2, dy2, dx, w, rstd, dw_part, db_part, dres2,
        x2.stride(0), dy2.stride(0), n, dres2.stride(0), per_head, n, rows_per_prog,
        heads, n if wrows > 1 else 0,
    ), {"HAS_W": int(weight is not None), "HAS_B": int(bias is not None), "HAS_DRES": int(dres is not None),
        "IS_FP64": int(x.dtype == torch.float64), "IS_BF16": int(x.dtype == torch.bfloat16),
        "BLOCK_N": block_n}, {"num_warps": warps, "enable_fp_fusion": FP_FUSION}, x.device)
    # One reduction per parameter gradient: a fixed-order sum over programs (deterministic), in the
    # accumulation dtype, written in the parameter's dtype.
    dw = _reduce_partials(dw_part, weight, wrows, heads, n) if weight is not None else None
    db = _reduce_partials(db_part, bias, brows, heads, n) if bias is not None else None
    return dx, dw, db


def _reduce_partials(part: torch.Tensor, p: torch.Tensor, prows: int, heads: int, n: int) -> torch.Tensor:
    """``part`` is (programs, heads, n): sum over programs, and over heads for a shared parameter.

    Summed in the accumulation dtype (``sum(dtype=...)`` would round the partials first), then cast
    to the parameter's dtype when it differs (an n-element op)."""
    total = part.sum(0) if prows > 1 else part.view(-1, n).sum(0)
    total = total.reshape(p.shape)
    return total if total.dtype == p.dtype else total.to(p.dtype)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -------------------------------------------------------------------- eager path: autograd.Function
class _TritonRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps):  # type: ignore[override]
        y, rstd, _ = forward(x, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(x, rstd, weight, bias)
        ctx.normalized_shape = normalized_shape
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, rstd, weight, bias = ctx.saved_tensors
        dx, dw, db = backward(dy, x, rstd, ctx.normalized_shape, weight, bias)
        return dx, None, dw, db, None


class _TritonRMSNormResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, normalized_shape, weight, bias, eps):  # type: ignore[override]
        y, rstd, h = forward(x, normalized_shape, weight, bias, eps, residual)
        ctx.save_for_backward(h, rstd, weight, bias)
        ctx.normalized_shape = normalized_shape
        ctx.set_materialize_grads(False)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):  # type: ignore[override]
        h, rstd, weight, bias = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(h)
        dx, dw, db = backward(dy, h, rstd, ctx.normalized_shape, weight, bias, dh)
        return dx, dx, None, dw, db, None


# ------------------------------------------------------------------------- compile path: custom ops
@torch.library.custom_op("normswap::triton_rms_norm_fwd", mutates_args=())
def _fwd_op(
    x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    y, rstd, _ = forward(x, tuple(normalized_shape), weight, bias, eps)
    return y, rstd


@_fwd_op.register_fake
def _(x, normalized_shape, weight, bias, eps):
    rows = math.prod(x.shape[: x.dim() - len(normalized_shape)])
    return x.new_empty(x.shape), x.new_empty((rows,), dtype=compute_dtype(x.dtype))


@torch.library.custom_op("normswap::triton_rms_norm_bwd", mutates_args=())
def _bwd_op(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, normalized_shape: list[int],
    weight: torch.Tensor | None, bias: torch.Tensor | None, dres: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = backward(dy, x, rstd, tuple(normalized_shape), weight, bias, dres)
    # custom ops cannot return None: absent grads are empty tensors, dropped by _op_backward.
    empty = x.new_empty((0,))
    return dx, dw if dw is not None else empty, db if db is not None else empty.clone()


@_bwd_op.register_fake
def _(dy, x, rstd, normalized_shape, weight, bias, dres=None):
    return fake_grads(x, weight, bias)


def _setup_context(ctx, inputs, output):
    x, normalized_shape, weight, bias, _eps = inputs
    ctx.save_for_backward(x, output[1], weight, bias)
    ctx.normalized_shape = list(normalized_shape)


def _op_backward(ctx, dy, _drstd):
    x, rstd, weight, bias = ctx.saved_tensors
    dx, dw, db = torch.ops.normswap.triton_rms_norm_bwd(dy, x, rstd, ctx.normalized_shape, weight, bias)
    return dx, None, *param_grads(weight, bias, dw, db), None


_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


@torch.library.custom_op("normswap::triton_rms_norm_residual_fwd", mutates_args=())
def _res_fwd_op(
    x: torch.Tensor, residual: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
    bias: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, rstd, h = forward(x, tuple(normalized_shape), weight, bias, eps, residual)
    return y, h, rstd


@_res_fwd_op.register_fake
def _(x, residual, normalized_shape, weight, bias, eps):
    rows = math.prod(x.shape[: x.dim() - len(normalized_shape)])
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty((rows,), dtype=compute_dtype(x.dtype))


def _res_setup_context(ctx, inputs, output):
    _x, _residual, normalized_shape, weight, bias, _eps = inputs
    ctx.save_for_backward(output[1], output[2], weight, bias)
    ctx.normalized_shape = list(normalized_shape)


def _res_op_backward(ctx, dy, dh, _drstd):
    h, rstd, weight, bias = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(h)
    dx, dw, db = torch.ops.normswap.triton_rms_norm_bwd(dy, h, rstd, ctx.normalized_shape, weight, bias, dh)
    return dx, dx, None, *param_grads(weight, bias, dw, db), None


_res_fwd_op.register_autograd(_res_op_backward, setup_context=_res_setup_context)


def rms_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    n = math.prod(normalized_shape)
    if len(normalized_shape) == 0:
        return eager.rms_norm(x, normalized_shape, weight, bias, eps)
    if n > MAX_N:  # a row no longer fits in registers: PyTorch's kernel handles it
        return native.rms_norm(x, normalized_shape, weight, bias, eps)
    wrows = weight.numel() // n if weight is not None and n else 1
    brows = bias.numel() // n if bias is not None and n else 1
    if wrows != brows and min(wrows, brows) != 1:  # e.g. weight per (layer, head), bias per head
        return eager.rms_norm(x, normalized_shape, weight, bias, eps)
    if torch.compiler.is_compiling():
        return torch.ops.normswap.triton_rms_norm_fwd(x, list(normalized_shape), weight, bias, eps)[0]
    if wants_grad(x, weight, bias):
        return _TritonRMSNorm.apply(x, normalized_shape, weight, bias, eps)
    return forward(x, normalized_shape, weight, bias, eps, want_rstd=False)[0]


def bind(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    grad: bool,
):
    """A launcher for calls like this one (cached per module, device, dtype and grad state), or None.

    Covers the plain case (one normalised dim of at most ``MAX_N``, parameters of that shape): without
    gradients it launches the forward kernel directly, with them the ``autograd.Function``. Per call it
    only checks the last dim; anything else returns None (the caller's general path).
    """
    if len(normalized_shape) != 1 or not 0 < normalized_shape[0] <= MAX_N or not supports(x, weight, bias):
        return None
    n = normalized_shape[0]
    if any(p is not None and p.dim() != 1 for p in (weight, bias)):
        return None
    if grad:
        return grad_launcher(_TritonRMSNorm.apply, normalized_shape)

    def call(x, w, b, eps):
        if x.dim() and x.shape[-1] == n:
            return forward(x, normalized_shape, w, b, eps, want_rstd=False)[0]
        return None

    return call


def rms_norm_residual(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``h = x + residual; y = rms_norm(h)``: returns ``(y, h)``, one pass over memory.

    Callers check :func:`supports_residual` first (the generic composite is in
    ``normswap.backends.rms_norm_residual``).
    """
    if torch.compiler.is_compiling():
        y, h, _ = torch.ops.normswap.triton_rms_norm_residual_fwd(x, residual, list(normalized_shape), weight,
                                                                   bias, eps)
        return y, h
    if wants_grad(x, residual, weight, bias):
        return _TritonRMSNormResidual.apply(x, residual, normalized_shape, weight, bias, eps)
    y, _, h = forward(x, normalized_shape, weight, bias, eps, residual, want_rstd=False)
    return y, h


def supports_residual(
    x: torch.Tensor, residual: torch.Tensor, normalized_shape: tuple[int, ...], weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> bool:
    """The fused residual kernel handles this call (same dtype/shape/device, row fits, params fit)."""
    n = math.prod(normalized_shape)
    if not (len(normalized_shape) and 0 < n <= MAX_N and supports(x, weight, bias)):
        return False
    if not dense(residual) or residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        return False
    wrows = weight.numel() // n if weight is not None else 1
    brows = bias.numel() // n if bias is not None else 1
    return wrows == brows or min(wrows, brows) == 1
