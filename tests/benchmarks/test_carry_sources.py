"""The mean-carry decomposition's replica of ONNX Runtime dynamic int8 (``benchmarks/carry_sources.py``).

Every finding of the decomposition (which of the carry's roundings costs what) rests on the replica
rounding as ``onnxruntime.quantization.quantize_dynamic`` does: symmetric int8 weights with one step per
tensor or per output channel, the MatMul's input on a dynamic asymmetric uint8 grid over its range widened
to hold 0. Checked here against ONNX Runtime itself on one Linear, and the replica's ``exact`` switches
against a hand-built expectation.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from torch import nn

from tests import benchmark_modules

cs = benchmark_modules.load("carry_sources")


@pytest.mark.parametrize("per_channel", [False, True])
def test_the_replica_rounds_as_onnx_runtime_quantize_dynamic(tmp_path, per_channel):
    ort = pytest.importorskip("onnxruntime")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    torch.manual_seed(0)
    lin = nn.Linear(24, 16, bias=False)
    with torch.no_grad():
        lin.weight.mul_(torch.linspace(0.1, 3.0, 16)[:, None])  # rows of different peaks: per channel differs
        # Every second input's weights zero: ONNX Runtime's u8s8 kernel on AVX2 without VNNI (vpmaddubsw) sums
        # two adjacent uint8 x int8 products in int16 and saturates there (its docs: use reduce_range on such
        # CPUs). With one product per pair it cannot, so what is checked is the replica's grids, not the CPU.
        lin.weight[:, 1::2] = 0
    x = torch.randn(5, 24) * 2 + 0.7
    fp32, q = tmp_path / "lin.onnx", tmp_path / "lin.q.onnx"
    torch.onnx.export(lin, (x,), str(fp32), input_names=["x"], output_names=["y"], dynamo=False, opset_version=17)
    quantize_dynamic(str(fp32), str(q), weight_type=QuantType.QInt8, per_channel=per_channel)
    got = ort.InferenceSession(str(q), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    ours = cs.quant_act(x) @ cs.quant_weight(lin.weight.detach(), per_channel).T
    np.testing.assert_allclose(got, ours.numpy(), rtol=1e-5, atol=1e-5)
    # and it is not the float result: the check can tell a replica that rounds nothing
    assert np.abs(got - (x @ lin.weight.detach().T).numpy()).max() > 1e-3


def test_exact_switches_keep_only_the_named_carry_source_in_float():
    """``up`` keeps the carry's two rows, ``down`` its two columns, ``act`` its two activations (on the
    grid the whole intermediate sets); everything else is rounded."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6))
    carry = types.SimpleNamespace(up="0", down="2", hidden=8)
    x = torch.randn(3, 6)
    rows = slice(8, 10)
    for source in cs.SOURCES:
        exact = {s: ({"2"} if s == source else set()) for s in cs.SOURCES}
        q = cs.quantized(model, [carry], False, exact)
        up_w, down_w = q[0].weight.detach(), q[2].weight.detach()
        assert torch.equal(up_w[rows], model[0].weight[rows]) == (source == "up")
        assert torch.equal(down_w[:, rows], model[2].weight[:, rows]) == (source == "down")
        seen = {}
        # down's input as the GELU gives it, and as down receives it after the replica's rounding hook
        q[1].register_forward_hook(lambda m, a, out, seen=seen: seen.setdefault("h", out.clone()))
        q[2].register_forward_pre_hook(lambda m, a, seen=seen: seen.setdefault("rounded", a[0].clone()))
        with torch.no_grad():
            q(x)
        h, rounded = seen["h"], seen["rounded"]
        torch.testing.assert_close(rounded[:, rows], h[:, rows] if source == "act" else cs.quant_act(h)[:, rows])
        torch.testing.assert_close(rounded[:, :8], cs.quant_act(h)[:, :8])
        assert not torch.equal(rounded[:, :8], h[:, :8])
