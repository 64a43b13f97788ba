"""Calibration's held-out figures on a model whose output length comes from its own predictions (a TTS
model's waveform, from predicted durations: VITS): batches of other lengths are each compared row by
row, never concatenated (before: "Sizes of tensors must match … Expected size 40528 but got size 44896",
and the conversion was refused as "calibration could not run")."""

from __future__ import annotations

import torch
from torch import nn

from normswap.surgery import calibrate


class _Speaker(nn.Module):
    """A waveform as long as the input's predicted durations say: 4 samples a token, plus one for each
    token whose duration head fires (data-dependent, so every batch has its own length)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(8)
        self.duration = nn.Linear(8, 1)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.norm(x)
        frames = 4 * x.shape[1] + int((self.duration(h) > 0).sum())
        wave = self.out(h).squeeze(-1).mean(1, keepdim=True) * torch.linspace(0.5, 1.5, frames, dtype=x.dtype)
        return {"waveform": wave}


def test_outputs_of_their_own_length_per_batch_are_compared_batch_by_batch():
    model = _Speaker().double().eval()
    batches = [((torch.randn(2, n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(n)),), {})
               for n in (3, 5, 7)]
    with torch.no_grad():
        lengths = {model(*b[0])["waveform"].shape[1] for b in batches}
    assert len(lengths) == 3  # every batch its own length: a concatenation of them cannot work
    figures = calibrate.measure(model, [], {}, batches)
    assert abs(figures["cosine"] - 1.0) < 1e-12  # no fits: the "converted" model is the original
    assert "top1_neighbour_agreement" not in figures  # neighbours need one width; not claimed
