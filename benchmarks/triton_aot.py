"""Compile the triton kernels for a GPU architecture without a GPU, and read their resource usage.

Triton compiles ahead of time to a cubin with the ``ptxas`` its wheel ships, given only a target
(``GPUTarget("cuda", 90, 32)`` for H100). That checks what the CPU interpreter cannot: that every
kernel configuration the launcher produces compiles for the GPU, and how many registers it takes and
whether it spills (``cuobjdump --dump-resource-usage``: ``STACK`` bytes are per-thread spill space).

Used by ``tests/backends/test_triton_aot.py`` and ``benchmarks/triton_resources.py``; the CUDA
``auto`` rule's row-length limit comes from these numbers (see ``docs/backends.md``). A development
tool, so it lives beside the benchmarks, not in the installed package.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from normswap.backends import triton as triton_backend

_PTR = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float64: "*fp64"}
_FWD_PTRS = ("X", "Y", "W", "B", "R", "H")
_BWD_PTRS = ("X", "DY", "DX", "W", "DRES")


@dataclass(frozen=True)
class Resources:
    """One compiled kernel: registers per thread, spill bytes per thread, static shared memory."""

    registers: int
    spill_bytes: int
    shared_bytes: int


def cuobjdump() -> str | None:
    """The ``cuobjdump`` bundled with triton (or on PATH), or None."""
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return bundled if os.access(bundled, os.X_OK) else shutil.which("cuobjdump")


def compile_kernel(
    kind: str,
    dtype: torch.dtype,
    n: int,
    *,
    arch: int = 90,
    has_w: bool = True,
    has_b: bool = True,
    has_res: bool = False,
    aligned: bool = True,
) -> bytes:
    """The cubin of the ``"fwd"`` or ``"bwd"`` kernel as the launcher would configure it for rows of ``n``.

    ``has_res`` is the fused residual input (forward) or the extra gradient at ``h`` (backward).
    ``aligned`` compiles the specialisation triton's launcher picks when every pointer is 16-byte
    aligned and every stride and size a multiple of 16 (the usual case: vectorised loads); without it,
    the generic one (what an odd row length or an offset view gets).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from normswap.backends._triton_kernels import kernels

    fwd, bwd = kernels()
    acc = "*fp64" if dtype == torch.float64 else "*fp32"
    flags = {"HAS_W": int(has_w), "HAS_B": int(has_b), "IS_FP64": int(dtype == torch.float64),
             "IS_BF16": int(dtype == torch.bfloat16)}
    if kind == "fwd":
        fn, pointers = fwd, {name: _PTR[dtype] for name in _FWD_PTRS} | {"RSTD": acc}
        block_m, block_n, warps = triton_backend.fwd_launch_config(n, aligned=aligned)
        constants = flags | {"HAS_RES": int(has_res), "BLOCK_M": block_m, "BLOCK_N": block_n, "HAS_RSTD": 1}
    elif kind == "bwd":
        fn = bwd
        pointers = {name: _PTR[dtype] for name in _BWD_PTRS} | {"RSTD": acc, "DW_PART": acc, "DB_PART": acc}
        block_n, warps = triton_backend.bwd_launch_config(n)
        constants = flags | {"HAS_DRES": int(has_res), "BLOCK_N": block_n}
    else:
        raise ValueError(f"kind must be 'fwd' or 'bwd', not {kind!r}")
    names = fn.arg_names
    signature = {
        name: "constexpr" if name in constants else pointers.get(name, "fp32" if name == "eps" else "i32")
        for name in names
    }
    attrs = {}
    if aligned:  # row counts (M, ROWS_PER_HEAD, ...) are left generic: they vary call to call
        hinted = [name for name in names if signature[name].startswith("*") or name.startswith(("stride", "N", "W_ROW",
                                                                                                    "B_ROW"))]
        attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in hinted}
    source = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constants.items()}, attrs=attrs)
    options = {"num_warps": warps, "enable_fp_fusion": triton_backend.FP_FUSION}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["cubin"]


def resources(cubin: bytes) -> Resources:
    """Registers, spill bytes and shared memory of the (single) kernel in ``cubin``."""
    tool = cuobjdump()
    if tool is None:
        raise RuntimeError("cuobjdump not found (it ships with triton's NVIDIA backend)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as fh:
            fh.write(cubin)
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True,
                             check=True, timeout=120).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    if match is None:
        raise RuntimeError(f"no resource line in cuobjdump output: {out[-300:]}")
    return Resources(*(int(g) for g in match.groups()))
