"""The fused CPU kernel: build, cache, instruction-set variants, fallbacks, threads, output pool."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from backend_ref import check_against_reference, make_inputs

import normswap
from normswap import backends
from normswap.backends import cpu, cpu_build, eager, rows

HAVE_CXX = cpu_build.find_compiler() is not None



@pytest.fixture(autouse=True)
def _no_operator_build_in_flight():
    """Tests here swap parts of the build machinery (compiler, headers, cache directory); an operator
    build that an earlier grad-mode call started in the background must not run into them."""
    cpu.finish_operator_build()
    yield
    cpu.finish_operator_build()

def one_rounding(x, rstd, w, b):
    """The contract given the kernel's rstd: ``x * rstd * w + b`` in float32 (parameters upcast from
    their own dtype, the same separate float32 operations as eager), rounded once to x's dtype."""
    y = x.float() * rstd.view(*x.shape[:-1], 1)
    if w is not None:
        y = y * w.float()
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype)


def llama_order(x, rstd, w, b):
    """The order normswap used before (HF Llama): round after ``x * rstd``, after ``* w``, after ``+ b``."""
    y = (x.float() * rstd.view(*x.shape[:-1], 1)).to(x.dtype)
    if w is not None:
        y = (y.float() * w.to(x.dtype).float()).to(x.dtype)
    if b is not None:
        y = (y.float() + b.to(x.dtype).float()).to(x.dtype)
    return y


HALF = [torch.bfloat16, torch.float16]


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """Build into an empty cache dir; restore the normal kernel afterwards."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    cpu.reset()
    backends.refresh()  # availability is cached per process (backends.is_available): forget it with the kernel
    yield tmp_path
    monkeypatch.undo()
    cpu.reset()
    backends.refresh()  # else a failed build's "cpu unavailable" outlives the fixture


@pytest.fixture
def seeded_kernel(monkeypatch, fresh_kernel):
    """``fresh_kernel``'s empty cache holding a copy of this process's default kernel (this CPU's top level, the
    extension binding): a test of the other variants then builds those only. The default's own build into an
    empty cache is ``test_build_is_cached``'s (a build is ~6 s of CPU on the CI machine)."""
    monkeypatch.undo()
    cpu.reset()
    backends.refresh()
    ok, reason = cpu.available()
    assert ok, reason
    default = cpu.kernel().path
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(fresh_kernel))
    cpu.reset()
    backends.refresh()
    (fresh_kernel / "normswap_cpu").mkdir(exist_ok=True)
    shutil.copy2(default, fresh_kernel / "normswap_cpu" / os.path.basename(default))
    return fresh_kernel


def test_kernel_builds_where_a_compiler_exists():
    ok, reason = cpu.available()
    if HAVE_CXX:
        assert ok, reason  # a compiler is present: a failed build here is a bug, not a fallback
        assert "ISA level" in reason
        assert {torch.float32, torch.bfloat16, torch.float64} <= cpu.kernel().dtypes
    else:
        assert not ok and "compiler" in reason


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
def test_every_isa_level_this_cpu_runs(monkeypatch, seeded_kernel):
    """Each instruction-set variant (AVX-512+BF16, AVX-512, AVX2, portable) agrees with eager, and in
    half precision rounds once, bit for bit (given its own rstd), at every level. The levels below the top
    are built here into an empty cache; the top level is the default kernel (``seeded_kernel``)."""
    top = cpu_build.detect_isa()
    for isa in range(top, -1, -1):
        monkeypatch.setenv("NORMSWAP_CPU_ISA", str(isa))
        cpu.reset()
        ok, reason = cpu.available()
        assert ok, reason
        assert cpu.kernel().isa == isa
        for dtype in sorted(cpu.kernel().dtypes, key=str):
            for bias in (False, True):
                x, w, b = make_inputs(7, (203,), dtype, bias=bias, per_head=0, seed=isa)
                y = cpu.rms_norm(x, (203,), w, b, 1e-5)
                check_against_reference(y, x, (203,), w, b, 1e-5, f"isa {isa} {dtype}")
                if dtype in HALF:  # one rounding, bit for bit given the kernel's rstd, at every level
                    y2, rstd = cpu._run(cpu.kernel(), x, (203,), w, b, 1e-5, want_rstd=True, pooled=False)
                    assert torch.equal(y2, y) and torch.equal(y, one_rounding(x, rstd, w, b)), f"isa {isa}"


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
def test_build_is_cached(fresh_kernel):
    assert cpu.available()[0]
    first = cpu.kernel()
    assert os.path.exists(first.path) and first.path.startswith(str(fresh_kernel))
    cpu.reset()
    assert cpu.available()[0]
    assert cpu.kernel().path == first.path
    assert len(os.listdir(os.path.dirname(first.path))) == 1  # no rebuild, no stray temp files


