"""``stem_float_nodes``: the nodes ONNX Runtime's static (QDQ) quantizer should leave in float so that a
stream start centered by the stem op (``stem_centering="op"``, the default) is rounded once.

On a tiny DINOv2 replica (LayerNorm γ/β randomised) converted natively and exported as the quantization
benchmarks export it: quantized by default, QDQ rounds the uncentered embedding sum and then the op's centered
output again (the mechanism behind the native format's static-QDQ cost, docs/results/quantization.md); with
the named nodes excluded, the sum reaches the op unrounded and the centered stream is rounded once. A compat
export (no op) and a ``stem_centering="weights"`` export (no op) name nothing. ``quantize_static`` from
``normswap.integrations.onnx`` (ONNX Runtime's call with those nodes excluded) does the same with nothing named
by the user, keeps the caller's own exclusions and options, and is ONNX Runtime's call on a model without the op.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import transformers as tf

import normswap
from tests.integrations.qdq_dinov2 import export, quantize_qdq, tiny_dinov2

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")


def _converted(**options) -> torch.nn.Module:
    model = copy.deepcopy(tiny_dinov2())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(model, **options)
    return model.float().eval()


def _rounded(graph, tensor: str) -> bool:
    """Whether ``tensor`` is read back from a QuantizeLinear/DequantizeLinear pair (rounded to int8)."""
    producer = {o: n for n in graph.node for o in n.output}
    node = producer.get(tensor)
    return node is not None and node.op_type == "DequantizeLinear"


def _stem_op(graph):
    producer = {o: n for n in graph.node for o in n.output}
    for sub in graph.node:
        mean = producer.get(sub.input[1]) if sub.op_type == "Sub" else None
        if mean is not None and mean.op_type == "ReduceMean":
            return mean, sub
    raise AssertionError("no centering op in the graph")


def test_the_stem_op_and_the_embedding_sum_are_named_and_the_stream_is_rounded_once(tmp_path):
    from normswap.integrations.onnx import stem_float_nodes

    fp32 = tmp_path / "native.onnx"
    export(_converted(), fp32)
    names = stem_float_nodes(fp32)
    graph = onnx.load(str(fp32)).graph
    by_name = {n.name: n for n in graph.node}
    mean, sub = _stem_op(graph)
    assert {mean.name, sub.name} <= set(names)
    ops = sorted(by_name[n].op_type for n in names)
    # the op, the Add of the position table, the Concat of class token and patches (and of the table's rows)
    assert ops.count("Add") == 1 and ops.count("Concat") >= 1, ops
    assert by_name[[n for n in names if by_name[n].op_type == "Add"][0]].output[0] == sub.input[0]

    default = quantize_qdq(fp32, tmp_path / "default.onnx", [])
    mean_q, sub_q = _stem_op(default)
    assert _rounded(default, sub_q.input[0])  # the uncentered sum rounded before the op: the first rounding

    excluded = quantize_qdq(fp32, tmp_path / "excluded.onnx", names)
    mean_q, sub_q = _stem_op(excluded)
    assert not _rounded(excluded, sub_q.input[0]) and not _rounded(excluded, mean_q.input[0])
    # the centered stream is rounded once, where it is read: quantized itself, or through the norm's Cast
    readers = [n for n in excluded.node if sub_q.output[0] in n.input]
    assert readers, "the op's output is read"
    for n in readers:
        if n.op_type != "QuantizeLinear":
            assert n.op_type == "Cast", n.op_type
            after = [m.op_type for m in excluded.node if n.output[0] in m.input]
            assert after == ["QuantizeLinear"], after


def test_the_dynamo_export_names_the_same_nodes(tmp_path):
    from normswap.integrations.onnx import stem_float_nodes

    path = tmp_path / "native-dynamo.onnx"
    export(_converted(), path, dynamo=True)
    graph = onnx.load(str(path)).graph
    by_name = {n.name: n for n in graph.node}
    names = stem_float_nodes(path)
    mean, sub = _stem_op(graph)
    assert {mean.name, sub.name} <= set(names)
    assert by_name[[n for n in names if by_name[n].op_type == "Add"][0]].output[0] == sub.input[0]
    assert any(by_name[n].op_type == "Concat" for n in names)


@pytest.mark.parametrize("options", [{"stem_centering": "weights"}, {"format": "compat"}])
def test_a_model_without_the_stem_op_names_nothing(tmp_path, options):
    from normswap.integrations.onnx import stem_float_nodes

    if "format" in options:  # what --format compat writes: stock LayerNorms, no op in the graph
        model = _converted()
        normswap.save(model, tmp_path / "compat", format="compat")
        model = tf.Dinov2Model.from_pretrained(tmp_path / "compat").float().eval()
    else:
        model = _converted(**options)
    path = tmp_path / "model.onnx"
    export(model, path)
    assert stem_float_nodes(path) == []
    assert stem_float_nodes(onnx.load(str(path))) == []


def _reader(seed: int = 2):
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(seed)
            self.feeds = iter([{"pixel_values": torch.randn(4, 3, 32, 32, generator=g).numpy()} for _ in range(2)])

        def get_next(self):
            return next(self.feeds, None)

    return Reader()


def _quiet(call, *args, **kwargs):
    logging.disable(logging.WARNING)
    try:
        return call(*args, **kwargs)
    finally:
        logging.disable(logging.NOTSET)


def _run(path, px: torch.Tensor) -> torch.Tensor:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {"pixel_values": px.numpy()})[0]).double()


def _error(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Mean 1 − cosine over tokens."""
    return float((1 - torch.nn.functional.cosine_similarity(ref, out, dim=-1)).mean())


