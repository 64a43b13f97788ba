"""``torch.export`` of converted models.

Before issue 15, ``torch.export.export`` as the first RMSNorm call of a process failed with "Cannot
access data pointer of Tensor (FakeTensor)" (the CPU kernel's first-use self-test ran on fake tensors),
and a program exported on the default backend held ``normswap::cpu_rms_norm`` (no load without
``import normswap``).
"""

from __future__ import annotations

import pytest
import torch

import normswap
from normswap.backends import cpu
from tests.integrations.compat import Positional, first_output, tiny_converted, torch_export_fresh


@pytest.mark.parametrize("name", ["gpt2"])  # ViT: test_export_with_cold_kernel_in_process
def test_fresh_process_export_then_load_without_normswap(name, warm_python):
    # new processes, not empty interpreters: what matters is that neither imported normswap (asserted by the
    # second) and that the export is the first's first RMSNorm call; the warm server's children are both
    r = torch_export_fresh(name, warm_python)
    assert not any("normswap" in t for t in r["targets"]), r["targets"]
    assert "aten.rms_norm.default" in r["targets"]
    assert not r["normswap_loaded"]
    assert r["max_rel"] < 1e-6, r


def test_export_with_cold_kernel_in_process(monkeypatch):
    """The kernel build runs on real tensors even when its first use is inside export."""
    model, inputs = tiny_converted("vit")
    for m in model.modules():
        if isinstance(m, normswap.RMSNorm):
            m.backend = "cpu"  # asked for explicitly: the fused op stays in the graph
    cpu.reset()
    ep = torch.export.export(model, (), kwargs=inputs)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "normswap.cpu_rms_norm.default" in targets
    assert cpu.kernel().fn is not None, cpu.kernel().reason  # built and self-tested, not failed
    with torch.no_grad():
        got, ref = first_output(ep.module()(**inputs)), first_output(model(**inputs))
    assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_jit_trace_never_records_kernel_output():
    model, inputs = tiny_converted("vit")
    x = inputs["pixel_values"]
    traced = torch.jit.trace(Positional(model, inputs), (x,), check_trace=False)
    with torch.no_grad():
        y2 = x * 0.5 + 0.1
        assert (traced(y2) - model(pixel_values=y2).logits).abs().max() < 1e-5


def test_fake_impls_touch_no_data_and_build_nothing():
    """Every normswap custom op runs under FakeTensorMode on metadata alone: no data pointer, and the
    cpu kernel is not built (its first use belongs to real tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cpu.reset()
    ops = torch.ops.normswap
    with FakeTensorMode():
        x = torch.empty(3, 5, 16)
        w, b = torch.empty(16), torch.empty(16)
        y, rstd = ops.cpu_rms_norm(x, [16], w, b, 1e-5)
        assert y.shape == x.shape and rstd.shape == (15,)
        dx, dw, db = ops.cpu_rms_norm_bwd(y, x, rstd, [16], w, b, 1e-5)
        assert dx.shape == x.shape and dw.shape == w.shape and db.shape == b.shape
        y, rstd = ops.triton_rms_norm_fwd(x, [16], w, None, 1e-5)
        assert y.shape == x.shape and rstd.shape == (15,)
        y, h, rstd = ops.triton_rms_norm_residual_fwd(x, x, [16], w, b, 1e-5)
        assert y.shape == h.shape == x.shape
    assert cpu._kernel is None


def test_jit_script_compiles_the_eager_math():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), normswap.RMSNorm(16, eps=1e-5, bias=True))
    with torch.no_grad():
        model[1].weight.normal_()
        model[1].bias.normal_()
    scripted = torch.jit.script(model)
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.allclose(scripted(x), model(x), rtol=1e-6, atol=1e-6)
    assert scripted[1].weight.data_ptr() == model[1].weight.data_ptr()  # parameters shared, not copied


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_export_and_script_round_once(dtype):
    """Exported (torch.export, then decomposed to core aten) and scripted RMSNorms compute eager's
    one-rounding function bit for bit in half precision, bias included. ``aten.rms_norm`` itself also
    rounds once for a half-precision input with a weight of its dtype (its decomposition multiplies the
    weight in float32 and casts once), which is what export.py states about it."""
    torch.manual_seed(0)
    x = torch.randn(6, 5, 48).to(dtype)
    for bias in (False, True):
        norm = normswap.RMSNorm(48, eps=1e-5, bias=bias, dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.5 * torch.randn(48))
            if bias:
                norm.bias.copy_(0.5 * torch.randn(48))
        with torch.no_grad():
            want = normswap.backends.eager.rms_norm(x, (48,), norm.weight, norm.bias, 1e-5)
            ep = torch.export.export(norm, (x,)).run_decompositions()
            assert torch.equal(ep.module()(x), want)
            assert torch.equal(torch.jit.script(norm)(x), want)
    w = norm.weight.detach()

    class Plain(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.rms_norm(x, (48,), w, 1e-5)

    with torch.no_grad():
        ep = torch.export.export(Plain(), (x,)).run_decompositions()
        assert torch.equal(ep.module()(x), normswap.backends.eager.rms_norm(x, (48,), w, None, 1e-5))
