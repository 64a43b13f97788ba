"""ONNX translations for normswap's fused custom ops.

``torch.onnx.export(model, ...)`` never needs these: while an ONNX export traces the model,
``normswap.RMSNorm`` emits stock aten ops (see :mod:`normswap.integrations.export`). They are for an
*already exported* program that holds a fused op because a fused backend was asked for explicitly
(``backend="cpu"``/``"triton"`` or ``NORMSWAP_BACKEND``) before ``torch.export.export``::

    ep = torch.export.export(model, args)          # holds normswap::cpu_rms_norm
    torch.onnx.export(ep, dynamo=True, opset_version=23,
                      custom_translation_table=normswap.integrations.onnx.translation_table(23))

At opset >= 23 a norm whose weight has the normalised shape becomes one ``RMSNormalization`` node;
otherwise (lower opsets, no weight, per-head weights) the decomposition ``Cast``, ``Mul``,
``ReduceMean``, ``Add``, ``Sqrt``, ``Reciprocal``, ``Mul`` (weight) and ``Add`` (bias), in the ``eager``
backend's cast order (float32 statistics, normalised value rounded to the input dtype before the
weight multiply). Needs ``onnxscript``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

MIN_RMS_NORMALIZATION_OPSET = 23


def _ops(opset: int) -> Any:
    import onnxscript

    return getattr(onnxscript, f"opset{min(max(opset, 18), 23)}")


def _rstd(op: Any, xf: Any, k: int, eps: float) -> Any:
    axes = op.Constant(value_ints=list(range(-k, 0)))
    mean_sq = op.ReduceMean(op.Mul(xf, xf), axes, keepdims=1)
    return op.Reciprocal(op.Sqrt(op.Add(mean_sq, op.Constant(value_float=float(eps)))))


def _make(opset: int) -> Callable[..., tuple]:
    op = _ops(opset)

    def rms_norm(x: Any, normalized_shape: Sequence[int], weight: Any = None, bias: Any = None,
                 eps: float = 1e-6) -> tuple:
        k = len(normalized_shape)
        xf = op.Cast(x, to=1)  # float32 statistics
        rstd = _rstd(op, xf, k, eps)
        flat_rstd = op.Reshape(rstd, op.Constant(value_ints=[-1]))
        same_shape = weight is not None and getattr(weight, "shape", None) is not None and \
            len(weight.shape) == k
        if opset >= MIN_RMS_NORMALIZATION_OPSET and same_shape:
            y = op.RMSNormalization(x, op.CastLike(weight, x), axis=-k, epsilon=float(eps), stash_type=1)
        else:
            y = op.CastLike(op.Mul(xf, rstd), x)
            if weight is not None:
                y = op.Mul(y, op.CastLike(weight, x))
        if bias is not None:
            y = op.Add(y, op.CastLike(bias, x))
        return y, flat_rstd

    return rms_norm


def _make_residual(opset: int) -> Callable[..., tuple]:
    op = _ops(opset)
    norm = _make(opset)

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
        ops.triton_rms_norm_fwd.default: _make(opset),
    }
    if hasattr(ops, "triton_rms_norm_residual_fwd"):
        table[ops.triton_rms_norm_residual_fwd.default] = _make_residual(opset)
    return table
