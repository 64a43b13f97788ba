"""The sentence-encoder quantization benchmark's online-Hadamard variants (``benchmarks/bench_quant_encoders.py``).

What can be wrong without anything crashing: an ``online…`` variant that is not the conversion it names plus the
ops (another function: the benchmark would rank a different model), and ``--float-ops`` not reaching ONNX Runtime's
quantizer (the ops' MatMuls rounded like weights: a different quantized model than the one the docs describe).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests import benchmark_modules
from tests.benchmark_modules import tiny_bert

encoders = benchmark_modules.load("bench_quant_encoders")


def test_online_names_parse_into_their_conversion_and_block():
    assert encoders.online_parts("online") == ("converted", None)
    assert encoders.online_parts("online-converted-pnc-nocarry-keep") == ("converted-pnc-nocarry-keep", None)
    assert encoders.online_parts("online-b32-converted-keep") == ("converted-keep", 32)
    assert encoders.online_parts("converted-fold") == ("converted-fold", None)
    assert set(encoders.ONLINE) <= set(encoders.VARIANTS)


@pytest.mark.parametrize("name", ["online-converted-pnc-nocarry-keep", "online-b32-converted-pnc-nocarry-keep"])
def test_an_exact_online_variant_is_the_original_function_with_the_ops_installed(name, tmp_path):
    from normswap.rotation.onnx_nodes import rotation_matrices

    original = tiny_bert().double()
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, note = encoders.build(name, original, tmp_path)
    assert "online Hadamards" in note and ("block" in note) == ("b32" in name)
    assert rotation_matrices(model), "no op installed"
    with torch.no_grad():
        want = original(input_ids=ids, attention_mask=mask).last_hidden_state
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.allclose(got, want, rtol=0, atol=1e-10 * want.abs().max())
    # the conversion alone (no ops) differs from the online variant's weights: the ops are really there
    plain, _ = encoders.build("converted-pnc-nocarry-keep", original, tmp_path)
    q = dict(plain.named_parameters())
    turned = [k for k, v in model.named_parameters() if k in q and v.shape == q[k].shape and not torch.equal(v, q[k])]
    assert turned


def _constants_to_initializers(path) -> None:
    """Every ``Constant`` node's tensor made a graph initializer (the exporter keeps this tiny model's op matrices
    as ``Constant`` nodes, which ONNX Runtime's quantizers never treat as weights; in the real checkpoints' exports
    they are initializers, and only then does leaving them out of the quantizer take ``nodes_to_exclude``)."""
    import onnx

    proto = onnx.load(str(path))
    graph = proto.graph
    for node in [n for n in graph.node if n.op_type == "Constant"]:
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        if value is None or len(value.dims) < 2:
            continue
        value.name = node.output[0]
        graph.initializer.append(value)
        graph.node.remove(node)
    onnx.save(proto, str(path))


def test_float_ops_keep_the_ops_out_of_onnx_runtimes_dynamic_quantizer(tmp_path):
    import onnx

    from normswap.rotation.onnx_nodes import float_nodes

    original = tiny_bert()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = encoders.build("online-converted-pnc-nocarry-keep", original, tmp_path)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    fp32 = tmp_path / "online.onnx"
    encoders.export(model, example, fp32)
    _constants_to_initializers(fp32)  # as the exporter stores them in larger models (the real encoders, Whisper)
    ops = float_nodes(fp32, model)
    assert ops
    kept = {n.name: n.op_type for n in onnx.load(str(encoders.quantize(fp32, "dyn-pt", exclude=ops))).graph.node}
    assert all(kept.get(n) == "MatMul" for n in ops), "an op was quantized"
    assert any(t == "MatMulInteger" for t in kept.values()), "nothing quantized at all"
    (fp32.with_name("online.dyn-pt.onnx")).unlink()
    rounded = {n.name: n.op_type for n in onnx.load(str(encoders.quantize(fp32, "dyn-pt"))).graph.node}
    assert any(rounded.get(n) != "MatMul" for n in ops), "without exclude no op is quantized: this test shows nothing"
