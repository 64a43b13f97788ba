"""Triton RMSNorm forward and backward kernels (imported only when triton is installed).

The kernel bodies are plain functions wrapped with ``triton.jit`` by :func:`kernels`, once per value of
``TRITON_INTERPRET``: triton decides between a compiled ``JITFunction`` and the CPU interpreter's
``InterpretedFunction`` when the decorator runs, so wrapping lazily lets tests switch to the
interpreter without re-importing anything.

Conventions (see ``shared/reference/kernels.md`` section 6): ``tl.math.rsqrt`` (libdevice fails in the
interpreter); the scalar ``eps`` is cast (``tl.cast``, which also works on the interpreter's plain
Python floats) to the accumulation dtype inside the kernel (a Python float
would become fp64 if Inductor ever launched this kernel); flags are ``tl.constexpr`` ints, not bools;
no ``triton.heuristics`` and no autotuning (block sizes and warps come from the host); every
arithmetic step is done in fp32 (fp64 for fp64 inputs) and only stored values are rounded to the I/O
dtype, explicitly, which is also what keeps bf16 working in the interpreter, which has no bf16
arithmetic.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# ``tl.sum`` and ``tl.zeros`` are themselves ``@triton.jit`` functions, fixed as compiled or interpreted
# when triton is first imported; if that happened before TRITON_INTERPRET=1 was set (torch imports
# triton early), the interpreter cannot call them. ``tl.reduce`` / ``tl.full`` are builtins, and the
# interpreter recognises this combine function and reduces with numpy. Same code as tl.sum compiles to.
_sum_combine = tl.standard._sum_combine

# bfloat16 outputs: where the code says ``if IS_BF16:`` it rounds the fp32 value to the nearest even
# bf16 in integer arithmetic first, so the cast that follows is exact. The compiled cast already rounds
# to nearest even (so this costs a few integer ops and changes nothing on a GPU), but the interpreter's
# fp32 -> bf16 cast truncates, which would make the CPU tests check a different function. NaNs are
# left alone (a GPU's canonical NaN 0x7fffffff would carry into the sign bit).


def _rms_norm_fwd(
    X, Y, W, B, RSTD, R, H,
    stride_x, stride_y, stride_r, stride_h, M, N, eps,
    PARAM_ROWS, W_ROW_STRIDE, B_ROW_STRIDE,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RES: tl.constexpr, IS_FP64: tl.constexpr,
    IS_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RSTD: tl.constexpr,
):
    """BLOCK_M rows per program, each row whole in registers (BLOCK_N >= N).

    Cast order = ``eager`` (the LayerNorm one): fp32 mean of squares, rstd and ``x * rstd * w + b``,
    with the weight and bias upcast from their own dtype, rounded once to the output dtype at the
    store. With HAS_RES the normalised input is ``h = x + residual`` (rounded to x's dtype: h is the
    residual stream itself, stored to H), whose rounded value is what gets normalised.
    """
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    rows64 = tl.cast(rows, tl.int64)
    odt = Y.dtype.element_ty
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        if IS_FP64:
            x = (x.to(tl.float64) + r.to(tl.float64)).to(odt)
        else:
            hs = x.to(tl.float32) + r.to(tl.float32)
            if IS_BF16:
                _u = hs.to(tl.uint32, bitcast=True)
                _r = (((_u + 0x7FFF + ((_u >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
                hs = tl.where(hs == hs, _r, hs)
            x = hs.to(odt)
        tl.store(H + rows64[:, None] * stride_h + cols[None, :], x, mask=mask)
    if IS_FP64:
        xf = x.to(tl.float64)
        e = tl.cast(eps, tl.float64)
    else:
        xf = x.to(tl.float32)
        e = tl.cast(eps, tl.float32)
    rstd = tl.math.rsqrt(tl.reduce(xf * xf, 1, _sum_combine) / N + e)
    if HAS_RSTD:  # only when a backward will need it (no-grad calls allocate the output alone)
        tl.store(RSTD + rows, rstd, mask=row_ok)
    out = xf * rstd[:, None]
    prow = (rows % PARAM_ROWS)[:, None]
    if HAS_W:
        w = tl.load(W + prow * W_ROW_STRIDE + cols[None, :], mask=mask, other=0.0)
        out = out * w.to(xf.dtype)
    if HAS_B:
        b = tl.load(B + prow * B_ROW_STRIDE + cols[None, :], mask=mask, other=0.0)
        out = out + b.to(xf.dtype)
    if IS_BF16:
        _u = out.to(tl.uint32, bitcast=True)
        _r = (((_u + 0x7FFF + ((_u >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
        out = tl.where(out == out, _r, out)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], out.to(odt), mask=mask)


def _rms_norm_bwd(
    X, DY, DX, W, RSTD, DW_PART, DB_PART, DRES,
    stride_x, stride_dy, stride_dx, stride_dres, ROWS_PER_HEAD, N, ROWS_PER_PROG,
    PARAM_ROWS, W_ROW_STRIDE,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DRES: tl.constexpr, IS_FP64: tl.constexpr,
    IS_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Persistent backward: program (p, h) handles rows ``k * PARAM_ROWS + h`` for its range of k.

    Each program keeps dW/dB partials for its single parameter row in registers (fp32, or fp64 for
    fp64) and writes them to ``DW_PART[p, h, :]``; the host sums over p. Deterministic, no atomics.
    dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w, dW += dy * xhat (unrounded): the gradients of
    the forward with its one output rounding treated as identity.
    With HAS_DRES the gradient arriving at the residual-sum output ``h`` is added (fused residual).
    """
    pid = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    odt = DX.dtype.element_ty
    if IS_FP64:
        dw_acc = tl.full((BLOCK_N,), 0.0, tl.float64)
        db_acc = tl.full((BLOCK_N,), 0.0, tl.float64)
    else:
        dw_acc = tl.full((BLOCK_N,), 0.0, tl.float32)
        db_acc = tl.full((BLOCK_N,), 0.0, tl.float32)
    if HAS_W:
        w = tl.load(W + h * W_ROW_STRIDE + cols, mask=cmask, other=0.0).to(dw_acc.dtype)
    k0 = pid * ROWS_PER_PROG
    k1 = tl.minimum(k0 + ROWS_PER_PROG, ROWS_PER_HEAD)
    for k in range(k0, k1):
        row = tl.cast(k, tl.int64) * PARAM_ROWS + h
        x = tl.load(X + row * stride_x + cols, mask=cmask, other=0.0).to(dw_acc.dtype)
        dy = tl.load(DY + row * stride_dy + cols, mask=cmask, other=0.0).to(dw_acc.dtype)
        rstd = tl.load(RSTD + row).to(dw_acc.dtype)
        xhat = x * rstd
        if HAS_W:
            dw_acc += dy * xhat
            g = dy * w
        else:
            g = dy
        if HAS_B:
            db_acc += dy
        c = tl.reduce(g * xhat, 0, _sum_combine) / N
        dx = (g - xhat * c) * rstd
        if HAS_DRES:
            dx += tl.load(DRES + row * stride_dres + cols, mask=cmask, other=0.0).to(dw_acc.dtype)
        if IS_BF16:
            _u = dx.to(tl.uint32, bitcast=True)
            _r = (((_u + 0x7FFF + ((_u >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)
            dx = tl.where(dx == dx, _r, dx)
        tl.store(DX + row * stride_dx + cols, dx.to(odt), mask=cmask)
    part = tl.cast(pid * PARAM_ROWS + h, tl.int64) * N
    if HAS_W:
        tl.store(DW_PART + part + cols, dw_acc, mask=cmask)
    if HAS_B:
        tl.store(DB_PART + part + cols, db_acc, mask=cmask)


_cache: dict[bool, tuple] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels() -> tuple:
    """``(fwd, bwd)`` jitted for the current ``TRITON_INTERPRET`` mode."""
    mode = interpreting()
    if mode not in _cache:
        _cache[mode] = (triton.jit(_rms_norm_fwd), triton.jit(_rms_norm_bwd))
    return _cache[mode]
