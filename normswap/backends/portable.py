"""The portable path: what ``normswap.rms_norm`` computes while a graph is captured for export.

By default the captured graph holds only stock aten ops, so an exported program runs where
normswap is not installed:

* ``torch.export`` (and the dynamo ONNX exporter, which uses it): ``aten.rms_norm`` for float32 and
  float64 inputs with a weight of the normalised shape (the ONNX exporter writes ``RMSNormalization``
  at opset >= 23 and ``Pow``/``ReduceMean``/``Add``/``Sqrt``/``Reciprocal``/``Mul`` below), the ``eager``
  backend's ops otherwise (half precision, per-head weights). Half precision stays on eager's ops
  although ``aten.rms_norm`` itself would round once there (its decomposition upcasts, multiplies by
  rstd and by the weight in float32 and casts once, checked in tests/integrations/test_torch_export.py):
  ONNX's ``RMSNormalization``, which the exporter writes for it at opset >= 23, is specified to cast
  the normalised value back to the input type *before* the scale multiply, a second rounding, and a
  bias would be added after it in the input dtype, a third. Eager's ops export as ``Cast`` to float32,
  the arithmetic, and one ``Cast`` back.
* ``torch.jit.trace`` (and the legacy ONNX exporter, ``dynamo=False``): always the ``eager`` backend's
  ops (pow, mean, add, rsqrt, mul), because the legacy exporter has no ``aten::rms_norm`` symbolic and
  the fused kernels are invisible to a trace (they would be recorded as constants).

A fused backend asked for explicitly (``backend="cpu"``/``"triton"`` on the module or call, or
``NORMSWAP_BACKEND``) stays a custom op under ``torch.export`` (``normswap::cpu_rms_norm``,
``normswap::triton_rms_norm_fwd``); such a program needs ``import normswap`` to load. ``torch.onnx.export``
of a model always gets the portable ops (ONNX Runtime brings its own kernels); only an already exported
program that holds the custom op needs :func:`normswap.integrations.onnx.translation_table`.
"""

from __future__ import annotations

import torch

from normswap.backends import eager, env_backend, native

#: Backends whose ops are stock aten ops (what an exported graph holds by default).
PORTABLE_BACKENDS = ("auto", "eager", "native")


def export_rms_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    backend: str = "auto",
) -> torch.Tensor | None:
    """The traceable RMSNorm for export, or None when the caller asked for a fused backend (the
    caller then dispatches to that backend, whose ``torch.export`` path is its custom op)."""
    requested = backend if backend != "auto" else env_backend()
    if torch.jit.is_tracing():
        return eager.rms_norm(x, normalized_shape, weight, bias, eps)
    if requested not in PORTABLE_BACKENDS and not torch.onnx.is_in_onnx_export():
        return None  # the fused op; ONNX export always gets the portable ops (ONNX Runtime has its own kernels)
    if requested == "eager" or x.dtype not in (torch.float32, torch.float64):
        return eager.rms_norm(x, normalized_shape, weight, bias, eps)
    return native.rms_norm(x, normalized_shape, weight, bias, eps)
