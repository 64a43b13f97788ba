"""A centering op on a forward input finds that input however the caller passes it.

The trace records the slot as the traced call passed it (a keyword name, or a position). A model
traced as ``model(hidden_states=x)`` and later called as ``model(x)`` raised ``KeyError:
'hidden_states'`` from the centering hook; the hook now maps names and positions through the
module's ``forward`` signature.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normswap
from normswap.errors import NormswapError
from normswap.surgery.edits import CenterInput


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln(x))


class StreamInputModel(nn.Module):
    """Pre-LN blocks whose residual stream is the model's own input (an ``inputs_embeds``-style model):
    nothing writes it, so the centering op sits on the input itself."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, hidden_states: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        for block in self.blocks:
            hidden_states = block(hidden_states)
        return self.head(self.ln_f(hidden_states)) * scale


def _model() -> StreamInputModel:
    torch.manual_seed(0)
    model = StreamInputModel().double().eval()
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight)
            nn.init.normal_(m.bias)
    return model


def _stream(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 5, 8, generator=g, dtype=torch.float64) + 3.0  # far from zero mean


@pytest.mark.parametrize("traced", ["keyword", "positional"])
def test_centering_op_on_an_input_takes_either_calling_convention(traced: str) -> None:
    model = _model()
    original = copy.deepcopy(model)
    x = _stream(1)
    example = {"hidden_states": x} if traced == "keyword" else (x,)
    report = normswap.patch(model, example_inputs=example)
    hooks = [h for h in report.plan.hooks if h.where == "input"]
    assert hooks and isinstance(hooks[0].arg, str if traced == "keyword" else int)
    y = _stream(2)
    with torch.no_grad():
        ref = original(y)
        for out in (model(y), model(hidden_states=y), model(y, 0.5) * 2, model(hidden_states=y, scale=0.5) * 2):
            assert float((out - ref).abs().max() / ref.abs().max()) < 1e-9


def test_a_call_without_the_centred_input_is_refused_in_one_line() -> None:
    model = _model()
    for slot in ("hidden_states", 0):
        with pytest.raises(NormswapError, match="`hidden_states`|argument 0.*does not pass"):
            CenterInput(slot)(model, (), {"scale": 1.0})