def test_build_failure_falls_back(monkeypatch, fresh_kernel):
    monkeypatch.setattr(cpu_build, "find_compiler", lambda: shutil.which("false") or "/bin/false")
    ok, reason = cpu.available()
    assert not ok and reason.startswith("build failed")
    x, w, _ = make_inputs(4, (64,), torch.bfloat16)
    assert not cpu.supports(x, w, None)
    assert backends.resolve("auto", x, w, None) is backends.eager
    assert backends.resolve("cpu", x, w, None) is backends.eager  # explicit request falls back too
    y = normswap.rms_norm(x, 64, w)
    check_against_reference(y, x, (64,), w, None, 1e-6, "fallback")
    pick = [d for d in backends.describe() if d["name"] == "auto" and d["device"] == "cpu" and d["mode"] == "eager"]
    assert all(d["picks"] in ("eager", "native") and "build failed" in d["why"] for d in pick)


def test_no_compiler_and_disabled_build(monkeypatch, fresh_kernel):
    monkeypatch.setattr(cpu_build, "find_compiler", lambda: None)
    assert cpu.available() == (False, "no C++ compiler found (set CXX, or install g++)")
    cpu.reset()
    monkeypatch.setenv("NORMSWAP_CPU_BUILD", "0")
    assert cpu.available() == (False, "disabled by NORMSWAP_CPU_BUILD=0")
    assert backends.resolve("auto", torch.randn(2, 8), None, None) is backends.native


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
def test_self_test_failure_disables_kernel(monkeypatch):
    monkeypatch.setattr(cpu, "_self_test", lambda k: "self-test failed for torch.float32")
    cpu.reset()  # reloads the cached build, then the (patched) self-test rejects it
    try:
        assert cpu.available() == (False, "self-test failed for torch.float32")
    finally:
        monkeypatch.undo()
        cpu.reset()


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
def test_concurrent_first_use_builds_safely(tmp_path):
    """Two processes building into the same empty cache at once both end up with a working kernel."""
    code = "from normswap.backends import cpu; ok, r = cpu.available(); assert ok, r; print(r)"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    files = os.listdir(tmp_path / "normswap_cpu")
    assert len(files) == 1 and files[0].endswith(".so")


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_split_rows_identically(dtype):
    x, w, b = make_inputs(301, (515,), dtype, bias=True, seed=7)  # > _PARALLEL_MIN_ELEMENTS
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.rms_norm(x, (515,), w, b, 1e-6).clone()
        torch.set_num_threads(2)
        two = cpu.rms_norm(x, (515,), w, b, 1e-6)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_row_view_without_copy():
    base = torch.randn(10, 96)
    x = base[:, 16:80]  # row stride 96, unit column stride
    assert rows.as_rows(x, 64).data_ptr() == x.data_ptr()
    t = torch.randn(64, 10).t()  # columns strided: must be copied
    assert rows.as_rows(t, 64).is_contiguous()


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
def test_output_pool_reuses_only_unreferenced_storage(monkeypatch):
    monkeypatch.delenv("NORMSWAP_CPU_POOL", raising=False)
    cpu.empty_pool()
    x = torch.randn(1024, 1024)  # 4 MiB output: pooled
    with torch.no_grad():
        y1 = cpu.rms_norm(x, (1024,), None, None, 1e-6)
        p1 = y1.data_ptr()
        del y1
        y2 = cpu.rms_norm(x, (1024,), None, None, 1e-6)
        assert y2.data_ptr() == p1  # freed by the caller: reused
        view = y2[3]
        kept = view.clone()
        del y2
        y3 = cpu.rms_norm(x * 2, (1024,), None, None, 1e-6)
        assert y3.data_ptr() != p1  # a view still references the first storage
        assert torch.equal(view, kept)  # and its contents were not overwritten
        assert y3._base is None and y3.is_contiguous()
    cpu.empty_pool()
    assert not cpu._pool.free


