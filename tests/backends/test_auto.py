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
    backends.refresh()
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
    bf16 = torch.bfloat16

    def pick(rows, n, **kw):
        return backends.select_for("cuda", bf16, rows, n, **kw)[0]

    # eager: triton's extra host time (~60 us forward, ~530 us forward+backward on the measured H100
    # host) outweighs the GPU time it saves at the shapes where auto used to pick it
    for rows, n in ((512, 4096), (2048, 4096), (16, 4096), (1, 768)):
        assert pick(rows, n) == "native"
        assert pick(rows, n, grad=True) == "native"
    # the crossovers measured on an H200 cap the additive model
    assert pick(8192, 4096) == "triton"  # 42.5 vs 46.6 us
    assert pick(8192, 8192, grad=True) == "native"  # backward 467 vs 357 us
    assert pick(32768, 4096) == "triton"
    assert pick(32768, 4096, grad=True) == "triton"  # backward 457 vs 598 us
    # fp32 moves twice the bytes: triton pays from half the elements
    assert backends.eager_triton_min_elements(torch.float32, grad=False, extra_pass=False) == pytest.approx(
        backends.eager_triton_min_elements(bf16, grad=False, extra_pass=False) / 2)
    # bias / per-head: native needs one more elementwise op, which triton saves too; in half precision
    # native's float32 route (one rounding) costs an upcast and float32 traffic on top
    assert pick(8192, 4096, bias=True) == "triton"
    assert pick(2048, 4096, bias=True) == "triton"
    assert pick(512, 4096, bias=True) == "native"  # host time still decides at small shapes
    assert pick(2048, 4096, bias=True, grad=True) == "native"
    assert backends.select_for("cuda", torch.float32, 2048, 4096, bias=True)[0] == "native"  # no fp32 route
    assert backends.eager_triton_min_elements(bf16, grad=False, extra_pass=True) < \
        backends.eager_triton_min_elements(bf16, grad=False, extra_pass=True, fp32_route=False) < \
        backends.eager_triton_min_elements(bf16, grad=False, extra_pass=False)
    assert backends.native_fp32_route(bf16, True) and not backends.native_fp32_route(torch.float32, True)
    # compiled / graph capture: GPU time only
    assert pick(8192, 4096, graph=True) == "triton"
    assert pick(8192, 512, graph=True) == "triton"  # measured on an H200: 6.3 vs 8.7 us
    assert pick(8192, 768, graph=True) == "triton"  # 9.6 vs 10.7 us
    assert pick(8192, 512, graph=True, grad=True) == "triton"  # fwd+bwd 26.4 vs 40.5 us
    assert pick(1024, 768, graph=True) == "native"  # below anything measured
    assert pick(8192, 256, graph=True) == "native"
    assert pick(16384, 768, graph=True, grad=True) == "triton"  # fwd+bwd 72 vs 114 us
    assert pick(16, 768, graph=True, bias=True) == "triton"  # one fused kernel vs native + add
    # row length limits
    assert pick(64, 65536, graph=True) == "native"  # > triton.MAX_N
    assert pick(4096, 16384, graph=True, grad=True) == "native"  # > CUDA_TRITON_MAX_N
    assert pick(8192, backends.CUDA_TRITON_MAX_N, graph=True) == "triton"
    monkeypatch.setattr(backends, "is_available", lambda name: name != "triton")
    assert backends.select_for("cuda", bf16, 65536, 4096) == ("native", "triton is not available")
    assert backends.select_for("mps", torch.float32, 8192, 4096)[0] == "native"


def test_env_var_overrides_auto_but_not_an_explicit_argument(monkeypatch):
    x, w = torch.randn(4, 32), torch.ones(32)
    monkeypatch.setenv(backends.ENV_VAR, "eager")
    backends.refresh()  # read once per process: a change takes effect on refresh()
    try:
        assert backends.resolve("auto", x, w, None) is backends.eager
        assert backends.resolve("native", x, w, None) is backends.native
        m = normswap.RMSNorm(32)
        assert torch.allclose(m(x), backends.eager.rms_norm(x, (32,), m.weight, None, m.eps))
        monkeypatch.setenv(backends.ENV_VAR, "triton")  # not runnable here (no CUDA): falls back to auto
        backends.refresh()
        if not backends.triton_backend.available()[0]:
            assert backends.resolve("auto", x, w, None) is backends.select(x, w, None)
    finally:
        monkeypatch.delenv(backends.ENV_VAR)
        backends.refresh()


def test_env_var_is_read_once_until_refresh(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    backends.refresh()
    x = torch.randn(4, 32)
    m = normswap.RMSNorm(32)
    m(x)
    monkeypatch.setenv(backends.ENV_VAR, "eager")
    assert backends.env_backend() == "auto"  # not re-read per call
    calls = []
    monkeypatch.setattr(backends.eager, "rms_norm", lambda *a: calls.append(1) or a[0])
    m(x)
    assert not calls
    backends.refresh()  # now it takes effect, for modules that already decided too
    m(x)
    assert calls
    monkeypatch.delenv(backends.ENV_VAR)
    backends.refresh()


def test_bogus_env_var_fails_on_first_read_with_the_valid_names(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "bogus")
    backends.refresh()
    try:
        with pytest.raises(NormswapError) as info:
            normswap.RMSNorm(8)(torch.randn(2, 8))
        msg = str(info.value)
        assert "\n" not in msg and "bogus" in msg
        assert all(name in msg for name in backends.names())
    finally:
        monkeypatch.delenv(backends.ENV_VAR)
        backends.refresh()


def test_describe_lists_every_backend_and_auto_choices(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    backends.refresh()
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
        if r["device"] == "cpu" and r["mode"] == "eager":
            assert r["picks"] == ("cpu" if cpu.available()[0] else r["picks"])
        elif r["device"] == "cpu":  # compiled: what inductor can fuse with its neighbours
            assert r["picks"] in ("native", "eager") and r["why"].startswith("compiled")
    monkeypatch.setenv(backends.ENV_VAR, "eager")
    backends.refresh()
    try:
        assert all("NORMSWAP_BACKEND=eager" in r["why"] for r in backends.describe() if r["name"] == "auto")
    finally:
        monkeypatch.delenv(backends.ENV_VAR)
        backends.refresh()


def test_constant_marker_matches_torch():
    """backends._constant_when_compiled mirrors torch.compiler.assume_constant_result."""
    marked = torch.compiler.assume_constant_result(lambda: 0)
    assert marked._dynamo_marked_constant is True
    assert backends.is_available._dynamo_marked_constant is True
    assert backends._cpu_kernel_handles._dynamo_marked_constant is True
