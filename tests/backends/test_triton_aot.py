"""The triton kernels compiled for real GPU architectures, on a machine without a GPU.

The interpreter tests check numerics but never compile; this compiles every configuration the launcher
uses to a cubin for sm_90 (H100) and sm_80 (A100) and reads its registers and spills. A kernel change
that breaks GPU compilation, or that makes a configuration ``auto`` picks spill registers, fails here.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

if importlib.util.find_spec("triton") is not None:
    from pathlib import Path

    from normswap import backends

    _spec = importlib.util.spec_from_file_location(
        "triton_aot", Path(__file__).resolve().parents[2] / "benchmarks" / "triton_aot.py")
    aot = importlib.util.module_from_spec(_spec)
    sys.modules.setdefault("triton_aot", aot)  # its dataclasses look the module up there
    _spec.loader.exec_module(aot)

    HAVE_TOOL = aot.cuobjdump() is not None
else:  # pragma: no cover - the module is skipped
    HAVE_TOOL = False

AUTO_SHAPES = (64, 768, 2048, 4096, backends.CUDA_TRITON_MAX_N) if HAVE_TOOL else ()
SMALL_SPILL = 32  # bytes per thread


@pytest.fixture(autouse=True)
def _compiled_not_interpreted(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.skipif(not HAVE_TOOL, reason="cuobjdump not found")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_every_auto_configuration_compiles_for_h100_with_the_row_in_registers(kind, dtype):
    """Up to ``CUDA_TRITON_MAX_N`` a row fits in registers: no spill in the usual (aligned) launch; the
    generic one may spill at most SMALL_SPILL bytes per thread at 8192 (measured: 8 for the fp32
    backward), a couple of values cached in L1."""
    for n in AUTO_SHAPES:
        for has_w, has_b in ((True, False), (True, True), (False, False)):
            for aligned in (True, False):  # the usual vectorised specialisation, and the generic one
                used = aot.resources(aot.compile_kernel(kind, dtype, n, arch=90, has_w=has_w, has_b=has_b,
                                                        aligned=aligned))
                limit = 0 if n <= 4096 or aligned else SMALL_SPILL
                assert used.spill_bytes <= limit, f"{kind} {dtype} n={n} w={has_w} b={has_b} {aligned=}: {used}"
                assert used.registers <= 255


@pytest.mark.skipif(not HAVE_TOOL, reason="cuobjdump not found")
def test_residual_variants_and_extremes_compile():
    """The fused residual kernels, float64, A100, and the longest row ``backend="triton"`` accepts."""
    from normswap.backends import triton as triton_backend

    for kind in ("fwd", "bwd"):
        assert aot.resources(aot.compile_kernel(kind, torch.bfloat16, 4096, has_res=True)).spill_bytes == 0
        assert aot.resources(aot.compile_kernel(kind, torch.bfloat16, 8192, has_res=True)).spill_bytes <= SMALL_SPILL
        aot.compile_kernel(kind, torch.float64, 4096)
        aot.compile_kernel(kind, torch.bfloat16, 4096, arch=80)
        aot.compile_kernel(kind, torch.bfloat16, triton_backend.MAX_N)


@pytest.mark.skipif(not HAVE_TOOL, reason="cuobjdump not found")
def test_auto_row_limit_is_where_the_backward_starts_to_spill():
    """Why CUDA_TRITON_MAX_N is 8192: at the next row length the backward spills hundreds of bytes per
    thread. If this fails, a kernel change made longer rows fit; raise the limit (and re-measure)."""
    limit = backends.CUDA_TRITON_MAX_N
    for aligned in (True, False):
        assert aot.resources(aot.compile_kernel("bwd", torch.bfloat16, limit, aligned=aligned)).spill_bytes == 0
        assert aot.resources(aot.compile_kernel("bwd", torch.bfloat16, 2 * limit, aligned=aligned)).spill_bytes >= 128