def test_pool_can_be_disabled(monkeypatch):
    monkeypatch.setenv("NORMSWAP_CPU_POOL", "0")
    cpu.empty_pool()
    with torch.no_grad():
        cpu.rms_norm(torch.randn(1024, 1024), (1024,), None, None, 1e-6)
    assert not cpu._pool.free


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
def test_inference_mode_and_autograd_paths():
    x, w, b = make_inputs(8, (64,), torch.float32, bias=True, seed=9, requires_grad=True)
    with torch.inference_mode():
        y = cpu.rms_norm(x, (64,), w, b, 1e-6)
        assert y.is_inference()
    y = cpu.rms_norm(x, (64,), w, b, 1e-6)
    assert type(y.grad_fn).__name__ == "_RMSNormCPUBackward"  # eager path: no op dispatcher
    y.sum().backward()
    assert x.grad is not None and w.grad is not None and b.grad is not None


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
@pytest.mark.parametrize("n", [64, 100, 1024])
def test_streaming_stores_write_the_same_values(monkeypatch, n):
    """Large outputs use non-temporal stores (rows whose start is not aligned fall back per row)."""
    for dtype in sorted(cpu.kernel().dtypes - {torch.float64}, key=str):
        x, w, b = make_inputs(33, (n,), dtype, bias=True, seed=n)
        monkeypatch.setattr(cpu, "_STREAM_MIN_BYTES", 1 << 62)
        plain = cpu.rms_norm(x, (n,), w, b, 1e-6).clone()
        monkeypatch.setattr(cpu, "_STREAM_MIN_BYTES", 0)
        assert torch.equal(cpu.rms_norm(x, (n,), w, b, 1e-6), plain)


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
@pytest.mark.parametrize("per_head", [0, 3])
@pytest.mark.parametrize("strided", [False, True])
def test_backward_kernel_matches_reference_math(per_head, strided):
    for dtype in sorted(cpu.kernel().dtypes - {torch.float64}, key=str):
        for weight, bias in ((True, True), (True, False), (False, True), (False, False)):
            x, w, b = make_inputs(40, (131,), dtype, weight=weight, bias=bias, per_head=per_head,
                                  strided=strided, seed=per_head)
            dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
            _, rstd = cpu._run(cpu.kernel(), x, (131,), w, b, 1e-5, want_rstd=True, pooled=False)
            needs = (True, weight, bias)
            got = cpu.backward(dy, x, rstd, (131,), w, b, 1e-5, needs)
            ref = cpu.backward_math(dy, x, rstd, (131,), w, b, 1e-5, needs)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            for g, r in zip(got, ref, strict=True):
                assert (g is None) == (r is None)
                if g is not None:
                    assert g.dtype == r.dtype and g.shape == r.shape
                    scale = 1 + r.double().abs().max().item()
                    assert (g.double() - r.double()).abs().max().item() <= tol * scale * 4


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
@pytest.mark.parametrize("dtype", HALF)
def test_backward_kernel_accumulates_unrounded_xhat(dtype):
    """dW = sum over rows of dy * x * rstd, with no rounding of x * rstd to the input dtype (the forward
    no longer rounds there): within float32 accumulation error of the float64 sum, where the sum over
    the rounded xhat is measurably off. A float32 weight, so that dW comes out in float32."""
    if dtype not in cpu.kernel().dtypes:
        pytest.skip(f"{dtype} not built here")
    x, w, _ = make_inputs(256, (80,), dtype, seed=13, weight_dtype=torch.float32)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(14)).to(dtype)
    _, rstd = cpu._run(cpu.kernel(), x, (80,), w, None, 1e-6, want_rstd=True, pooled=False)
    _, dw, _ = cpu.backward(dy, x, rstd, (80,), w, None, 1e-6, (True, True, False))
    assert dw.dtype == torch.float32
    xhat = x.double() * rstd.double()[:, None]
    exact = (dy.double() * xhat).sum(0)
    rounded = (dy.double() * xhat.to(dtype).double()).sum(0)
    scale = exact.abs().max().item()
    assert (rounded - exact).abs().max().item() > 1e-4 * scale  # the check can tell the two apart
    assert (dw.double() - exact).abs().max().item() <= 1e-5 * scale


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
def test_backward_deterministic_and_thread_split():
    x, w, b = make_inputs(257, (300,), torch.float32, bias=True, seed=5, requires_grad=True)
    gy = torch.randn(x.shape)
    runs = [torch.autograd.grad(cpu.rms_norm(x, (300,), w, b, 1e-6), (x, w, b), gy) for _ in range(2)]
    assert all(torch.equal(a, c) for a, c in zip(*runs, strict=True))


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
def test_ctypes_variant_without_python_headers(monkeypatch, seeded_kernel):
    """Without Python.h the same kernel is built as a plain library and called through ctypes (into a cache that
    holds the default extension build only)."""
    assert cpu.available()[0]
    if cpu_build.python_include() is not None:
        assert cpu.kernel().binding == "extension"
    monkeypatch.setattr(cpu_build, "python_include", lambda: None)
    cpu.reset()
    ok, reason = cpu.available()
    assert ok and cpu.kernel().binding == "ctypes" and "ctypes" in reason
    x, w, b = make_inputs(9, (77,), torch.bfloat16, bias=True, seed=2, requires_grad=True)
    y = cpu.rms_norm(x, (77,), w, b, 1e-6)
    check_against_reference(y, x, (77,), w, b, 1e-6, "ctypes")
    y.float().sum().backward()
    assert x.grad is not None and w.grad is not None


