"""The ONNX nodes that compute a rotation's own ops, so quantizers can leave them in float.

A rotation adds matmuls by constant matrices that are not layers: ``Qᵀ`` before a norm whose output is
turned back (``output="restore"``), ``Q`` after a centering op, and the small Hadamard factor of an online
Hadamard. ONNX Runtime's quantizers (``quantize_dynamic``, ``quantize_static``, ``MatMulNBitsQuantizer``)
quantize every MatMul whose other input is a constant, these included: an int8 or 4-bit ``Qᵀ`` on the raw
residual stream (whose massive channels set its activation range) costs more than the rotation gains
(``docs/results/quantization.md``, "Rotation"). :func:`float_nodes` finds them by value, whatever names the
exporter gave them, for the quantizers' ``nodes_to_exclude``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

# rotate.py's op buffers (the last two: an online Hadamard's 2^m factors in its matmul form, plain attributes)
ROTATION_BUFFERS = ("normswap_unrotate", "normswap_rotation", "normswap_hadamard", "_normswap_hadamard_pow2",
                    "_normswap_hadamard_rest")


def rotation_matrices(model: nn.Module) -> list[torch.Tensor]:
    """Every constant matrix a rotation's ops multiply by in ``model`` (float64, on the CPU), up to a scale: the
    stored ones, and for an online Hadamard whose ``2^m`` part runs split (``H_{2^m} = H_r ⊗ H_b``) the ``H_K ⊗ H_r``
    its stock form multiplies by across the rows of ``b`` (:func:`normswap.rotation.hadamard.split_matmuls`)."""
    found = []
    for module in model.modules():
        for name in ROTATION_BUFFERS:
            value = getattr(module, name, None)
            if isinstance(value, torch.Tensor) and value.dim() == 2:
                found.append(value.detach().double().cpu())
        small, rest = getattr(module, ROTATION_BUFFERS[2], None), getattr(module, ROTATION_BUFFERS[4], None)
        if isinstance(small, torch.Tensor) and isinstance(rest, torch.Tensor):
            found.append(torch.kron(small.detach().double().cpu(), rest.double().cpu()))
    return found


def float_nodes(onnx_model: Any, model: nn.Module, *, tol: float = 1e-6) -> list[str]:
    """Names of the MatMul/Gemm nodes of ``onnx_model`` (a ``ModelProto`` or a path) that multiply by one of
    ``model``'s rotation matrices (:func:`rotation_matrices`, matched by value within ``tol``, either
    orientation, each scaled to a largest entry of 1: an exported online Hadamard's ``H_b`` holds the op's
    ``n^-½``): pass them to ONNX Runtime's quantizers as ``nodes_to_exclude`` so those ops stay in float.

    ``model`` is the rotated model the ONNX file was exported from (in memory, or loaded back with
    ``normswap.load``). A model without rotation ops gives ``[]``."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(os.fspath(onnx_model)) if isinstance(onnx_model, (str, os.PathLike)) else onnx_model
    wanted = rotation_matrices(model)
    if not wanted:
        return []
    graph = proto.graph
    constants = {t.name: t for t in graph.initializer}
    constants.update({n.output[0]: a.t for n in graph.node if n.op_type == "Constant" for a in n.attribute
                      if a.name == "value"})
    for n in graph.node:  # a constant passed on (Identity, Cast) or turned (Transpose: matched either way below)
        if n.op_type in ("Identity", "Cast", "Transpose") and n.input and n.input[0] in constants:
            constants[n.output[0]] = constants[n.input[0]]
    shapes = {tuple(w.shape) for w in wanted} | {tuple(w.shape[::-1]) for w in wanted}

    wanted = [w / w.abs().max() for w in wanted if bool(w.abs().max() > 0)]  # a stock form folds its scale in

    def is_rotation(name: str) -> bool:
        t = constants.get(name)
        if t is None or tuple(t.dims) not in shapes:
            return False
        value = torch.from_numpy(numpy_helper.to_array(t).copy()).double()
        peak = value.abs().max()
        if not bool(peak > 0):
            return False
        value = value / peak
        return any(value.shape == w.shape and torch.allclose(value, w, atol=tol, rtol=0)
                   or value.shape == w.T.shape and torch.allclose(value, w.T, atol=tol, rtol=0) for w in wanted)

    return [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm") and any(is_rotation(i) for i in n.input)]


_OP_NODES = ("Mul", "Reshape", "Transpose", "Cast", "MatMul")  # what an exported online Hadamard is made of
_SOURCE_NODES = ("Add", "Mul", "Cast", "Div")  # elementwise nodes that make an op's input (a norm's γ/β, GELU)
_SHAPE_NODES = ("Constant", "Identity", "Shape", "Concat", "Pow", "Gather", "Unsqueeze")  # constants, shapes


def qdq_float_nodes(onnx_model: Any, model: nn.Module, *, tol: float = 1e-6) -> list[str]:
    """The nodes ONNX Runtime's static (QDQ) quantizer must leave in float in a model with online Hadamards
    (``rotate(model, "none", online=True)``, ``online=True``), for ``quantize_static(..., nodes_to_exclude=)``:
    :func:`float_nodes` (the ops' matmuls) and, around each op, its sign and scale ``Mul``s and its ``Reshape``s,
    and the elementwise nodes that make the op's input (a norm's γ and β, GELU's last ``Mul``) back to the
    first tensor that something else reads too.

    Why: ONNX Runtime's QDQ registry quantizes ``Mul``, ``Add`` and ``Reshape``, so with the matmuls alone
    excluded the norm's output is still rounded per tensor before the op, massive channels and all (the
    rounding the op is there to spare it), and the op's output is rounded again where the Linears read it.
    With these nodes in float the op's input is rounded once, after the op has spread it. On the real
    DINOv2-small this takes static QDQ of the online model from 0.91× (0.81-1.03) the original's error to
    0.68× (0.58-0.78) (``docs/results/quantization.md``, round 51). Dynamic and weight-only quantizers
    (``quantize_dynamic``, ``MatMulNBitsQuantizer``) round no activation outside a ``MatMul``: give them
    :func:`float_nodes`. ``model`` as for :func:`float_nodes`; a model without rotation ops gives ``[]``."""
    import onnx

    proto = onnx.load(os.fspath(onnx_model)) if isinstance(onnx_model, (str, os.PathLike)) else onnx_model
    ops = float_nodes(proto, model, tol=tol)
    if not ops:
        return []
    graph = proto.graph
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[Any]] = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    static = {t.name for t in graph.initializer}
    op_set = set(ops)

    def dynamic(node: Any) -> list[str]:  # the inputs that carry activations (not constants or shapes)
        return [t for t in node.input if t and t not in static
                and (t not in producer or producer[t].op_type not in _SHAPE_NODES)]

    def is_op_part(node: Any) -> bool:
        return node.op_type in _OP_NODES and (node.op_type != "MatMul" or node.name in op_set)

    names: set[str] = set(ops)
    for op in ops:
        node = next(n for n in graph.node if n.name == op)
        t = node.output[0]
        while len(readers.get(t, [])) == 1 and is_op_part(readers[t][0]):  # down: the op's Reshape, scale Mul
            names.add(readers[t][0].name)
            t = readers[t][0].output[0]
        ins = dynamic(node)
        t, in_op = (ins[0] if ins else None), True
        while t is not None and t in producer:  # up: the op's Reshape and sign Mul, then its input's makers
            src = producer[t]
            if in_op and is_op_part(src):
                names.add(src.name)
            elif src.op_type in _SOURCE_NODES and len(readers.get(t, [])) <= 1:
                in_op = False
                names.add(src.name)
            else:
                break
            ins = dynamic(src)
            t = ins[0] if len(ins) == 1 else None
            if t is not None and not in_op and len(readers.get(t, [])) > 1:
                break
    return [n.name for n in graph.node if n.name in names]
