"""How the fused CPU RMSNorm kernel is built: compiler, instruction set, cache, variants.

The kernel's C++ source is ``csrc/rmsnorm.cpp`` (package data; why it looks as it does is written at
its top). :mod:`normswap.backends.cpu` is the runtime that calls it; it asks :func:`build` once.

* Plain C++ with intrinsics and no PyTorch headers, so one ``g++`` call takes about a second; no
  ninja, no ``torch.utils.cpp_extension`` machinery. It is built as a small CPython extension module
  (a call costs ~0.1 us; ctypes costs ~1.3 us, which shows on small inputs), or, without Python
  headers, as a plain library called through ctypes.
* The instruction set is chosen from ``torch.backends.cpu.get_cpu_capability()`` (plus the
  ``avx512_bf16`` CPU flag on Linux): ISA 3 = AVX-512 + BF16, 2 = AVX-512, 1 = AVX2/FMA/F16C,
  0 = portable. The cache key includes the ISA, compiler flags, compiler version and source hash, so a
  cached binary is never used on a CPU or compiler it was not built for. ``NORMSWAP_CPU_ISA`` forces
  a level (tests use it to check every path).
* Cached under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) in ``normswap_cpu/``;
  written to a temporary name and renamed, so concurrent first uses are safe.
* OpenMP: the library links ``libgomp.so.1``, which the loader resolves to the copy PyTorch already
  loaded, so both share one thread pool. If ``-fopenmp`` does not build (e.g. clang without libomp),
  it is rebuilt single-threaded.
* After loading, a self-test compares the kernel with ``eager`` on small inputs; any failure, like
  a missing compiler or a failed build, makes :func:`available` return False with the reason, and
  ``auto`` falls back to the next backend. ``NORMSWAP_CPU_BUILD=0`` disables the build altogether.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

PATH = Path(__file__).with_name("csrc") / "rmsnorm.cpp"
SOURCE = PATH.read_text(encoding="utf-8")
SOURCE_SHA256 = hashlib.sha256(SOURCE.encode()).hexdigest()
OP_PATH = PATH.with_name("rmsnorm_op.cpp")  # the kernel as a torch operator with a C++ autograd kernel
OP_SOURCE = OP_PATH.read_text(encoding="utf-8")

# float64 is supported for correctness (gradcheck); fp16 only where the build reports it.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
ISA_FLAGS: dict[int, list[str]] = {
    3: ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx2", "-mfma", "-mf16c"],
    2: ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    1: ["-mavx2", "-mfma", "-mf16c"],
    0: [],
}
BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off"]


class Kernel:
    """The loaded library (or why there is none)."""

    def __init__(self) -> None:
        self.fn = None
        self.bwd = None
        self.dtypes: set[torch.dtype] = set()
        self.isa = -1
        self.path = ""
        self.openmp = False
        self.binding = ""
        self.build_seconds = 0.0
        self.reason = "not built yet"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def detect_isa() -> int:
    """The instruction-set level to build for: ``NORMSWAP_CPU_ISA`` if set, else from the CPU."""
    forced = os.environ.get("NORMSWAP_CPU_ISA")
    if forced:
        return int(forced)
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return 0
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return 3 if "avx512_bf16" in _cpu_flags() else 2
    if capability == "AVX2":
        return 1
    return 0


def cache_dir() -> str:
    """``$TORCH_EXTENSIONS_DIR/normswap_cpu`` (default ``~/.cache/torch_extensions``); a per-user temp
    directory when that is not writable (read-only home in some CI sandboxes)."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions"
    )
    path = os.path.join(base, "normswap_cpu")
    try:
        os.makedirs(path, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    return os.path.join(tempfile.gettempdir(), f"normswap_cpu_{os.getuid() if hasattr(os, 'getuid') else 0}")


def find_compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def compile_library(cxx: str, flags: list[str], out_path: str, source: str | None = None,
                    libs: tuple[str, ...] = ()) -> str | None:
    """Compile ``source`` (default: SOURCE) into ``out_path`` atomically, linking ``libs`` after it.
    Returns an error message or None."""
    try:
        return _compile_into(cxx, flags, out_path, SOURCE if source is None else source, libs)
    except OSError as exc:  # unwritable cache, full disk, ...
        return f"{type(exc).__name__}: {exc}"


def _compile_into(cxx: str, flags: list[str], out_path: str, source: str, libs: tuple[str, ...]) -> str | None:
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="normswap_build_") as tmp:
        src = os.path.join(tmp, "rmsnorm.cpp")
        with open(src, "w") as fh:
            fh.write(source)
        tmp_so = os.path.join(tmp, "rmsnorm.so")
        try:
            proc = subprocess.run([cxx, *flags, src, *libs, "-o", tmp_so], capture_output=True, text=True,
                                  timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{type(exc).__name__}: {exc}"
        if proc.returncode != 0:
            return (proc.stderr or proc.stdout).strip()[-600:]
        staged = f"{out_path}.{os.getpid()}.{threading.get_ident()}.tmp"
        shutil.copyfile(tmp_so, staged)
        os.replace(staged, out_path)  # atomic: a concurrent process sees the old file or the new one
    return None


def load_ctypes(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    lib.ns_rms_norm_fwd.argtypes = [ctypes.c_int, P, I64, I64, I64, P, I64, P, I64, P, P, ctypes.c_double,
                                    ctypes.c_int, ctypes.c_int]
    lib.ns_rms_norm_fwd.restype = ctypes.c_int
    lib.ns_rms_norm_bwd.argtypes = [ctypes.c_int, P, P, I64, I64, I64, I64, P, I64, P, P, P, P, ctypes.c_int,
                                    ctypes.c_int]
    lib.ns_rms_norm_bwd.restype = ctypes.c_int
    lib.ns_supported_dtypes.restype = ctypes.c_int
    lib.ns_isa.restype = ctypes.c_int
    return lib


def python_include() -> str | None:
    """CPython's header directory when Python.h is there (needed for the extension-module variant)."""
    include = sysconfig.get_paths().get("include")
    return include if include and os.path.exists(os.path.join(include, "Python.h")) else None


def load_extension(path: str):
    """Import the CPython-extension variant from ``path`` (its init symbol is PyInit__normswap_rmsnorm)."""
    spec = importlib.util.spec_from_file_location("_normswap_rmsnorm", path)
    if spec is None or spec.loader is None:
        raise OSError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(self_test: Callable[[Kernel], str | None]) -> Kernel:
    """Build (or load from the cache) the best variant that works here, then self-test it.

    ``self_test`` compares a loaded kernel with the reference and returns why it fails, or None.
    Variants, best first: a CPython extension module with OpenMP (cheapest calls), the same library
    through ctypes (no Python headers needed), and a single-threaded ctypes build (no OpenMP).
    """
    k = Kernel()
    if os.environ.get("NORMSWAP_CPU_BUILD", "1") == "0":
        k.reason = "disabled by NORMSWAP_CPU_BUILD=0"
        return k
    cxx = find_compiler()
    if cxx is None:
        k.reason = "no C++ compiler found (set CXX, or install g++)"
        return k
    isa = detect_isa()
    version = compiler_version(cxx)
    include = python_include()
    variants = [("extension", True), ("ctypes", True), ("ctypes", False)]
    if include is None:
        variants = variants[1:]
    t0 = time.perf_counter()
    errors = []
    for kind, openmp in variants:
        flags = [*BASE_FLAGS, f"-DNS_ISA={isa}", *ISA_FLAGS.get(isa, []), *(["-fopenmp"] if openmp else [])]
        if kind == "extension":
            flags += ["-DNS_PYTHON", f"-I{include}"]
        tag = (sysconfig.get_config_var("EXT_SUFFIX") or "") if kind == "extension" else ""
        key = hashlib.sha256("\0".join([SOURCE, cxx, version, tag, *flags]).encode()).hexdigest()[:16]
        path = os.path.join(cache_dir(), f"rmsnorm_isa{isa}_{key}.so")
        label = f"{kind}{'' if openmp else ' without OpenMP'}"
        if not os.path.exists(path):
            err = compile_library(cxx, flags, path)
            if err is not None:
                errors.append(f"{label}: {err}")
                continue
        try:
            if kind == "extension":
                mod = load_extension(path)
                k.fn, k.bwd = mod.fwd, mod.bwd
                mask, k.isa = mod.info()
            else:
                lib = load_ctypes(path)
                k.fn, k.bwd = lib.ns_rms_norm_fwd, lib.ns_rms_norm_bwd
                mask, k.isa = lib.ns_supported_dtypes(), lib.ns_isa()
        except (OSError, ImportError) as exc:
            errors.append(f"{label}: loading {path}: {exc}")
            continue
        k.dtypes = {dt for dt, code in DTYPE_CODES.items() if mask & (1 << code)}
        k.path, k.openmp, k.binding = path, openmp, kind
        k.build_seconds = time.perf_counter() - t0
        failure = self_test(k)
        if failure is not None:
            k.fn = k.bwd = None
            k.reason = failure
            return k
        threads = "OpenMP" if openmp else "single-threaded (no OpenMP)"
        k.reason = f"fused C++ kernel, ISA level {k.isa}, {threads}, {kind}, {os.path.basename(path)}"
        return k
    k.reason = "build failed: " + " | ".join(errors)
    return k


# ------------------------------------------------------------------ the torch operator (optional)
class Op:
    """The kernel as a PyTorch operator with a C++ autograd kernel (``csrc/rmsnorm_op.cpp``), or why not."""

    def __init__(self) -> None:
        self.op = None  # torch OpOverload: op(x, weight, bias, eps) -> y, differentiable
        self.namespace = ""
        self.path = ""
        self.build_seconds = 0.0
        self.reason = "not built yet"


_LOADED_OPS: dict[str, object] = {}  # namespace -> op: a TORCH_LIBRARY namespace loads once per process


def _torch_link_flags() -> tuple[list[str], tuple[str, ...]]:
    """Compile flags (headers, ABI) and link arguments for code using PyTorch's C++ API."""
    root = Path(torch.__file__).resolve().parent
    inc, lib = root / "include", root / "lib"
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    flags = [f"-I{inc}", f"-I{inc / 'torch' / 'csrc' / 'api' / 'include'}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             "-fvisibility=hidden"]
    return flags, (f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-ltorch")


def build_op(isa: int, openmp: bool, stream_min_bytes: int) -> Op:
    """Build (or load from the cache) the torch-operator variant for instruction-set level ``isa``.

    It needs PyTorch's C++ headers, so a first build takes far longer than the plain kernel (tens of
    seconds); :mod:`normswap.backends.cpu` runs it in a background thread and keeps its Python
    ``autograd.Function`` until the operator is there. ``NORMSWAP_CPU_OP=0`` disables it.
    """
    o = Op()
    if os.environ.get("NORMSWAP_CPU_OP", "1") == "0" or os.environ.get("NORMSWAP_CPU_BUILD", "1") == "0":
        o.reason = "disabled by NORMSWAP_CPU_OP=0" if os.environ.get("NORMSWAP_CPU_OP") == "0" else \
            "disabled by NORMSWAP_CPU_BUILD=0"
        return o
    cxx = find_compiler()
    if cxx is None:
        o.reason = "no C++ compiler found"
        return o
    include = Path(torch.__file__).resolve().parent / "include" / "torch" / "library.h"
    if not include.exists():
        o.reason = "PyTorch's C++ headers are not installed"
        return o
    t0 = time.perf_counter()
    torch_flags, libs = _torch_link_flags()
    flags = [*BASE_FLAGS, f"-DNS_ISA={isa}", *ISA_FLAGS.get(isa, []), *(["-fopenmp"] if openmp else []), *torch_flags]
    source = SOURCE + "\n" + OP_SOURCE
    key = hashlib.sha256("\0".join([source, cxx, compiler_version(cxx), torch.__version__, *flags, *libs])
                         .encode()).hexdigest()[:16]
    o.namespace = f"normswap_cpu_{key}"
    o.path = os.path.join(cache_dir(), f"rmsnorm_op_isa{isa}_{key}.so")
    loaded = _LOADED_OPS.get(o.namespace)
    if loaded is None:
        if not os.path.exists(o.path):
            err = compile_library(cxx, [*flags, f"-DNS_OP_NAMESPACE={o.namespace}"], o.path, source, libs)
            if err is not None:
                o.reason = f"build failed: {err}"
                return o
        try:
            torch.ops.load_library(o.path)
            ns = getattr(torch.ops, o.namespace)
            ns.configure(int(stream_min_bytes))
            loaded = _LOADED_OPS[o.namespace] = ns.rms_norm.default
        except (OSError, RuntimeError, AttributeError) as exc:
            o.reason = f"loading {o.path}: {exc}"
            return o
    o.op = loaded
    o.build_seconds = time.perf_counter() - t0
    o.reason = f"torch operator {o.namespace}::rms_norm with a C++ autograd kernel ({os.path.basename(o.path)})"
    return o
