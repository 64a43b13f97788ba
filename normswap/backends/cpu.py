"""Fused CPU RMSNorm: a small C++ kernel compiled at first use, called through ctypes.

Why not ``F.rms_norm`` or the ``eager`` backend on CPU: both are chains of ATen ops (upcast, square,
mean, rsqrt, multiply, cast, multiply), each a full pass over memory; measured 2.4-21x slower than
``torch.layer_norm`` at the same shape. This kernel makes one read of ``x`` from memory and one write
of ``y`` (the second pass over a row hits L1/L2), the traffic of ``y.copy_(x)``.

How it is built (compiler, instruction set, cache, the OpenMP link and the variants tried) is
:mod:`normswap.backends.cpu_build`; this module is the runtime: the self-test, the calls, the
output pool, the autograd function and the ``torch.compile`` custom ops.

Semantics are exactly ``eager``'s (the LayerNorm cast order): fp32 sum of squares, rstd,
``x * rstd * weight + bias`` with the weight and bias upcast from their own dtype, and one rounding to
the input dtype at the store. float64 inputs compute in float64. Supported: float32, bfloat16, float16
(with F16C or a compiler ``_Float16``), float64; parameters in the input dtype or any other float dtype
(passed to the kernel as float32: flags bit 1); rows whose normalised dims are contiguous with any row
stride (anything else is made contiguous first); per-head weights (``param_shape`` larger than
``normalized_shape``).

Gradients: the forward also writes fp32 ``rstd`` per row; the backward is a second C++ kernel (the
math of :func:`backward_math`: fp32, two passes per row, ``dW`` accumulates ``dy * x * rstd`` with no
intermediate rounding, per-thread fp32 dW/dB partials summed in thread order, so dW is reproducible for
a given thread count). float64 uses ``backward_math``.
Under ``torch.compile`` forward and backward are the custom ops ``normswap::cpu_rms_norm`` and
``normswap::cpu_rms_norm_bwd`` (``register_fake`` + ``register_autograd``), so there is no graph
break. In eager mode a module call with gradients goes through the kernels as a C++ operator with a
C++ autograd kernel (``csrc/rmsnorm_op.cpp``, :func:`autograd_op`: one dispatcher call, no Python in
forward or backward), built in the background at the first grad-mode use; until it is loaded, and for
what it does not cover, an ``autograd.Function`` calls the kernels.

Output buffers: a fresh ``torch.empty`` of more than ~32 MB is an ``mmap`` in glibc, and first touch
page-faults every 4 KB page: measured 8.7 ms for a 33.5 MB ``clone()`` against 1.1 ms for a ``copy_``
into an existing tensor. So outputs of at least 4 MiB come from a small pool of storages that are
reused once nothing else references them (checked with the storage's reference count, the same rule
a caching allocator uses). The pool keeps at most 2 free storages per size and 512 MiB in all;
``NORMSWAP_CPU_POOL=0`` turns it off and :func:`empty_pool` releases it.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict

import torch

from normswap.backends import cpu_build, eager
from normswap.backends._env import env_reader
from normswap.backends.cpu_build import DTYPE_CODES, Kernel
from normswap.backends.rows import (
    DENSE_TYPES,
    as_rows,
    compute_dtype,
    dense,
    fake_grads,
    grad_launcher,
    param_grads,
    wants_grad,
)
from normswap.backends.tracing import outside_tracing

name = "cpu"

# Below this many elements one thread is faster than waking a second one (measured: ~3 us fork/join).
_PARALLEL_MIN_ELEMENTS = 1 << 15
_POOL_MIN_BYTES = 4 << 20  # measured: below this, glibc reuses heap memory and pooling gains nothing


def _last_level_cache_bytes() -> int:
    """Size of the largest CPU cache (sysfs on Linux), 32 MiB when unknown."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in os.listdir(base):
            try:
                with open(os.path.join(base, entry, "size")) as fh:
                    text = fh.read().strip().upper()
            except OSError:
                continue
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG") or 0) * scale)
    except OSError:
        pass
    return best or (32 << 20)


# Outputs at least this large are written with non-temporal stores: they cannot stay in the cache
# anyway, and streaming them skips the read-for-ownership of every output line.
_STREAM_MIN_BYTES = _last_level_cache_bytes()


_kernel: Kernel | None = None
_kernel_lock = threading.Lock()


