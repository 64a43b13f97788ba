"""PyTorch's fused ``nn.TransformerEncoderLayer`` path, in a model whose norms normswap converted.

In eval mode, without autograd, with ``batch_first`` and a few other conditions,
``nn.TransformerEncoderLayer.forward`` skips its Python code and runs one fused op,
``torch._transformer_encoder_layer_fwd``, and ``nn.TransformerEncoder`` may first pack a padded
batch into a nested tensor for it. That op computes *LayerNorm* itself from ``norm1``/``norm2``'s
``weight``, ``bias`` and ``eps``, whatever modules they are. After conversion:

* an **exact** norm reads a zero-mean stream, where ``LayerNorm(x) = RMSNorm(x)·γ + β`` with the same
  eps, so the fused op computes what the RMSNorm computes, as long as the RMSNorm has a ``bias``
  tensor for it to read. A default conversion keeps β in these norms
  (:data:`FUSED_WHY`, :func:`fused_norm_paths`), so such layers keep their fused path, exactly;
* otherwise (an approximate norm, whose input is not zero-mean; a β folded into the readers, which
  leaves ``bias`` None and would crash the fused op; ``fold_gamma`` and rotations) the fused op would
  compute something else. :func:`keep_python_forward` then gives the layer a forward pre-hook that
  does nothing, which PyTorch's own check reads as "run the Python forward", and turns off the
  nested-tensor packing of the ``nn.TransformerEncoder`` around it (the Python forward of normswap's
  RMSNorm takes ordinary tensors).

Both are applied from the plan alone (no analysis), so a loaded checkpoint gets the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from normswap.analysis.plan import EXACT_VERDICTS, Plan
from normswap.nn.rmsnorm import RMSNorm

FUSED_WHY = ("kept in the RMSNorm: PyTorch's fused nn.TransformerEncoderLayer path reads the norm's bias "
             "(beta_placement='fold' folds it, and the layer then runs its Python forward)")


@contextlib.contextmanager
def python_forwards() -> Iterator[None]:
    """PyTorch's fused ``nn.MultiheadAttention`` / ``nn.TransformerEncoder*`` paths off for the block
    (``torch.backends.mha``; restored after): every forward runs the Python code on plain tensors, as
    the traced analysis saw it (no nested-tensor packing of a padded batch under a calibration hook)."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def fused_norm_paths(model: nn.Module) -> set[str]:
    """The norms a fused ``nn.TransformerEncoderLayer`` path reads (``norm1``/``norm2`` of layers whose
    attention has biases: without them PyTorch never takes that path)."""
    found = set()
    for path, module in model.named_modules():
        if isinstance(module, nn.TransformerEncoderLayer) and module.self_attn.in_proj_bias is not None:
            found |= {f"{path}.{attr}" if path else attr for attr in ("norm1", "norm2")}
    return found


def _python_forward(module: nn.Module, args: Any) -> None:
    """A forward pre-hook that changes nothing: its presence keeps PyTorch off the fused path."""
    return None


def _fused_exact(layer: nn.TransformerEncoderLayer, path: str, plan: Plan) -> bool:
    """Does the fused op compute what this converted layer computes? (see the module docstring)"""
    if plan.rotations:
        return False
    sites = {sp.name: sp for sp in plan.sites}
    for attr in ("norm1", "norm2"):
        norm = getattr(layer, attr)
        sp = sites.get(f"{path}.{attr}" if path else attr)
        if not isinstance(norm, RMSNorm):
            continue  # still a LayerNorm: the fused op computes it
        if sp is None or sp.verdict not in EXACT_VERDICTS or norm.weight is None or norm.bias is None:
            return False
    return True


def keep_python_forward(model: nn.Module, plan: Plan) -> list[str]:
    """Send every converted ``nn.TransformerEncoderLayer`` whose fused path would not be exact down its
    Python forward (idempotent). Returns the layers' paths."""
    held = []
    for path, layer in model.named_modules():
        if not isinstance(layer, nn.TransformerEncoderLayer):
            continue
        if not any(isinstance(getattr(layer, a, None), RMSNorm) for a in ("norm1", "norm2")):
            continue
        if _fused_exact(layer, path, plan):
            continue
        if not _held(layer):
            layer.register_forward_pre_hook(_python_forward)
        held.append(path)
    for encoder in model.modules():
        if isinstance(encoder, nn.TransformerEncoder) and any(_held(lay) for lay in encoder.layers):
            encoder.use_nested_tensor = False
    return held


def _held(layer: nn.Module) -> bool:
    return any(hook is _python_forward for hook in layer._forward_pre_hooks.values())
