"""ONNX: what an exported converted model holds, a check that ONNX Runtime fuses it, and translations
for normswap's fused custom ops.

``torch.onnx.export(model, ...)`` needs nothing from here: while an ONNX export traces the model,
``normswap.RMSNorm`` emits the graph ONNX Runtime runs on its fused RMS kernel (see
:mod:`normswap.backends.portable` and docs/deployment.md):

============================================  ==========================================================
export                                        each RMSNorm becomes
============================================  ==========================================================
``dynamo=True``, opset >= 23                  ``RMSNormalization`` (float32/float64 with a weight)
``dynamo=True``, opsets 18-22 (default 20)    ``Pow``/``ReduceMean``/``Add``/``Sqrt``/``Div``/``Mul``, which
                                              ORT's session fuses into ``SimplifiedLayerNormalization``
``dynamo=False`` (legacy), any opset          the same subgraph, the same fusion
============================================  ==========================================================

``onnxruntime.transformers.optimizer.optimize_model`` additionally turns a residual ``Add`` before a
fused norm into ``SkipSimplifiedLayerNormalization``, but leaves the projection bias ``Add`` before it
outside, and ORT's session does neither. :func:`fuse_norms` does both, on an export or on
``optimize_model``'s output: the converted model's norms land on ``SkipSimplifiedLayerNormalization``
(with its bias input) wherever the original's land on ``SkipLayerNormalization``.
:func:`fused_norm_ops` counts what ONNX Runtime's optimiser made of an exported file, so a deployment
script can assert that every norm fused. :func:`stem_float_nodes` names the nodes static (QDQ)
quantization should leave in float so that a stream start centered by an op is rounded once, and
:func:`quantize_static` is ONNX Runtime's ``quantize_static`` with those nodes left in float: the same
call, imported from here instead.

:func:`translation_table` is for an *already exported* program that holds a fused op because a fused
backend was asked for explicitly (``backend="cpu"``/``"triton"`` or ``NORMSWAP_BACKEND``) before
``torch.export.export``::

    ep = torch.export.export(model, args)          # holds normswap::cpu_rms_norm
    torch.onnx.export(ep, dynamo=True, opset_version=23,
                      custom_translation_table=normswap.integrations.onnx.translation_table(23))

At opset >= 23 a float32/float64 norm whose weight has the normalised shape becomes one
``RMSNormalization`` node (plus an ``Add`` for a bias, exact in the input dtype there); otherwise
(lower opsets, no weight, per-head weights, and every half-precision input) the decomposition
``Cast``, ``Pow``, ``ReduceMean``, ``Add``, ``Sqrt``, ``Div``, ``Mul`` (weight) and ``Add`` (bias) in the
compute dtype (float32; float64 for float64), then one ``Cast`` back: the ``eager`` backend's cast
order, one rounding; ORT fuses it into ``SimplifiedLayerNormalization`` where the weight is 1-D.
Half precision never uses ``RMSNormalization``: the ONNX spec casts its normalised value back to the
input type before multiplying by the scale (a second rounding).
Needs ``onnxscript``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from normswap.backends.portable import ONNXSCRIPT_MIN_EPS, onnx_export_settings

MIN_RMS_NORMALIZATION_OPSET = 23

#: The ops ONNX Runtime runs an RMSNorm on in one kernel: ONNX's own, ORT's fused contrib ops.
FUSED_RMS_OPS = ("RMSNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


def fused_norm_ops(model_path: str | os.PathLike, *, providers: Sequence[str] = ("CPUExecutionProvider",),
                   level: str = "ORT_ENABLE_ALL") -> dict[str, int]:
    """How many nodes of each norm op ONNX Runtime's graph optimiser leaves in the model at ``model_path``.

    Builds an ``InferenceSession`` at optimisation ``level`` (ORT's default is ``ORT_ENABLE_ALL``), has it
    write the optimised graph to a temporary file, and counts the ops in :data:`FUSED_RMS_OPS`, ORT's
    LayerNorm ops (``LayerNormalization``, ``SkipLayerNormalization``) and ``Pow`` (what is left of a
    norm that did not fuse, or of another op, e.g. a tanh-GELU's cube where ORT did not fuse that). A
    converted model deploys fused when the first three sum to its number of ``normswap.RMSNorm``
    modules. Needs ``onnxruntime`` and ``onnx``.
    """
    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    options.log_severity_level = 3  # ORT warns that an ENABLE_ALL graph is specific to this machine
    with tempfile.TemporaryDirectory() as tmp:
        options.optimized_model_filepath = str(Path(tmp) / "optimised.onnx")
        ort.InferenceSession(str(model_path), options, providers=list(providers))
        graph = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
    counted = (*FUSED_RMS_OPS, "LayerNormalization", "SkipLayerNormalization", "Pow")
    ops = [n.op_type for n in graph.node]
    return {op: ops.count(op) for op in counted}


def stem_float_nodes(model: str | os.PathLike | Any) -> list[str]:
    """Names of the nodes ONNX Runtime's static (QDQ) quantizer should leave in float in an exported
    native model: each centering op (``x − ReduceMean(x)``, the stem op of ``stem_centering="op"``) and the
    ``Add``/``Concat`` nodes that assemble its input ``x`` (a ViT's class token, patch tokens and position
    table). Pass them as ``quantize_static(..., nodes_to_exclude=stem_float_nodes(path))``, or call
    :func:`quantize_static` from here, which does that.

    Why: QDQ puts a quantize/dequantize pair on every quantized node's output. Quantized, the uncentered
    embedding sum is rounded on its own grid and the op's centered output again on another one: two
    roundings, where the original's LayerNorm reads the sum rounded once (and that sum's grid is nearly
    the one its inputs were rounded on, so its own rounding costs almost nothing). Left in float, the sum
    is centered before its one rounding, at the op's consumers. The tokens' inputs (the patch projection,
    the class token, the table) stay quantized as in the original. ``model``: a path or an
    ``onnx.ModelProto``; a model without a centering op gives ``[]`` (a compat export, whose
    ``LayerNormalization`` centers). Every mean subtraction is named: in a model with per-norm centering ops
    (``per_norm_centering=True``, Post-LN encoders) each of them and the residual ``Add`` before it too, a
    case measured for quantization only as the stem op. Legacy and ``dynamo=True`` exports alike.
    Needs ``onnx``."""
    import onnx

    proto = onnx.load(os.fspath(model), load_external_data=False) if isinstance(model, (str, os.PathLike)) else model
    producer = {o: n for n in proto.graph.node for o in n.output}
    names: list[str] = []

    def assembly(tensor: str) -> None:  # the nodes summing/joining the stream start, back to its writers
        node = producer.get(tensor)
        if node is None or node.op_type not in ("Add", "Concat", "Cast") or node.name in names:
            return
        names.append(node.name)
        for t in node.input:
            assembly(t)

    for sub in proto.graph.node:
        mean = producer.get(sub.input[1]) if sub.op_type == "Sub" and len(sub.input) == 2 else None
        if mean is None or mean.op_type != "ReduceMean" or mean.input[0] != sub.input[0]:
            continue
        names += [mean.name, sub.name]
        assembly(sub.input[0])
    return names


def quantize_static(model_input: str | os.PathLike | Any, model_output: str | os.PathLike,
                    calibration_data_reader: Any, **options: Any) -> list[str]:
    """``onnxruntime.quantization.quantize_static`` with :func:`stem_float_nodes` added to ``nodes_to_exclude``,
    and return the names it added.

    The same arguments as ONNX Runtime's (``quant_format``, ``per_channel``, ``activation_type``, ...: passed
    through unchanged, its defaults kept); the only difference is that the nodes a stem op needs in float are
    excluded as well as any the caller names, so a native checkpoint's stream start is rounded once, as the
    original's is. Why a wrapper and not the export: the second rounding is on the output of the model's own
    embedding sum (an ``Add``, which ONNX Runtime's quantizer registry quantizes, output included), not on the
    op itself (``ReduceMean`` and ``Sub`` are not in the registry), so no form of the op in the exported graph
    can prevent it; only the quantizer's ``nodes_to_exclude`` can. A model without a centering op (the
    original, a compat export, ``stem_centering="weights"``) is quantized exactly as ONNX Runtime's own call
    would. Needs ``onnxruntime`` and ``onnx``."""
    from onnxruntime.quantization import quantize_static as ort_quantize_static

    excluded = list(options.pop("nodes_to_exclude", None) or [])
    added = [n for n in stem_float_nodes(model_input) if n not in excluded]
    ort_quantize_static(model_input, model_output, calibration_data_reader, nodes_to_exclude=excluded + added,
                        **options)
    return added


def fuse_norms(model: str | os.PathLike | Any, out: str | os.PathLike | None = None) -> Any:
    """Rewrite an exported model's RMSNorms into ONNX Runtime's fused ops, each with the residual ``Add``
    and the projection bias before it, and return the model (``onnx.ModelProto``); also saved to ``out``.

    ``model`` is a path or an ``onnx.ModelProto`` (rewritten in place): an export of a converted model
    (any path of the table above but opset 23's ``RMSNormalization``; the exporter's optimised graph, so
    not ``optimize=False``, where nothing matches and nothing changes), or the output of
    ``onnxruntime.transformers.optimizer.optimize_model``. Why: ORT fuses
    ``Add(MatMul + bias) + Add(residual) + LayerNormalization`` into one ``SkipLayerNormalization`` with
    a bias input, but neither its session nor ``optimize_model`` does the same for an RMSNorm (the
    session's Skip fusion matches ``LayerNormalization`` only; ``optimize_model``'s bias fusion
    ``SkipLayerNormalization`` only), so a converted model ran one or two more ``Add`` nodes per block
    than its original. Here, with ONNX Runtime's own fusion classes
    (``onnxruntime.transformers``), on the top-level graph:

    1. each ``Pow``/``ReduceMean``/``Add``/``Sqrt``/``Div``/``Mul`` norm becomes
       ``SimplifiedLayerNormalization`` (the session's fusion, done ahead of it);
    2. a residual ``Add`` of two activations before it becomes ``SkipSimplifiedLayerNormalization``
       (a Pre-LN block's sum, read again by the next block, comes out as its fourth output,
       ``input_skip_bias_sum``);
    3. a 1-D bias ``Add`` after a ``MatMul`` feeding that ``Add`` becomes the fused op's ``bias`` input.

    The arithmetic is the same additions in float32 (outputs agree to float32 rounding); LayerNorms
    (the original's, a compat checkpoint's) are left to ORT, which fuses them itself. Run the result
    with any ORT session (its CPU and CUDA providers have both ops). On ORT 1.32's CPU provider the fused
    graph is no faster than the unfused one (its Skip kernels cost about what the ``Add`` nodes did;
    docs/results/deploy-speed.md, fifth round): use it where the graph should match the original's
    fusion. Needs ``onnx`` and ``onnxruntime``.
    """
    import logging

    import onnx
    from onnxruntime.transformers.fusion_simplified_layernorm import (
        FusionSimplifiedLayerNormalization,
        FusionSkipSimplifiedLayerNormalization,
    )
    from onnxruntime.transformers.onnx_model import OnnxModel

    proto = onnx.load(str(model)) if isinstance(model, (str, os.PathLike)) else model
    graph = OnnxModel(proto)
    quiet = logging.getLogger("onnxruntime.transformers").level, logging.root.manager.disable
    logging.disable(logging.WARNING)  # the fusions log every pattern they skip, and shape inference's notes
    try:
        graph.remove_useless_cast_nodes()  # the legacy exporter's float-to-float Casts sit inside the pattern
        for fusion in (FusionSimplifiedLayerNormalization, FusionSkipSimplifiedLayerNormalization,
                       _bias_fusion()):
            fusion(graph).apply()
        graph.prune_graph(allow_remove_graph_inputs=False)  # an unread input stays: the signature is the export's
    finally:
        logging.disable(quiet[1])
    graph.topological_sort()
    if not any(o.domain == "com.microsoft" for o in proto.opset_import) and \
            any(n.domain == "com.microsoft" for n in proto.graph.node):
        proto.opset_import.add(domain="com.microsoft", version=1)
    if out is not None:
        big = sum(t.ByteSize() for t in proto.graph.initializer) > 1_500_000_000  # protobuf's 2 GB limit
        onnx.save(proto, str(out), save_as_external_data=big, all_tensors_to_one_file=True,
                  location=Path(out).name + ".data" if big else None)
    return proto


def _bias_fusion() -> type:
    """``SkipSimplifiedLayerNormalization(Add(MatMul(..), bias), skip, γ)`` -> its 4-input form with ``bias``:
    ``FusionBiasSkipLayerNormalization`` for the simplified op (ORT's matches ``SkipLayerNormalization``
    only, whose bias is its fifth input, after β)."""
    from onnx import helper
    from onnxruntime.transformers.fusion_base import Fusion
    from onnxruntime.transformers.fusion_utils import NumpyHelper

    class FusionBiasSkipSimplifiedLayerNormalization(Fusion):
        def __init__(self, model: Any) -> None:
            super().__init__(model, "SkipSimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                             "add bias")

        def fuse(self, node: Any, input_name_to_nodes: dict, output_name_to_node: dict) -> None:
            if len(node.input) != 3:  # already has a bias
                return
            for path in (["Add", "MatMul"], ["Add", "Cast", "MatMul"]):  # a Cast: half-precision exports
                indices: list[int] = []
                nodes = self.model.match_parent_path(node, path, [None] * len(path), output_name_to_node, indices)
                if nodes is not None:
                    break
            else:
                return
            add, which = nodes[0], indices[0]
            if which >= 2:
                return
            bias = add.input[1 - indices[1]]
            initializer = self.model.get_initializer(bias)
            if initializer is None or NumpyHelper.to_array(initializer).ndim != 1:
                return
            if not self.model.is_safe_to_fuse_nodes([node, add], node.output, input_name_to_nodes,
                                                    output_name_to_node):
                return  # the biased product is read elsewhere too
            self.nodes_to_remove.extend([node, add])
            fused = helper.make_node(
                "SkipSimplifiedLayerNormalization",
                inputs=[add.input[indices[1]], node.input[1 - which], node.input[2], bias],
                outputs=node.output,
                name=self.model.create_node_name("SkipSimplifiedLayerNormalization", "SkipRMSNorm_AddBias_"),
                domain="com.microsoft")
            fused.attribute.extend(a for a in node.attribute if a.name == "epsilon")
            self.nodes_to_add.append(fused)
            self.node_name_to_graph_name[fused.name] = self.this_graph_name

    return FusionBiasSkipSimplifiedLayerNormalization


def _ops(opset: int) -> Any:
    import onnxscript

    return getattr(onnxscript, f"opset{min(max(opset, 18), 23)}")


def _root(op: Any, xf: Any, k: int, eps: float) -> Any:
    """``sqrt(mean(xf**2) + eps)`` over the last ``k`` axes, as ``Pow(2)``, ``ReduceMean``, ``Add``, ``Sqrt``:
    the head of the pattern ORT's ``SimplifiedLayerNormFusion`` matches (``Mul(x, x)`` does not)."""
    axes = op.Constant(value_ints=list(range(-k, 0)))
    mean_sq = op.ReduceMean(op.Pow(xf, op.CastLike(op.Constant(value_float=2.0), xf)), axes, keepdims=1)
    if onnx_export_settings().optimizes:
        eps = max(eps, ONNXSCRIPT_MIN_EPS)  # onnxscript's rewriter deletes an Add of a scalar within 1e-8 of 0
    return op.Sqrt(op.Add(mean_sq, op.CastLike(op.Constant(value_float=float(eps)), xf)))


# ONNX TensorProto data types (onnx.TensorProto.FLOAT, ...), without importing onnx here
_FLOAT, _DOUBLE = 1, 11


def _elem_type(v: Any) -> int | None:
    """The ONNX element type of a symbolic value, or None when the exporter does not say."""
    dtype = getattr(v, "dtype", None)
    try:
        return int(dtype) if dtype is not None else None
    except (TypeError, ValueError):
        return None


def _make(opset: int, rstd_in_compute_dtype: bool = False) -> Callable[..., tuple]:
    """The translation of a forward op; its second output, rstd, is float32 (``cpu_rms_norm``) or in
    the compute dtype (``rstd_in_compute_dtype``: the triton ops, float64 for float64 inputs)."""
    op = _ops(opset)

    def rms_norm(x: Any, normalized_shape: Sequence[int], weight: Any = None, bias: Any = None,
                 eps: float = 1e-6) -> tuple:
        k = len(normalized_shape)
        elem = _elem_type(x)
        compute = _DOUBLE if elem == _DOUBLE else _FLOAT  # float32 statistics, float64 for float64
        xf = op.Cast(x, to=compute)
        root = _root(op, xf, k, eps)
        rstd = op.Reciprocal(root)  # the second output only; unused in inference, dropped as dead code
        flat_rstd = op.Reshape(rstd if rstd_in_compute_dtype else op.Cast(rstd, to=_FLOAT),
                               op.Constant(value_ints=[-1]))
        same_shape = weight is not None and getattr(weight, "shape", None) is not None and \
            len(weight.shape) == k
        full_precision = elem in (_FLOAT, _DOUBLE)  # unknown (None) counts as half: the safe order
        if opset >= MIN_RMS_NORMALIZATION_OPSET and same_shape and full_precision:
            y = op.RMSNormalization(x, op.CastLike(weight, x), axis=-k, epsilon=float(eps), stash_type=1)
            if bias is not None:
                y = op.Add(y, op.CastLike(bias, x))
            return y, flat_rstd
        # x / root, not x * rstd: the Div is what ORT fuses (into SimplifiedLayerNormalization, when a 1-D
        # weight follows); the compute dtype throughout, one rounding at the end (eager's order)
        y = op.Div(xf, root)
        if weight is not None:
            y = op.Mul(y, op.Cast(weight, to=compute))
        if bias is not None:
            y = op.Add(y, op.Cast(bias, to=compute))
        return op.CastLike(y, x), flat_rstd

    return rms_norm


def _make_residual(opset: int) -> Callable[..., tuple]:
    op = _ops(opset)
    norm = _make(opset, rstd_in_compute_dtype=True)

    def rms_norm_residual(x: Any, residual: Any, normalized_shape: Sequence[int], weight: Any = None,
                          bias: Any = None, eps: float = 1e-6) -> tuple:
        h = op.Add(x, residual)
        y, rstd = norm(h, normalized_shape, weight, bias, eps)
        return y, h, rstd

    return rms_norm_residual


def translation_table(opset: int = MIN_RMS_NORMALIZATION_OPSET) -> dict[Any, Callable[..., tuple]]:
    """``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True, opset_version=opset)``
    covering every normswap custom op (``cpu_rms_norm``, ``triton_rms_norm_fwd``,
    ``triton_rms_norm_residual_fwd``). Use the same ``opset`` as the export."""
    import normswap.backends  # noqa: F401  (registers the ops)

    ops = torch.ops.normswap
    table: dict[Any, Callable[..., tuple]] = {
        ops.cpu_rms_norm.default: _make(opset),
        ops.triton_rms_norm_fwd.default: _make(opset, rstd_in_compute_dtype=True),
    }
    if hasattr(ops, "triton_rms_norm_residual_fwd"):
        table[ops.triton_rms_norm_residual_fwd.default] = _make_residual(opset)
    return table
