"""``stem_float_nodes``: the nodes ONNX Runtime's static (QDQ) quantizer should leave in float so that a
stream start centered by the stem op (``stem_centering="op"``, the default) is rounded once.

On a tiny DINOv2 replica (LayerNorm γ/β randomised) converted natively and exported as the quantization
benchmarks export it: quantized by default, QDQ rounds the uncentered embedding sum and then the op's centered
output again (the mechanism behind the native format's static-QDQ cost, docs/results/quantization.md); with
the named nodes excluded, the sum reaches the op unrounded and the centered stream is rounded once. A compat
export (no op) and a ``stem_centering="weights"`` export (no op) name nothing.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import transformers as tf

import normswap
from tests import zoo

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")


def _dinov2() -> torch.nn.Module:
    torch.manual_seed(0)
    model = tf.Dinov2Model(tf.Dinov2Config(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, mlp_ratio=2))
    return zoo.randomise(model, 0).float().eval()


def _export(model: torch.nn.Module, path, dynamo: bool = False) -> None:
    class Body(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return self.model(pixel_values=pixel_values).last_hidden_state

    px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():  # the export the quantization benchmarks use
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            if dynamo:  # the export the deployment guide names first
                torch.onnx.export(Body(), (px,), str(path), dynamo=True, verbose=False)
            else:
                torch.onnx.export(Body(), (px,), str(path), dynamo=False, opset_version=17,
                                  input_names=["pixel_values"], dynamic_axes={"pixel_values": {0: "batch"}})
        finally:
            logging.disable(logging.NOTSET)


def _converted(**options) -> torch.nn.Module:
    model = copy.deepcopy(_dinov2())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(model, **options)
    return model.float().eval()


def _qdq(fp32, out, exclude: list[str]):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(2)
            self.feeds = iter([{"pixel_values": torch.randn(4, 3, 32, 32, generator=g).numpy()} for _ in range(2)])

        def get_next(self):
            return next(self.feeds, None)

    logging.disable(logging.WARNING)
    try:
        quantize_static(str(fp32), str(out), Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8, nodes_to_exclude=exclude)
    finally:
        logging.disable(logging.NOTSET)
    return onnx.load(str(out)).graph


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
    _export(_converted(), fp32)
    names = stem_float_nodes(fp32)
    graph = onnx.load(str(fp32)).graph
    by_name = {n.name: n for n in graph.node}
    mean, sub = _stem_op(graph)
    assert {mean.name, sub.name} <= set(names)
    ops = sorted(by_name[n].op_type for n in names)
    # the op, the Add of the position table, the Concat of class token and patches (and of the table's rows)
    assert ops.count("Add") == 1 and ops.count("Concat") >= 1, ops
    assert by_name[[n for n in names if by_name[n].op_type == "Add"][0]].output[0] == sub.input[0]

    default = _qdq(fp32, tmp_path / "default.onnx", [])
    mean_q, sub_q = _stem_op(default)
    assert _rounded(default, sub_q.input[0])  # the uncentered sum rounded before the op: the first rounding

    excluded = _qdq(fp32, tmp_path / "excluded.onnx", names)
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
    _export(_converted(), path, dynamo=True)
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
    _export(model, path)
    assert stem_float_nodes(path) == []
    assert stem_float_nodes(onnx.load(str(path))) == []
