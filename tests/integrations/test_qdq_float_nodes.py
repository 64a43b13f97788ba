"""``qdq_float_nodes``: what ONNX Runtime's static (QDQ) quantizer must leave in float in a model with online
Hadamards, so that each op's input is rounded once, after the op has spread it.

On a tiny DINOv2 replica (LayerNorm γ/β randomised) converted with ``rotate(model, "none", online=True)`` and
exported as the quantization benchmarks export it: with only the ops' matmuls excluded (:func:`float_nodes`),
QDQ still rounds the norm's and GELU's outputs before the op (the op's sign ``Mul`` and ``Reshape`` and the
norm's ``Add`` are in ONNX Runtime's registry); with :func:`qdq_float_nodes` excluded, nothing between the norm
(or GELU) and the op's matmuls is rounded, and every Linear still reads the op's output rounded once. A model
without ops names nothing; the quantized graph still computes the model."""

from __future__ import annotations

import warnings

import pytest
import torch

import normswap
from normswap.rotation.onnx_nodes import float_nodes, qdq_float_nodes
from tests.integrations.qdq_dinov2 import export, quantize_qdq, tiny_dinov2

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")


def _model(online: bool = True) -> torch.nn.Module:
    model = tiny_dinov2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(model, beta_placement="keep")
        if online:
            normswap.rotate(model, "none", online=True, seed=1)
    return model.float().eval()


def _rounded_before_ops(graph, ops: list[str]) -> list[str]:
    """The ops (each named by its first matmul) whose input is rounded on its way in: a DequantizeLinear
    anywhere from the op's input (the norm's or GELU's output, read by the op's sign ``Mul``) to its matmul."""
    producer = {o: n for n in graph.node for o in n.output}
    consts = {t.name for t in graph.initializer}
    by_name = {n.name: n for n in graph.node}

    def data(node):
        return next(t for t in node.input if t not in consts and (t not in producer or producer[t].op_type
                                                                  not in ("Constant", "Identity")))

    hit = []
    for op in ops:
        node = by_name[op]
        for _ in range(3):  # matmul <- Reshape <- sign Mul <- the op's input
            src = producer.get(data(node))
            if src is not None and src.op_type == "DequantizeLinear":
                hit.append(op)
                break
            if src is None or src.op_type not in ("Reshape", "Mul"):
                break
            node = src
    return sorted(hit)


def test_the_ops_inputs_are_rounded_only_after_the_op(tmp_path):
    model = _model()
    fp32 = tmp_path / "online.onnx"
    export(model, fp32)
    ops = float_nodes(fp32, model)
    names = qdq_float_nodes(fp32, model)
    assert set(ops) < set(names)
    graph = onnx.load(str(fp32)).graph
    kinds = {n.name: n.op_type for n in graph.node}
    assert {kinds[n] for n in names} <= {"MatMul", "Mul", "Reshape", "Add", "Cast", "Div", "Transpose"}
    first = [n for n in ops if not any(n2 in ops for n2 in _upstream_matmul(graph, n))]  # each op's first matmul

    only_matmuls = quantize_qdq(fp32, tmp_path / "matmuls.onnx", ops)
    assert _rounded_before_ops(only_matmuls, first) == sorted(first)  # every op's input rounded

    whole = quantize_qdq(fp32, tmp_path / "whole.onnx", names)
    assert _rounded_before_ops(whole, first) == []
    # each Linear that reads an op's output reads it rounded once (its input from a DequantizeLinear)
    producer = {o: n for n in whole.node for o in n.output}
    linears = [n for n in whole.node if n.op_type == "MatMul" and n.name.endswith(("q_proj/MatMul", "fc1/MatMul",
                                                                                    "fc2/MatMul"))]
    assert len(linears) == 6
    for n in linears:
        assert any(producer.get(t) is not None and producer[t].op_type == "DequantizeLinear" for t in n.input), n.name


def _upstream_matmul(graph, name: str) -> list[str]:
    producer = {o: n for n in graph.node for o in n.output}
    node = next(n for n in graph.node if n.name == name)
    return [producer[t].name for t in node.input if t in producer and producer[t].op_type == "MatMul"]


def test_a_model_without_ops_names_nothing_and_the_quantized_graph_runs(tmp_path):
    import onnxruntime as ort

    plain = _model(online=False)
    path = tmp_path / "plain.onnx"
    export(plain, path)
    assert qdq_float_nodes(path, plain) == []
    model = _model()
    fp32 = tmp_path / "online.onnx"
    export(model, fp32)
    quantize_qdq(fp32, tmp_path / "whole.onnx", qdq_float_nodes(onnx.load(str(fp32)), model))
    px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(pixel_values=px).last_hidden_state.double()
    out = ort.InferenceSession(str(tmp_path / "whole.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"pixel_values": px.numpy()})[0]
    cos = torch.nn.functional.cosine_similarity(ref, torch.from_numpy(out).double(), dim=-1)
    assert float((1 - cos).mean()) < 0.05  # int8 rounding, not a broken graph
