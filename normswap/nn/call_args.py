"""The RMSNorm that replaces a norm whose ``forward`` takes more than its input.

Graph libraries call their norms as ``norm(h, batch=batch)``; custom code passes masks or sizes the
norm ignores. The walker converts such a norm only where its traced output is the per-row formula of
its input alone (the extra arguments change nothing), and then the replacement must accept the same
call. A subclass, so :class:`normswap.nn.rmsnorm.RMSNorm`'s own one-tensor ``forward`` (the decode hot
path) keeps its cost; only these norms pay one extra Python call.
"""

from __future__ import annotations

from typing import Any

import torch

from normswap.nn.rmsnorm import RMSNorm


class RMSNormTakingArgs(RMSNorm):
    """:class:`~normswap.nn.rmsnorm.RMSNorm` that accepts, and ignores, the arguments after its input."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: ARG002
        return super().forward(hidden_states)