def _self_test(k: Kernel) -> str | None:
    """Compare with ``eager`` on awkward small shapes (tails, strides, per-head weights, bias)."""
    gen = torch.Generator().manual_seed(0)
    for dtype in sorted(k.dtypes, key=str):
        for shape, wshape in (((5, 37), (37,)), ((2, 3, 70), (3, 70)), ((3, 129), None)):
            x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) * 3
            w = torch.randn(wshape, generator=gen, dtype=torch.float64).to(dtype) if wshape else None
            b = torch.randn(shape[-1], generator=gen, dtype=torch.float64).to(dtype)
            b = b.expand(wshape).contiguous() if wshape else b
            ref = eager.rms_norm(x, (shape[-1],), w, b, 1e-5)
            got, _ = _run(k, x, (shape[-1],), w, b, 1e-5, want_rstd=True, pooled=False)
            tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 3e-2)
            if not torch.allclose(got.double(), ref.double(), rtol=tol, atol=tol):
                err = (got.double() - ref.double()).abs().max().item()
                return f"self-test failed for {dtype} {shape}: max error {err:.3g}"
            dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
            _, rstd = _run(k, x, (shape[-1],), w, b, 1e-5, want_rstd=True, pooled=False)
            grads = backward(dy, x, rstd, (shape[-1],), w, b, 1e-5, (True, w is not None, True), k)
            refs = backward_math(dy, x, rstd, (shape[-1],), w, b, 1e-5, (True, w is not None, True))
            for g, r in zip(grads, refs, strict=True):
                if (g is None) != (r is None) or (g is not None and not torch.allclose(
                        g.double(), r.double(), rtol=tol, atol=tol * 10)):
                    return f"self-test failed for the {dtype} backward {shape}"
    return None


def kernel() -> Kernel:
    """The compiled kernel, built (or loaded from the cache) on first call."""
    global _kernel
    if _kernel is None:
        with _kernel_lock:
            if _kernel is None:
                with outside_tracing():  # first use may be inside torch.export/jit.trace: build on real data
                    _kernel = cpu_build.build(_self_test)
    return _kernel


def reset() -> None:
    """Forget the loaded kernel and operator (the next call rebuilds or reloads them; used by tests)."""
    global _kernel, _op, _op_thread
    with _kernel_lock:
        _kernel = None
    with _op_lock:
        _OP[0] = None
        _op, _op_thread = None, None
        _op_generation[0] += 1


def available() -> tuple[bool, str]:
    k = kernel()
    return k.fn is not None, k.reason


def _param_ok(p: torch.Tensor, x: torch.Tensor) -> bool:
    # Parameters must match x's trailing dims exactly (plain or per-head), not merely broadcast.
    if not p.is_cpu or not dense(p):  # a DTensor (FSDP2, TP) has no pointer to read
        return False
    pd = p.dim()
    if pd == 1:  # the common case, checked without slicing torch.Size (a per-call cost)
        return x.dim() >= 1 and p.shape[0] == x.shape[-1]
    return pd <= x.dim() and p.shape == x.shape[x.dim() - pd:]


