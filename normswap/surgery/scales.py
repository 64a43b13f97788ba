"""Folding a LayerScale λ into the Linear it scales: one float64 edit that both the conversion
(``layer_scale="fold"``) and rotation (a kept λ must fold before its writer turns) make.

A module of its own so that :mod:`normswap.rotation.rotate` can use it without importing
:mod:`normswap.surgery.edits` (which loads rotation's ops when it rebuilds a rotated checkpoint).
"""

from __future__ import annotations

import torch
from torch import nn

from normswap.analysis.linears import linear_at
from normswap.analysis.plan import ScaleFold


def fold_layer_scale(model: nn.Module, sf: ScaleFold) -> None:
    """``λ ⊙ (W x + b) = (diag(λ) W) x + λ ⊙ b``, then λ ← 1 (float64, cast once). The model's λ is
    ``param + offset``, so the parameter becomes ``1 − offset``."""
    lam = model.get_parameter(sf.param)
    scale = lam.detach().double().reshape(-1) + sf.offset
    module = linear_at(model, sf.into)
    with torch.no_grad():
        w = module.weight.detach().double()
        w = w * scale[None, :] if sf.kind == "conv1d" else w * scale[:, None]
        module.weight.copy_(w.to(module.weight.dtype))
        if module.bias is not None:
            module.bias.copy_((module.bias.detach().double() * scale).to(module.bias.dtype))
        lam.fill_(1.0 - sf.offset)
