"""What a model's parameters say about it: the floating dtype and the device every stage reads.

The analysis, the inputs builder, the verification and the writers all need "the model's dtype": the dtype
its inputs must have, the one a verification compares in, the one a checkpoint is written in. That is the
dtype of its first *floating* parameter (integer buffers and quantized weights do not decide it), and float32
for a model with none. One definition here keeps every stage agreeing on it.
"""

from __future__ import annotations

import torch
from torch import nn


def model_dtype(model: nn.Module, default: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype of ``model``'s first floating-point parameter, ``default`` where it has none."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), default)


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter; the CPU for a model without parameters."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))