def test_unwritable_cache_dir_uses_temp(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpu_build.cache_dir() == str(tmp_path / "normswap_cpu")
    monkeypatch.setattr(cpu_build.os, "access", lambda path, mode: False)  # as in a read-only home
    fallback = cpu_build.cache_dir()
    assert not fallback.startswith(str(tmp_path)) and "normswap_cpu_" in fallback


def test_compile_errors_are_reported_not_raised(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    err = cpu_build.compile_library(cpu_build.find_compiler() or "c++", [], str(blocker / "sub" / "x.so"))
    assert err is not None and "Error" in err


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n", [32, 96, 100, 768, 2055])
@pytest.mark.parametrize("weight,bias", [(False, False), (True, False), (False, True), (True, True)])
def test_half_precision_rounds_once_bit_exact_given_the_kernels_rstd(dtype, n, weight, bias):
    """Every output is ``round(x * rstd * w + b)`` computed in float32, bit for bit, with the kernel's
    own rstd (so a last-bit difference in the sum of squares cannot hide or fake a mismatch). Covers
    the 32-wide bf16 path (lane order, pre-permuted parameters), row tails, per-head parameters, and
    enough rows for the two-deep row pipeline and a thread split. The same inputs through the old
    three-rounding order give different bits, so the check can fail."""
    if dtype not in cpu.kernel().dtypes:
        pytest.skip(f"{dtype} not built here")
    gen = torch.Generator().manual_seed(n)
    rows, heads = 67, 3
    x = (torch.randn(rows, heads, n, generator=gen) * 3).to(dtype)
    w = (1 + torch.randn(heads, n, generator=gen)).to(dtype) if weight else None
    b = torch.randn(heads, n, generator=gen).to(dtype) if bias else None
    with torch.no_grad():
        y, rstd = cpu._run(cpu.kernel(), x, (n,), w, b, 1e-6, want_rstd=True, pooled=False)
    assert torch.equal(y, one_rounding(x, rstd, w, b))
    if weight or bias:  # sabotage check: the three-rounding order is distinguishable on these inputs
        assert not torch.equal(y, llama_order(x, rstd, w, b))
    ref = x.double().pow(2).mean(-1).add(1e-6).rsqrt().float().reshape(-1)
    assert torch.allclose(rstd, ref, rtol=1e-6, atol=0)


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
@pytest.mark.parametrize("dtype", HALF)
def test_parameters_of_another_dtype_are_not_rounded_to_the_input_dtype(dtype):
    """A float32 weight and bias of a half-precision input are used unrounded (flags bit 1), as eager
    does; rounding them to the input dtype first would be an extra rounding."""
    if dtype not in cpu.kernel().dtypes:
        pytest.skip(f"{dtype} not built here")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 2, 100, generator=gen).to(dtype)
    w = 1 + 0.3 * torch.randn(2, 100, generator=gen)  # float32, most values not representable in x's dtype
    b = 0.3 * torch.randn(2, 100, generator=gen)
    for wt, bt in ((w, b), (w, None), (None, b), (w, b.to(dtype))):
        y, rstd = cpu._run(cpu.kernel(), x, (100,), wt, bt, 1e-6, want_rstd=True, pooled=False)
        assert torch.equal(y, one_rounding(x, rstd, wt, bt))
        rounded = one_rounding(x, rstd, None if wt is None else wt.to(dtype), None if bt is None else bt.to(dtype))
        assert not torch.equal(y, rounded)
    assert torch.equal(cpu.rms_norm(x, (100,), w, b, 1e-6), one_rounding(x, rstd, w, b))  # through the entry point


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
def test_inference_fast_path_takes_only_the_plain_call():
    """``cpu.try_fast`` (what ``normswap.rms_norm`` tries first) must hand every other call to the
    general path, agree with it bit for bit where it does run, and keep gradients when they are wanted."""
    assert cpu.kernel().fn is not None  # built (a first call in a process takes the general path, which builds)
    x, w, b = make_inputs(6, (64,), torch.float32, bias=True, seed=11)
    with torch.no_grad():
        fast = cpu.try_fast(x, (64,), w, b, 1e-6)
        assert fast is not None and torch.equal(fast, cpu.rms_norm(x, (64,), w, b, 1e-6))
        assert cpu.try_fast(x.t().contiguous().t(), (64,), w, b, 1e-6) is None  # not contiguous
        assert cpu.try_fast(x, (64,), w.double(), b, 1e-6) is None  # weight dtype differs
        assert cpu.try_fast(x, (8, 8), None, None, 1e-6) is None  # multi-dim normalized_shape
        assert cpu.try_fast(x.view(6, 2, 32), (32,), w.view(2, 32), None, 1e-6) is None  # per-head
        assert cpu.try_fast(x, (32,), None, None, 1e-6) is None  # wrong trailing size
        assert cpu.try_fast(torch.tensor(1.0), (1,), None, None, 1e-6) is None  # 0-d
    wg = w.clone().requires_grad_(True)
    y = cpu.try_fast(x, (64,), wg, None, 1e-6)  # a gradient is wanted: the autograd.Function
    assert type(y.grad_fn).__name__ == "_RMSNormCPUBackward"
    (gw,) = torch.autograd.grad(y, (wg,), torch.ones_like(y))
    w64 = wg.detach().double().requires_grad_(True)
    (ref,) = torch.autograd.grad(eager.rms_norm(x.double(), (64,), w64, None, 1e-6), (w64,), torch.ones(6, 64,
                                 dtype=torch.float64))
    assert torch.allclose(gw.double(), ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert not cpu.try_fast(x, (64,), wg, None, 1e-6).requires_grad  # grad mode off: the kernel alone


def test_kernel_source_is_package_data_and_keys_the_build_cache(monkeypatch):
    """The C++ source ships as a .cpp package-data file; editing it changes the cached binary's name."""
    from pathlib import Path

    assert cpu_build.SOURCE == cpu_build.PATH.read_text(encoding="utf-8")
    assert "ns_rms_norm_fwd" in cpu_build.SOURCE
    assert cpu_build.OP_SOURCE == cpu_build.OP_PATH.read_text(encoding="utf-8")  # the operator variant's
    assert "TORCH_LIBRARY" in cpu_build.OP_SOURCE and cpu_build.OP_PATH.suffix == ".cpp"
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"normswap.backends" = ["csrc/*.cpp"]' in pyproject
    if not cpu.available()[0]:
        pytest.skip(f"cpu kernel unavailable: {cpu.available()[1]}")
    built = os.path.basename(cpu.kernel().path)
    tried: list[str] = []
    monkeypatch.setattr(cpu_build, "compile_library",
                        lambda cxx, flags, out: tried.append(out) or "not compiled (test)")
    monkeypatch.setattr(cpu_build, "SOURCE", cpu_build.SOURCE + "\n// edited\n")
    assert cpu_build.build(lambda k: None).fn is None
    assert tried and built not in {os.path.basename(p) for p in tried}


# ----------------------------------------------------------------------- the C++ autograd operator
def _op_or_skip():
    op = cpu.autograd_op(wait=True)
    if op is None:
        pytest.skip(f"no C++ autograd operator here: {cpu.op_reason()}")
    return op


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_autograd_operator_matches_the_function_path_bit_for_bit(dtype):
    """The operator (forward and backward in C++) computes what the Python autograd.Function computes
    with the same kernels: output, dx, dW and dB, bit for bit; also for a non-contiguous input, an
    input needing only some gradients, and an empty one."""
    op = _op_or_skip()
    if dtype not in cpu.kernel().dtypes:
        pytest.skip(f"{dtype} not built here")
    for m, weight, bias, strided in ((7, True, True, False), (33, True, False, True), (5, False, True, False),
                                     (0, True, True, False)):
        x, w, b = make_inputs(m, (96,), dtype, weight=weight, bias=bias, strided=strided, seed=m,
                              requires_grad=True)
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
        params = [t for t in (x, w, b) if t is not None]
        got_y = op(x, w, b, 1e-5)
        got = torch.autograd.grad(got_y, params, dy)
        ref_y = cpu._RMSNormCPU.apply(x, (96,), w, b, 1e-5)
        ref = torch.autograd.grad(ref_y, params, dy)
        assert torch.equal(got_y, ref_y)
        for g, r in zip(got, ref, strict=True):
            assert g.dtype == r.dtype and g.shape == r.shape and torch.equal(g, r)
    x, w, b = make_inputs(9, (96,), dtype, bias=True, seed=3)
    w.requires_grad_(True)  # x and b need no gradient
    (gw,) = torch.autograd.grad(op(x, w, b, 1e-5).float().sum(), (w,))
    (rw,) = torch.autograd.grad(cpu._RMSNormCPU.apply(x, (96,), w, b, 1e-5).float().sum(), (w,))
    assert torch.equal(gw, rw)
    for bad in (w[:95], w.double() if dtype != torch.float64 else w.float(), torch.stack([w, w], 1)[:, 0]):
        with pytest.raises(RuntimeError, match="weight and bias must be"):  # never a read past the parameter
            op(x, bad, None, 1e-5)


@pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler")
def test_module_calls_with_gradients_go_through_the_operator(monkeypatch):
    """A module call with gradients is one dispatcher call (a C++ autograd node) once the operator is
    loaded; float64 and outputs of the output pool's size keep the Function; so does everything when
    the operator is off."""
    _op_or_skip()
    m = normswap.RMSNorm(64, bias=True)
    y = m(torch.randn(3, 64, requires_grad=True))
    assert type(y.grad_fn).__name__ == "CppFunction"
    y.sum().backward()
    assert m.weight.grad is not None and m.bias.grad is not None
    y = normswap.rms_norm(torch.randn(3, 64), 64, m.weight, m.bias)  # the functional fast path too
    assert type(y.grad_fn).__name__ == "CppFunction"
    m64 = normswap.RMSNorm(64, dtype=torch.float64)
    assert type(m64(torch.randn(3, 64, dtype=torch.float64)).grad_fn).__name__ == "_RMSNormCPUBackward"
    big = torch.randn(cpu._POOL_MIN_BYTES // 4 // 64 + 1, 64)  # >= the pool threshold in float32
    assert type(m(big).grad_fn).__name__ == "_RMSNormCPUBackward"
    monkeypatch.setattr(cpu, "_OP", [None])  # as when the operator is unavailable or still building
    m.clear_decisions()
    assert type(m(torch.randn(3, 64)).grad_fn).__name__ == "_RMSNormCPUBackward"


def test_operator_can_be_disabled(monkeypatch):
    monkeypatch.setenv("NORMSWAP_CPU_OP", "0")
    o = cpu_build.build_op(0, False, 1 << 40)
    assert o.op is None and "NORMSWAP_CPU_OP=0" in o.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_one_dim_parameters_are_read_by_stride(dtype):
    """A 1-D weight or bias that is a strided view (``nn.Parameter(t[::2])``) is read element by element
    on every path: the module's cached no-grad launcher (it read 768 consecutive values: wrong output),
    the grad-mode operator (it refused the call) and the functional fast path; values and gradients
    against the float64 reference."""
    cpu.autograd_op(wait=True)  # the grad path through the operator where it builds (else the Function)
    g = torch.Generator().manual_seed(7)
    wide_w = (1 + 0.5 * torch.randn(2 * 96, generator=g, dtype=torch.float64)).to(dtype)
    wide_b = torch.randn(3 * 96, generator=g, dtype=torch.float64).to(dtype)
    m = normswap.RMSNorm(96, eps=1e-5, bias=True, dtype=dtype)
    m.weight, m.bias = torch.nn.Parameter(wide_w[::2]), torch.nn.Parameter(wide_b[::3])
    assert not m.weight.is_contiguous() and not m.bias.is_contiguous()
    x = torch.randn(5, 96, generator=g, dtype=torch.float64).to(dtype)
    with torch.no_grad():
        for y in (m(x), m(x), normswap.rms_norm(x, 96, m.weight, m.bias, eps=1e-5)):  # decide, then cached
            check_against_reference(y, x, (96,), m.weight, m.bias, 1e-5, "no grad")
    xg = x.clone().requires_grad_(True)
    for y in (m(xg), m(xg), normswap.rms_norm(xg, 96, m.weight, m.bias, eps=1e-5)):
        check_against_reference(y, x, (96,), m.weight, m.bias, 1e-5, "grad")
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        got = torch.autograd.grad(y, (xg, m.weight, m.bias), dy)
        x64 = x.double().requires_grad_(True)
        w64, b64 = (m.weight.detach().double().requires_grad_(True), m.bias.detach().double().requires_grad_(True))
        want = torch.autograd.grad(ref64_graph(x64, w64, b64, 1e-5), (x64, w64, b64), dy.double())
        for a, r in zip(got, want, strict=True):
            torch.testing.assert_close(a.double(), r, rtol=0, atol=0.05 if dtype == torch.bfloat16 else 1e-4)


def ref64_graph(x, w, b, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w + b