def supports(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    if not x.is_cpu or not dense(x):  # a DTensor goes to native/eager (rows.dense)
        return False
    k = _kernel if _kernel is not None else kernel()
    if k.fn is None or x.dtype not in k.dtypes:
        return False
    return (weight is None or _param_ok(weight, x)) and (bias is None or _param_ok(bias, x))


# ----------------------------------------------------------------------------------- output pool
class _Pool:
    """Reuse large output storages once nothing references them (see the module docstring)."""

    def __init__(self, per_size: int = 2, max_bytes: int = 512 << 20) -> None:
        self.per_size, self.max_bytes = per_size, max_bytes
        self.free: OrderedDict[int, list[torch.UntypedStorage]] = OrderedDict()
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.UntypedStorage:
        with self.lock:
            stores = self.free.get(nbytes)
            if stores is not None:
                self.free.move_to_end(nbytes)
                for s in stores:
                    if torch._C._storage_Use_Count(s._cdata) == 1:  # only the pool holds it
                        return s
            s = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
            if stores is None:
                stores = self.free[nbytes] = []
            if len(stores) < self.per_size:
                stores.append(s)
                self._trim()
            return s

    def _trim(self) -> None:
        total = sum(k * len(v) for k, v in self.free.items())
        while total > self.max_bytes and self.free:
            nbytes, stores = self.free.popitem(last=False)
            total -= nbytes * len(stores)

    def clear(self) -> None:
        with self.lock:
            self.free.clear()


_pool = _Pool()


def empty_pool() -> None:
    """Release the cached output storages."""
    _pool.clear()


_read_pool_env = env_reader("NORMSWAP_CPU_POOL")  # read per call: tests toggle it


def _new_output(shape: tuple[int, ...], dtype: torch.dtype, pooled: bool) -> torch.Tensor:
    if not pooled or _read_pool_env() == "0":
        return torch.empty(shape, dtype=dtype)
    storage = _pool.take(math.prod(shape) * dtype.itemsize)
    return torch.empty((0,), dtype=dtype).set_(storage, 0, shape)  # contiguous strides by default


# ----------------------------------------------------------------------------------- the call
_F32_PARAMS = 2  # kernel flags bit 1: weight and bias are float32 (see csrc/rmsnorm.cpp)


def _params(weight: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype, n: int,
            ) -> tuple[torch.Tensor | None, int, torch.Tensor | None, int, int]:
    """Weight and bias as the kernel reads them: ``(w, w_rows, b, b_rows, flags)``.

    Parameters in x's dtype go as they are. Any other dtype is converted to the compute dtype, as
    ``eager`` does (float32 for a half-precision x: exact for bf16/fp16 parameters, and an fp32 weight
    is used unrounded); for a half-precision x both then go as float32 and ``flags`` says so.
    """
    mixed = (weight is not None and weight.dtype != dtype) or (bias is not None and bias.dtype != dtype)
    target = compute_dtype(dtype) if mixed else dtype
    out: list = []
    for p in (weight, bias):
        if p is None:
            out += [None, 1]
            continue
        if p.dtype != target:
            p = p.detach().to(target)
        if not p.is_contiguous():
            p = p.contiguous()
        out += [p, p.numel() // n]
    return out[0], out[1], out[2], out[3], _F32_PARAMS if target != dtype else 0


def _run(
    k: Kernel,
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    want_rstd: bool,
    pooled: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Call the kernel: ``(y, rstd or None)``. Kept lean: it is the whole per-call overhead."""
    n = normalized_shape[0] if len(normalized_shape) == 1 else math.prod(normalized_shape)
    numel = x.numel()
    m = numel // n if n else 0
    out_bytes = numel * x.element_size()
    if out_bytes >= _POOL_MIN_BYTES:
        y = _new_output(tuple(x.shape), x.dtype, pooled)
    else:
        y = torch.empty_like(x, memory_format=torch.contiguous_format)  # ~1 us cheaper than torch.empty
    rstd = torch.empty(m, dtype=torch.float32) if want_rstd else None
    if m == 0 or n == 0:
        if rstd is not None:
            rstd.fill_(1.0 / math.sqrt(eps) if eps > 0 else math.inf)
        return y, rstd
    if x.is_contiguous():
        ptr, row_stride = x.data_ptr(), n
    else:
        x2 = as_rows(x, n)
        ptr, row_stride = x2.data_ptr(), x2.stride(0)
    w, wrows, b, brows, flags = _params(weight, bias, x.dtype, n)
    status = k.fn(
        DTYPE_CODES[x.dtype], ptr, m, n, row_stride,
        w.data_ptr() if w is not None else None, wrows,
        b.data_ptr() if b is not None else None, brows,
        y.data_ptr(), rstd.data_ptr() if rstd is not None else None, eps,
        torch.get_num_threads() if numel >= _PARALLEL_MIN_ELEMENTS else 1,
        flags | (1 if out_bytes >= _STREAM_MIN_BYTES else 0),
    )
    if status != 0:
        raise RuntimeError(f"normswap cpu kernel: unsupported dtype {x.dtype}")
    return y, rstd


def backward_math(
    dy: torch.Tensor,
    x: torch.Tensor,
    rstd: torch.Tensor | None,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``eager.rms_norm`` with its output rounding treated as identity, in fp32 (fp64 for
    fp64): ``dW`` sums ``dy * x * rstd`` unrounded, as autograd through ``eager`` does.

    ``rstd`` (fp32, one per row) is reused when given; for float64 it is recomputed in float64 so
    gradcheck sees full precision. Shared by the ``cpu`` backend and the custom-op backward.
    """
    cdt = compute_dtype(x.dtype)
    n = math.prod(normalized_shape)
    x2 = x.reshape(-1, n).to(cdt)
    if rstd is None or cdt == torch.float64:
        r = torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + eps)
    else:
        r = rstd.reshape(-1, 1).to(cdt)
    g = dy.reshape(-1, n).to(cdt)
    xhat = x2 * r
    dx = dw = db = None
    if weight is not None:
        wrows = max(weight.numel() // n, 1)
        w2 = weight.detach().to(cdt).reshape(wrows, n)
        gw = (g.view(-1, wrows, n) * w2).view(-1, n)
        if needs[1]:
            dw = (g * xhat).view(-1, wrows, n).sum(0).reshape(weight.shape).to(weight.dtype)
    else:
        gw = g
    if needs[0]:
        dx = (r * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))).to(x.dtype).reshape(x.shape)
    if bias is not None and needs[2]:
        brows = max(bias.numel() // n, 1)
        db = g.view(-1, brows, n).sum(0).reshape(bias.shape).to(bias.dtype)
    return dx, dw, db


def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    rstd: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    needs: tuple[bool, bool, bool],
    k: Kernel | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients with the C++ backward kernel (same math as :func:`backward_math`, one pass pair per
    row, per-thread fp32 dW/dB partials summed in thread order); float64 goes to ``backward_math``."""
    k = k or kernel()
    n = math.prod(normalized_shape)
    if k.bwd is None or x.dtype == torch.float64 or x.dtype not in k.dtypes or n == 0 or x.numel() == 0:
        return backward_math(dy, x, rstd, normalized_shape, weight, bias, eps, needs)
    x2 = as_rows(x.detach(), n)
    dy2 = as_rows(dy.detach().to(x.dtype), n)
    m = x2.shape[0]
    w, wrows, _, _, flags = _params(weight, None, x.dtype, n)
    prows = max(wrows, bias.numel() // n if bias is not None else 1)
    if w is not None and wrows != prows:
        w, wrows = w.repeat(prows // wrows, 1).contiguous(), prows  # e.g. per-head bias, shared weight
    threads = min(torch.get_num_threads() if m * n >= _PARALLEL_MIN_ELEMENTS else 1, m)
    want_dw, want_db = weight is not None and needs[1], bias is not None and needs[2]
    dw_part = torch.empty((threads, prows, n), dtype=torch.float32) if want_dw else None
    db_part = torch.empty((threads, prows, n), dtype=torch.float32) if want_db else None
    # Large gradients come from the output pool too: a fresh buffer above ~32 MB page-faults on first
    # touch (measured: fp32 2048x4096 forward+backward 14 -> 4.7 ms, see RESULTS.md).
    dx = _new_output(tuple(x.shape), x.dtype, x.numel() * x.element_size() >= _POOL_MIN_BYTES)
    status = k.bwd(
        DTYPE_CODES[x.dtype], x2.data_ptr(), dy2.data_ptr(), m, n, x2.stride(0), dy2.stride(0),
        w.data_ptr() if w is not None else None, prows, rstd.contiguous().data_ptr(), dx.data_ptr(),
        dw_part.data_ptr() if dw_part is not None else None,
        db_part.data_ptr() if db_part is not None else None, threads, flags,
    )
    if status != 0:
        return backward_math(dy, x, rstd, normalized_shape, weight, bias, eps, needs)

    def reduce(part: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor | None:
        if part is None or p is None:
            return None
        total = part.sum(0)  # (prows, n), summed over threads in a fixed order
        rows = p.numel() // n
        if rows != prows:
            total = total.view(prows // rows, rows, n).sum(0)
        return total.reshape(p.shape).to(p.dtype)

    return (dx if needs[0] else None), reduce(dw_part, weight), reduce(db_part, bias)


class _RMSNormCPU(torch.autograd.Function):
    """Kernel forward + eager-math backward (the eager-mode path when gradients are needed)."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps):  # type: ignore[override]
        y, rstd = _run(kernel(), x, normalized_shape, weight, bias, eps, want_rstd=True, pooled=True)
        ctx.save_for_backward(x, rstd, weight, bias)
        ctx.normalized_shape, ctx.eps = normalized_shape, eps
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, rstd, weight, bias = ctx.saved_tensors
        dx, dw, db = backward(dy, x, rstd, ctx.normalized_shape, weight, bias, ctx.eps,
                              (ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]))
        return dx, None, dw, db, None


# ------------------------------------------------------------------- the C++ autograd operator
# Grad-mode calls through the Python autograd.Function above cost ~2x nn.LayerNorm's host time; the
# same kernel as a torch operator with a C++ autograd kernel (csrc/rmsnorm_op.cpp) makes a module call
# one dispatcher call, with its backward in C++ too. Building it needs PyTorch's headers (tens of
# seconds the first time, then cached), so it is built in a background thread on the first grad-mode
# use and the Function serves calls until it is loaded.
_OP: list = [None]  # the loaded operator, read per call by the grad-mode launchers; None until ready
_op: cpu_build.Op | None = None  # the build result (reason when there is no operator)
_op_thread: threading.Thread | None = None
_op_lock = threading.Lock()
_op_generation = [0]  # bumped by reset(): a build started before it does not publish its operator
_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float64 keeps the Function (gradcheck path)


def _op_self_test(op) -> str | None:
    """The operator against the Function path on a small input: forward and all three gradients."""
    gen = torch.Generator().manual_seed(1)
    for dtype in _OP_DTYPES:
        if dtype not in kernel().dtypes:
            continue
        x = torch.randn(5, 37, generator=gen).to(dtype).requires_grad_(True)
        w = torch.randn(37, generator=gen).to(dtype).requires_grad_(True)
        b = torch.randn(37, generator=gen).to(dtype).requires_grad_(True)
        dy = torch.randn(5, 37, generator=gen).to(dtype)
        got = (op(x, w, b, 1e-5), *torch.autograd.grad(op(x, w, b, 1e-5), (x, w, b), dy))
        y = _RMSNormCPU.apply(x, (37,), w, b, 1e-5)
        ref = (y, *torch.autograd.grad(y, (x, w, b), dy))
        if not all(torch.equal(a, r) for a, r in zip(got, ref, strict=True)):
            return f"operator self-test failed for {dtype}"
    return None


def _build_op(isa: int, openmp: bool, generation: int) -> None:
    global _op
    try:
        with outside_tracing():
            o = cpu_build.build_op(isa, openmp, _STREAM_MIN_BYTES)
            if o.op is not None:
                with torch.enable_grad():
                    failure = _op_self_test(o.op)
                if failure is not None:
                    o.op, o.reason = None, failure
    except Exception as exc:  # noqa: BLE001 - a thread's failure must become a reason, not a traceback
        o = cpu_build.Op()
        o.reason = f"operator build failed: {type(exc).__name__}: {exc}"
    with _op_lock:
        if generation == _op_generation[0]:
            _op = o
            _OP[0] = None if o.op is None else _direct(o.op)


def _direct(op):
    """The C++ callable behind an ``OpOverload`` (its ``_op``; the overload's ``__call__`` only forwards to
    it, ~0.3 us of Python per call), or the overload itself where torch does not expose one."""
    raw = getattr(op, "_op", None)
    return raw if callable(raw) else op


def autograd_op(wait: bool = False):
    """The kernel as a torch operator with a C++ autograd kernel, ``op(x, weight, bias, eps)``, or None.

    The first call starts building it (or loading it from the cache) in a background thread, for the
    loaded kernel's instruction-set level; until it is there, None (callers then use the Python
    ``autograd.Function``). ``wait=True`` blocks until that build has finished. :func:`op_reason` says
    why there is none.
    """
    global _op_thread
    op = _OP[0]
    if op is not None:
        return op
    k = kernel()
    if k.fn is None:
        return None
    with _op_lock:
        if _op_thread is None:
            _op_thread = threading.Thread(target=_build_op, args=(k.isa, k.openmp, _op_generation[0]), daemon=True,
                                          name="normswap-cpu-op-build")
            _op_thread.start()
        thread = _op_thread
    if wait:
        thread.join()
    return _OP[0]


def finish_operator_build() -> None:
    """Block until an operator build already in flight has finished (starts none)."""
    thread = _op_thread
    if thread is not None:
        thread.join()


def op_reason() -> str:
    """Why :func:`autograd_op` is (or is not) available: the build's one-line status."""
    if _op is not None:
        return _op.reason
    return "building" if _op_thread is not None else "not requested yet (built on the first grad-mode call)"


def _grad_call(normalized_shape: tuple[int, ...], item: int):
    """The grad-mode launcher for 1-D parameters of x's dtype: the C++ operator once it is loaded (for
    outputs below the pool threshold; larger ones keep the Function, which reuses pooled storage and
    whose host cost no longer shows), the Function otherwise."""
    n = normalized_shape[0]
    apply, op_ref, max_elements = _RMSNormCPU.apply, _OP, -(-_POOL_MIN_BYTES // item)  # ceil: numel*item < pool

    def call_grad(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float):
        shape = x.shape  # read once: the decode-sized call is host-bound (~5 us in all)
        if not (shape and shape[-1] == n):
            return None
        op = op_ref[0]
        if op is not None and x.numel() < max_elements:
            return op(x, w, b, eps)
        return apply(x, normalized_shape, w, b, eps)

    return call_grad


# ------------------------------------------------------------------------- torch.compile custom op
@torch.library.custom_op("normswap::cpu_rms_norm", mutates_args=(), device_types="cpu")
def _cpu_rms_norm_op(
    x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    k = kernel()
    if k.fn is None or not supports(x, weight, bias):  # e.g. the build failed after tracing
        y = eager.rms_norm(x, tuple(normalized_shape), weight, bias, eps)
        dims = tuple(range(-len(normalized_shape), 0))
        rstd = torch.rsqrt(x.float().pow(2).mean(dims) + eps).reshape(-1)
        return y, rstd
    y, rstd = _run(k, x, tuple(normalized_shape), weight, bias, eps, want_rstd=True, pooled=False)
    return y, rstd


@_cpu_rms_norm_op.register_fake
def _(x, normalized_shape, weight, bias, eps):
    rows = math.prod(x.shape[: x.dim() - len(normalized_shape)])
    return x.new_empty(x.shape), x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op("normswap::cpu_rms_norm_bwd", mutates_args=(), device_types="cpu")
def _cpu_rms_norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, normalized_shape: list[int],
    weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    needs = (True, weight is not None, bias is not None)
    dx, dw, db = backward(dy, x, rstd, tuple(normalized_shape), weight, bias, eps, needs)
    # custom ops cannot return None: absent grads are empty tensors, dropped by _op_backward.
    return dx, dw if dw is not None else x.new_empty((0,)), db if db is not None else x.new_empty((0,))


@_cpu_rms_norm_bwd_op.register_fake
def _(dy, x, rstd, normalized_shape, weight, bias, eps):
    return fake_grads(x, weight, bias)


def _op_setup_context(ctx, inputs, output):
    x, normalized_shape, weight, bias, eps = inputs
    ctx.save_for_backward(x, output[1], weight, bias)
    ctx.normalized_shape, ctx.eps = tuple(normalized_shape), eps


def _op_backward(ctx, dy, _drstd):
    x, rstd, weight, bias = ctx.saved_tensors
    dx, dw, db = torch.ops.normswap.cpu_rms_norm_bwd(dy, x, rstd, list(ctx.normalized_shape), weight, bias,
                                                     ctx.eps)
    return dx, None, *param_grads(weight, bias, dw, db), None


_cpu_rms_norm_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# --------------------------------------------------------------------------------- entry point
def try_fast(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor | None:
    """The common ``auto`` call on CPU in one function, or None when it is not that call.

    That call is: a contiguous CPU tensor whose dtype the built kernel handles, 1-D parameters of the
    last dim's size in x's dtype, not under ``torch.compile``. Every check here is one that
    :func:`normswap.backends.resolve` and :func:`rms_norm` make too; making them once, then launching
    directly (the kernel, or the ``autograd.Function`` when a gradient is wanted), cuts the Python cost
    per call (measured at 1x768, module call: 10 -> 5.4 us without gradients, 12 -> 10.6 us with
    them; ``nn.LayerNorm`` takes 4.6 and 5.5 us; a float32 256x2048 copy takes ~25 us). Anything else
    returns None and takes the general path.
    """
    if torch.compiler.is_compiling():  # first: Dynamo then traces nothing below (custom op path instead)
        return None
    k = _kernel
    # exact types here (the common call); any subclass takes the general path, which asks rows.dense
    if (k is None or k.fn is None or type(x) not in DENSE_TYPES or not x.is_cpu or x.dtype not in k.dtypes
            or len(normalized_shape) != 1):
        return None
    n = normalized_shape[0]
    grad = x.requires_grad
    for p in (weight, bias):
        if p is not None:
            if type(p) not in DENSE_TYPES or p.dim() != 1 or p.shape[0] != n or p.dtype != x.dtype or not p.is_cpu:
                return None
            grad = grad or p.requires_grad
    if not x.is_contiguous() or x.dim() == 0 or x.shape[-1] != n:
        return None
    if grad and torch.is_grad_enabled():
        op = _OP[0]
        if (op is not None and x.dtype in _OP_DTYPES and x.numel() * x.element_size() < _POOL_MIN_BYTES
                and (weight is None or weight.is_contiguous()) and (bias is None or bias.is_contiguous())):
            return op(x, weight, bias, eps)  # the operator reads the parameters by pointer
        if op is None and x.dtype in _OP_DTYPES:
            autograd_op()  # starts the background build on the first grad-mode call
        return _RMSNormCPU.apply(x, normalized_shape, weight, bias, eps)
    return _run(k, x, normalized_shape, weight, bias, eps, want_rstd=False, pooled=True)[0]


def bind(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    grad: bool,
):
    """A launcher specialised for calls like this one (``normswap.RMSNorm`` caches it per device,
    dtype and grad state), or None when the general :func:`rms_norm` should serve them.

    What the cache key fixes (device, dtype, grad) and what the module fixes (parameter shapes and
    dtypes; moving or casting the module drops the cache) is checked here once. Per call it checks only
    that the last dim is the normalised one (anything else returns None: the caller's general path
    raises the error); an input's contiguity is handled inside :func:`_run`. Parameters must be
    contiguous to be bound (their pointers are read per call); a strided one takes the general path.
    """
    k = kernel()
    if k.fn is None or len(normalized_shape) != 1 or not supports(x, weight, bias):
        return None
    # the launchers below hand the parameters' pointers to the kernel, which reads n contiguous values
    # (a strided 1-D view would be read wrongly): anything else goes through _params on the general path
    if any(p is not None and (p.dim() != 1 or p.dtype != x.dtype or not p.is_contiguous()) for p in (weight, bias)):
        return None
    n = normalized_shape[0]
    if grad:
        if x.dtype not in _OP_DTYPES:
            return grad_launcher(_RMSNormCPU.apply, normalized_shape)
        autograd_op()  # starts the background build (or the load from the cache) on the first grad-mode bind
        return _grad_call(normalized_shape, x.element_size())

    # Without gradients: the launch itself, with what the key and the module fix taken out of the call
    # (dtype code, parameter dtypes and layout; a parameter's pointer is still read per call).
    fn, code, item = k.fn, DTYPE_CODES[x.dtype], x.element_size()
    threads = torch.get_num_threads

    def call(x, w, b, eps):
        if not (x.dim() and x.shape[-1] == n and x.is_contiguous()):
            if x.dim() and x.shape[-1] == n:
                return _run(k, x, normalized_shape, w, b, eps, want_rstd=False, pooled=True)[0]
            return None
        numel = x.numel()
        nbytes = numel * item
        y = torch.empty_like(x) if nbytes < _POOL_MIN_BYTES else _new_output(tuple(x.shape), x.dtype, True)
        if numel:
            fn(code, x.data_ptr(), numel // n, n, n, None if w is None else w.data_ptr(), 1,
               None if b is None else b.data_ptr(), 1, y.data_ptr(), None, eps,
               threads() if numel >= _PARALLEL_MIN_ELEMENTS else 1, 1 if nbytes >= _STREAM_MIN_BYTES else 0)
        return y

    return call


def rms_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    if len(normalized_shape) == 0:
        return eager.rms_norm(x, normalized_shape, weight, bias, eps)
    if torch.compiler.is_compiling():
        return torch.ops.normswap.cpu_rms_norm(x, list(normalized_shape), weight, bias, eps)[0]
    k = kernel()
    if k.fn is None:
        return eager.rms_norm(x, normalized_shape, weight, bias, eps)
    if wants_grad(x, weight, bias):
        return _RMSNormCPU.apply(x, normalized_shape, weight, bias, eps)
    return _run(k, x, normalized_shape, weight, bias, eps, want_rstd=False, pooled=True)[0]