def test_normswaps_quantize_static_rounds_the_native_stream_once_with_onnx_runtimes_defaults(tmp_path):
    """The user's default path: export the native checkpoint, call ``quantize_static`` with nothing but the
    calibration reader (ONNX Runtime's defaults: QDQ, int8 activations and weights), from normswap instead of
    from ONNX Runtime. The embedding sum is not rounded before the op; the centered stream is rounded once;
    the outputs stay close to the float model's."""
    from onnxruntime.quantization import quantize_static as ort_quantize_static

    from normswap.integrations.onnx import quantize_static, stem_float_nodes

    fp32 = tmp_path / "native.onnx"
    export(_converted(), fp32)
    added = _quiet(quantize_static, str(fp32), str(tmp_path / "ns.onnx"), _reader())
    assert added == stem_float_nodes(fp32) and added
    graph = onnx.load(str(tmp_path / "ns.onnx")).graph
    mean, sub = _stem_op(graph)
    producer = {o: n for n in graph.node for o in n.output}
    assert not _rounded(graph, sub.input[0]) and not _rounded(graph, mean.input[0])
    assert producer[sub.input[0]].op_type == "Add"  # the sum itself, in float
    assert not [n for n in graph.node if n.op_type == "QuantizeLinear" and sub.input[0] in n.input]
    quantized_reads = 0
    for n in (n for n in graph.node if sub.output[0] in n.input):  # rounded once, where it is read
        after = [m.op_type for m in graph.node if n.output[0] in m.input] if n.op_type == "Cast" else []
        assert n.op_type == "QuantizeLinear" or after == ["QuantizeLinear"], (n.op_type, after)
        quantized_reads += 1
    assert quantized_reads >= 1

    _quiet(ort_quantize_static, str(fp32), str(tmp_path / "ort.onnx"), _reader())
    default = onnx.load(str(tmp_path / "ort.onnx")).graph
    assert _rounded(default, _stem_op(default)[1].input[0])  # ONNX Runtime's own call rounds the sum first

    px = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    ref = _run(fp32, px)
    err = _error(ref, _run(tmp_path / "ns.onnx", px))
    assert 0 < err < 0.05, err  # quantized (not float), and close


def test_normswaps_quantize_static_keeps_the_callers_exclusions_and_options(tmp_path):
    from onnxruntime.quantization import QuantFormat, QuantType

    from normswap.integrations.onnx import quantize_static, stem_float_nodes

    fp32 = tmp_path / "native.onnx"
    export(_converted(), fp32)
    graph = onnx.load(str(fp32)).graph
    matmul = next(n.name for n in graph.node if n.op_type == "MatMul")
    stem = stem_float_nodes(fp32)
    added = _quiet(quantize_static, onnx.load(str(fp32)), str(tmp_path / "q.onnx"), _reader(),
                   nodes_to_exclude=[matmul, stem[0]], quant_format=QuantFormat.QDQ,
                   activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    assert added == stem[1:]  # a ModelProto works; a name the caller gave is not added twice
    q = onnx.load(str(tmp_path / "q.onnx")).graph
    weights = [t for t in next(n for n in graph.node if n.name == matmul).input
               if t in {i.name for i in graph.initializer}]
    node = next(n for n in q.node if n.name == matmul)
    assert weights and set(weights) <= set(node.input)  # the caller's node keeps its float weight
    assert not any(_rounded(q, t) for t in weights)
    stem_q = _stem_op(q)
    assert not _rounded(q, stem_q[1].input[0])  # and normswap's are excluded too
    zero_points = [i for i in q.initializer if i.name.endswith("zero_point")]
    assert any(z.data_type == onnx.TensorProto.UINT8 for z in zero_points)  # the caller's activation type


def test_normswaps_quantize_static_on_a_model_without_the_op_is_onnx_runtimes(tmp_path):
    from onnxruntime.quantization import quantize_static as ort_quantize_static

    from normswap.integrations.onnx import quantize_static

    model = _converted()
    normswap.save(model, tmp_path / "compat", format="compat")
    fp32 = tmp_path / "compat.onnx"
    export(tf.Dinov2Model.from_pretrained(tmp_path / "compat").float().eval(), fp32)
    assert _quiet(quantize_static, fp32, tmp_path / "ns.onnx", _reader()) == []
    _quiet(ort_quantize_static, fp32, tmp_path / "ort.onnx", _reader())
    px = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    assert torch.equal(_run(tmp_path / "ns.onnx", px), _run(tmp_path / "ort.onnx", px))
