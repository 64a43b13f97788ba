"""The ``auto`` rule, its overrides (argument, NORMSWAP_BACKEND) and ``describe()``."""

from __future__ import annotations

import pytest
import torch

import normswap
from normswap import backends
from normswap.backends import cpu
from normswap.errors import NormswapError


def test_registry_names():
    assert backends.names() == ["auto", "eager", "native", "cpu", "triton"]
    with pytest.raises(NormswapError, match="unknown RMSNorm backend"):
        backends.check_name("fast")
    with pytest.raises(NormswapError):
        normswap.RMSNorm(8, backend="fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cpu_auto_picks_the_fused_kernel_when_built(dtype, monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    x, w = torch.randn(4, 32, dtype=dtype), torch.ones(32, dtype=dtype)
    picked = backends.resolve("auto", x, w, None)
    if cpu.available()[0] and dtype in cpu.kernel().dtypes:
        assert picked is cpu
    else:
        assert picked is (backends.eager if dtype in (torch.bfloat16, torch.float16) else backends.native)


def test_cpu_fallback_rule_without_kernel(monkeypatch):
    monkeypatch.setattr(backends, "is_available", lambda name: name in ("eager", "native"))
    monkeypatch.setattr(backends, "_cpu_kernel_handles", lambda dtype: False)
    assert backends.select_for("cpu", torch.float32, 64, 64)[0] == "native"
    assert backends.select_for("cpu", torch.bfloat16, 64, 64)[0] == "eager"
    assert backends.select(torch.randn(2, 8), None, None) is backends.native


def test_unsupported_tensors_do_not_go_to_the_kernel():
    x = torch.randn(4, 6, 32)
    w = torch.ones(1, 32)  # broadcasts, but is not x's trailing dims: the kernel says no
    assert not cpu.supports(x, w, None)
    assert backends.resolve("auto", x, w, None) is not cpu
    assert not cpu.supports(x.to(torch.int32), None, None)


def test_cuda_rule_design(monkeypatch):
    """The CUDA rule is pure metadata, so it is testable without a GPU."""
    monkeypatch.setattr(backends, "is_available", lambda name: True)
    big, small = (8192, 4096), (16, 4096)
    assert backends.select_for("cuda", torch.bfloat16, *big)[0] == "triton"
    assert backends.select_for("cuda", torch.bfloat16, *small)[0] == "native"
    assert backends.select_for("cuda", torch.bfloat16, 8192, 512)[0] == "native"
    assert backends.select_for("cuda", torch.bfloat16, 8192, 512, bias=True)[0] == "triton"
    assert backends.select_for("cuda", torch.bfloat16, 64, 65536)[0] == "native"  # > triton.MAX_N
    assert backends.select_for("cuda", torch.bfloat16, 256, 16384)[0] == "native"  # > CUDA_TRITON_MAX_N
    assert backends.select_for("cuda", torch.bfloat16, 1024, backends.CUDA_TRITON_MAX_N)[0] == "triton"
    monkeypatch.setattr(backends, "is_available", lambda name: name != "triton")
    assert backends.select_for("cuda", torch.bfloat16, *big) == ("native", "triton is not available")
    assert backends.select_for("mps", torch.float32, *big)[0] == "native"


def test_env_var_overrides_auto_but_not_an_explicit_argument(monkeypatch):
    x, w = torch.randn(4, 32), torch.ones(32)
    monkeypatch.setenv(backends.ENV_VAR, "eager")
    assert backends.resolve("auto", x, w, None) is backends.eager
    assert backends.resolve("native", x, w, None) is backends.native
    m = normswap.RMSNorm(32)
    assert torch.allclose(m(x), backends.eager.rms_norm(x, (32,), m.weight, None, m.eps))
    monkeypatch.setenv(backends.ENV_VAR, "triton")  # not runnable here (no CUDA): falls back to auto
    if not backends.triton_backend.available()[0]:
        assert backends.resolve("auto", x, w, None) is backends.select(x, w, None)
    monkeypatch.setenv(backends.ENV_VAR, "bogus")
    with pytest.raises(NormswapError):
        backends.resolve("auto", x, w, None)


def test_describe_lists_every_backend_and_auto_choices(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    rows = backends.describe()
    names = [r["name"] for r in rows if r["name"] != "auto"]
    assert names == ["eager", "native", "cpu", "triton"]
    for r in rows:
        if r["name"] != "auto":
            assert isinstance(r["available"], bool) and r["reason"]
    autos = [r for r in rows if r["name"] == "auto"]
    assert {(r["device"], r["dtype"]) for r in autos} >= {("cpu", "float32"), ("cpu", "bfloat16"),
                                                          ("cuda", "bfloat16")}
    for r in autos:
        assert r["picks"] in backends.BACKENDS and r["why"]
        if r["device"] == "cpu":
            assert r["picks"] == ("cpu" if cpu.available()[0] else r["picks"])
    monkeypatch.setenv(backends.ENV_VAR, "eager")
    assert all("NORMSWAP_BACKEND=eager" in r["why"] for r in backends.describe() if r["name"] == "auto")


def test_constant_marker_matches_torch():
    """backends._constant_when_compiled mirrors torch.compiler.assume_constant_result."""
    marked = torch.compiler.assume_constant_result(lambda: 0)
    assert marked._dynamo_marked_constant is True
    assert backends.is_available._dynamo_marked_constant is True
    assert backends._cpu_kernel_handles._dynamo_marked_constant is True
