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

# rotate.py's op buffers (the last: an online Hadamard's 2^m factor in its matmul form, a plain attribute)
ROTATION_BUFFERS = ("normswap_unrotate", "normswap_rotation", "normswap_hadamard", "_normswap_hadamard_pow2")


def rotation_matrices(model: nn.Module) -> list[torch.Tensor]:
    """Every constant matrix a rotation's ops multiply by in ``model`` (float64, on the CPU)."""
    found = []
    for module in model.modules():
        for name in ROTATION_BUFFERS:
            value = getattr(module, name, None)
            if isinstance(value, torch.Tensor) and value.dim() == 2:
                found.append(value.detach().double().cpu())
    return found


def float_nodes(onnx_model: Any, model: nn.Module, *, tol: float = 1e-6) -> list[str]:
    """Names of the MatMul/Gemm nodes of ``onnx_model`` (a ``ModelProto`` or a path) that multiply by one of
    ``model``'s rotation matrices (:func:`rotation_matrices`, matched by value within ``tol``, either
    orientation): pass them to ONNX Runtime's quantizers as ``nodes_to_exclude`` so those ops stay in float.

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

    def is_rotation(name: str) -> bool:
        t = constants.get(name)
        if t is None or tuple(t.dims) not in shapes:
            return False
        value = torch.from_numpy(numpy_helper.to_array(t).copy()).double()
        return any(value.shape == w.shape and torch.allclose(value, w, atol=tol, rtol=0)
                   or value.shape == w.T.shape and torch.allclose(value, w.T, atol=tol, rtol=0) for w in wanted)

    return [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm") and any(is_rotation(i) for i in n.input)]
