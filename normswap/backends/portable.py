"""The portable path: what ``normswap.rms_norm`` computes while a graph is captured for export.

By default the captured graph holds only stock aten ops, so an exported program runs where
normswap is not installed:

* ``torch.onnx.export``, either exporter: ONNX Runtime's fused RMS kernel. Where the export will
  write ``aten.rms_norm`` as ONNX ``RMSNormalization`` (the dynamo exporter at opset >= 23), that op,
  for float32/float64 inputs with a weight of the normalised shape. Everywhere else (opsets 18-22,
  among them torch 2.13's default 20, and the legacy exporter at every opset) the graph ONNX Runtime's
  optimisers fuse into ``SimplifiedLayerNormalization``::

      x -> Pow(2) -> ReduceMean(last axis, keepdims) -> Add(eps) -> Sqrt -> Div(x, .) -> Mul(weight)

  (the session's C++ ``SimplifiedLayerNormFusion`` requires ``Div`` with ``x`` as its dividend, ``eps``
  a float constant and a 1-D weight: ``aten.rms_norm``'s own decomposition ends in
  ``Reciprocal``/``Mul`` and stays unfused; ``onnxruntime.transformers.optimizer`` then turns a
  residual ``Add`` before it into ``SkipSimplifiedLayerNormalization``). A norm without a weight
  multiplies by a constant of ones, so it fuses too; a bias is one ``Add`` after the fused op. Half
  precision gets the same graph between a ``Cast`` to float32 and one ``Cast`` back (eager's one
  rounding; never ``RMSNormalization``, whose spec rounds before the scale multiply). Norms over more
  than one trailing dim or with per-head weights (no fused kernel takes them) get the eager ops.
  Which ops each exporter and opset gets: docs/deployment.md; asserted in
  tests/integrations/test_onnx_fusion.py.
* ``torch.export`` (outside ONNX export): ``aten.rms_norm`` for float32 and float64 inputs with a
  weight of the normalised shape, the ``eager`` backend's ops otherwise (half precision, per-head
  weights). Half precision stays on eager's ops although ``aten.rms_norm`` itself would round once
  there (its decomposition upcasts, multiplies by rstd and by the weight in float32 and casts once,
  checked in tests/integrations/test_torch_export.py): ONNX's ``RMSNormalization``, which the
  exporter writes for it at opset >= 23, is specified to cast the normalised value back to the input
  type *before* the scale multiply, a second rounding, and a bias would be added after it in the
  input dtype, a third.
* ``torch.jit.trace`` (outside ONNX export): always the ``eager`` backend's ops (pow, mean, add,
  rsqrt, mul), because the fused kernels are invisible to a trace (they would be recorded as
  constants).

A fused backend asked for explicitly (``backend="cpu"``/``"triton"`` on the module or call, or
``NORMSWAP_BACKEND``) stays a custom op under ``torch.export`` (``normswap::cpu_rms_norm``,
``normswap::triton_rms_norm_fwd``); such a program needs ``import normswap`` to load. ``torch.onnx.export``
of a model always gets the portable ops (ONNX Runtime brings its own kernels); only an already exported
program that holds the custom op needs :func:`normswap.integrations.onnx.translation_table`.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

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
    if torch.onnx.is_in_onnx_export():  # either exporter; ONNX Runtime brings its own (fused) kernels
        y = onnx_rms_norm(x, normalized_shape, weight, bias, eps)
        if y is not None:
            return y
        return eager.rms_norm(x, normalized_shape, weight, bias, eps)
    requested = backend if backend != "auto" else env_backend()
    if torch.jit.is_tracing():
        return eager.rms_norm(x, normalized_shape, weight, bias, eps)
    if requested not in PORTABLE_BACKENDS:
        return None  # the fused op
    if requested == "eager" or x.dtype not in (torch.float32, torch.float64):
        return eager.rms_norm(x, normalized_shape, weight, bias, eps)
    return native.rms_norm(x, normalized_shape, weight, bias, eps)


def onnx_rms_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor | None:
    """What ``torch.onnx.export`` records for one RMSNorm: ``aten.rms_norm`` where the exporter writes it
    as ``RMSNormalization``, else the subgraph ONNX Runtime fuses into ``SimplifiedLayerNormalization``
    (see the module docstring); None where no fused kernel applies (the caller emits eager's ops).

    Cast order as eager's: float32 arithmetic (float64 for float64), weight and bias upcast, one
    rounding at the end. Dividing by the root instead of multiplying by ``rsqrt`` is what ORT's fusion
    matches; the two differ by float32 rounding only.
    """
    width = normalized_shape[-1] if len(normalized_shape) == 1 else None
    if width is None or any(p is not None and tuple(p.shape) != normalized_shape for p in (weight, bias)):
        return None  # ORT's fused kernels take one normalised axis and a 1-D scale
    export = onnx_export_settings()
    if x.dtype in (torch.float32, torch.float64) and weight is not None and export.writes_rms_normalization:
        return native.rms_norm(x, normalized_shape, weight, bias, eps)  # one RMSNormalization (+ Add)
    if export.optimizes:
        eps = max(eps, ONNXSCRIPT_MIN_EPS)
    cdt = eager.compute_dtype(x.dtype)
    # a weightless norm multiplies by ones: the fusions need the scale multiply to close the pattern
    w = weight.to(cdt) if weight is not None else torch.ones(normalized_shape, dtype=cdt, device=x.device)
    xf = x.to(cdt)
    y = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w
    if bias is not None:
        y = y + bias.to(cdt)
    return y.to(x.dtype)


#: The smallest eps the dynamo exporter's graph keeps. Its default ``optimize=True`` runs onnxscript's
#: rewriter, whose ``x + 0 -> x`` rule matches scalars within ``abs_tol=1e-8`` of zero: a BERT/ViT
#: ``eps=1e-12`` Add vanishes, the graph divides by ``sqrt(mean(x**2))`` (a zero row gives NaN) and ORT's
#: fusions, which need the Add, no longer match. Raised to this, the output changes by a relative
#: ``(1.1e-8 - eps) / (2 * mean(x**2))``, below float32 rounding for rows with ``mean(x**2) > 0.1``.
#: ``torch.onnx.export(..., optimize=False)`` and the legacy exporter keep the exact eps.
ONNXSCRIPT_MIN_EPS = 1.1e-8


class OnnxExport(NamedTuple):
    """What the running ONNX export will do with the graph being captured."""

    writes_rms_normalization: bool  # aten.rms_norm becomes RMSNormalization (not a decomposition)
    optimizes: bool  # onnxscript's optimiser rewrites the exported graph


_LEGACY = OnnxExport(writes_rms_normalization=False, optimizes=False)  # no aten::rms_norm symbolic, no rewriter
_ONNX_EXPORT_MODULE = "torch.onnx._internal.exporter._core"  # where torch.onnx.export(dynamo=True) runs


def onnx_export_settings() -> OnnxExport:
    """What the running ``torch.onnx.export`` will do with the captured graph (call it while the
    exporter traces or translates).

    The legacy exporter (a ``torch.jit`` trace) has no ``aten::rms_norm`` symbolic and no rewriter.
    The exporter builds its registry for the requested opset (plus any ``custom_translation_table``)
    before capturing the model, inside ``_core.export(..., registry=..., optimize=...)``: that frame
    says whether ``aten.rms_norm`` is translated (to ``RMSNormalization``, opset >= 23) or decomposed
    (into ``Reciprocal``/``Mul``, which ORT does not fuse), and whether onnxscript's optimiser runs. When no
    such frame is found (a torch whose exporter is laid out differently; Dynamo's strict capture, which
    cannot inspect frames) the answer is the fused-by-ORT subgraph with the optimiser assumed on: right
    at every opset, so a miss costs the op's portable name, never speed or correctness.
    """
    if torch.jit.is_tracing():
        return _LEGACY
    unknown = OnnxExport(writes_rms_normalization=False, optimizes=True)
    if torch.compiler.is_dynamo_compiling():
        return unknown
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "export" and frame.f_globals.get("__name__") == _ONNX_EXPORT_MODULE:
            local = frame.f_locals
            registry = local.get("registry")  # None: the exporter's default, opset 18
            try:
                writes = registry is not None and bool(registry.is_registered(torch.ops.aten.rms_norm.default))
            except Exception:  # a registry of another shape: the subgraph is the safe answer
                writes = False
            return OnnxExport(writes_rms_normalization=writes, optimizes=bool(local.get("optimize", True)))
        frame = frame.f_back
    return unknown


#: The export forms of :func:`delegable_rms_norm` (what ``normswap.integrations.executorch`` switches norms to).
#: ``"addmm"``: the mean of squares as one ``addmm(eps, x**2, 1/n column)``, a fully-connected op with eps as its
#: bias; ``"mm"``: ``x**2 @ (1/n column) + eps``; ``"linear"``: ``F.linear(x**2, 1/n row, eps)``.
DELEGABLE_FORMS = ("addmm", "mm", "linear")


def delegable_rms_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean_weight: torch.Tensor,
    eps: torch.Tensor,
    form: str = "addmm",
) -> torch.Tensor:
    """RMSNorm with the mean of squares as a matrix product: what ExecuTorch's XNNPACK backend delegates whole.

    XNNPACK takes no 3-D ``mean`` (nor ``layer_norm``); a ``mean`` left outside the delegate splits the graph
    at every norm and runs as ExecuTorch's portable kernels. A product of ``x**2`` (``pow``, which XNNPACK
    takes, and which PT2E quantizers leave in float, unlike ``mul``) with a constant ``1/n`` column is
    XNNPACK's fully-connected op. ``mean_weight`` is that column (``(n, 1)``; ``(1, n)`` for ``"linear"``) and
    ``eps`` a 1-element tensor, both constants of the exported program (buffers the caller registered: an
    op-made constant would stay outside the delegate). Same cast order as the eager backend (compute dtype,
    one rounding at the end); differs from the default form by the rounding of ``1/n`` only.
    """
    cdt = eager.compute_dtype(x.dtype)
    size = math.prod(normalized_shape)
    lead = x.shape[: x.dim() - len(normalized_shape)]
    # casts only where the dtype changes: export records even a same-dtype ``to`` (plus a metadata assert)
    xf, w_mean, e = (t if t.dtype == cdt else t.to(cdt) for t in (x, mean_weight, eps))
    sq = xf.reshape(-1, size).pow(2)
    if form == "addmm":
        ms = torch.addmm(e, sq, w_mean)
    elif form == "mm":
        ms = torch.mm(sq, w_mean) + e
    elif form == "linear":
        ms = torch.nn.functional.linear(sq, w_mean, e)
    else:
        raise ValueError(f"delegable_rms_norm: unknown form {form!r} (one of {', '.join(DELEGABLE_FORMS)})")
    y = xf * torch.rsqrt(ms).reshape(*lead, *(1,) * len(normalized_shape))
    if weight is not None:
        y = y * (weight if weight.dtype == cdt else weight.to(cdt))
    if bias is not None:
        y = y + (bias if bias.dtype == cdt else bias.to(cdt))
    return y if y.dtype == x.dtype else y.to(x.dtype)
