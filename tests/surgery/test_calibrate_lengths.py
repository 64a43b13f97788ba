"""Calibration of a model whose lengths come from its own predictions.

FastSpeech 2's length regulator repeats each phoneme by its predicted, rounded duration: the converted
model (approximate norms before the duration predictor) predicts slightly other durations, so at the
norms after it the converted model's activations have another length than the original's (3040 vs 3056
frames on a tiny FastSpeech2-Conformer), and the sequential fit, which pairs them row for row, failed
("calibration could not run ... size of tensor a (3040) must match b (3056)"). Such a norm is now
fitted, for that batch, on the original's own input there, and the summary says so.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import normswap
from normswap.surgery import calibrate


class PostLNBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.relu(self.fc1(x))))


class LengthRegulated(nn.Module):
    """Post-LN encoder, a duration per token (rounded), each token repeated that often (rows padded to
    the longest), Post-LN decoder: a FastSpeech-2-shaped replica."""

    def __init__(self, d: int = 16, vocab: int = 40) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.encoder = nn.Sequential(PostLNBlock(d), PostLNBlock(d))
        self.duration = nn.Linear(d, 1)
        self.decoder = nn.Sequential(PostLNBlock(d), PostLNBlock(d))
        self.out = nn.Linear(d, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(input_ids))
        durations = torch.round(6 * torch.sigmoid(4 * self.duration(h).squeeze(-1))).long().clamp_min(1)
        rows = [row.repeat_interleave(d, dim=0) for row, d in zip(h, durations, strict=True)]
        frames = nn.utils.rnn.pad_sequence(rows, batch_first=True)
        return self.out(self.decoder(frames))


def _model() -> LengthRegulated:
    torch.manual_seed(0)
    model = LengthRegulated().double().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=gen, dtype=torch.float64))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=gen, dtype=torch.float64))
    return model


def _ids(seed: int, rows: int = 8) -> torch.Tensor:
    return torch.randint(0, 40, (rows, 12), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("pipeline", ["lockstep", "replay"])
def test_norms_after_a_length_regulator_fit_on_the_original_inputs(pipeline: str, monkeypatch) -> None:
    lengths: list[tuple[int, int]] = []
    paired = calibrate._paired

    def spy(x: torch.Tensor, y: torch.Tensor) -> bool:
        lengths.append((x.shape[1], y.shape[1]))
        return paired(x, y)

    monkeypatch.setattr(calibrate, "_paired", spy)
    if pipeline == "replay":  # no memory for the one-pass path: the fit replays from the input per norm
        monkeypatch.setattr(calibrate, "LOCKSTEP_MEMORY_SHARE", 0.0)
    calib = [{"input_ids": _ids(s)} for s in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(_model(), example_inputs={"input_ids": _ids(9)}, calibration=calib)
    assert any(a != b for a, b in lengths), lengths  # the case this is about did occur
    options = report.plan.options["calibration"]
    assert "other lengths" in options["pipeline"]
    assert ("replayed" in options["pipeline"]) == (pipeline == "replay")
    # every approximate norm fitted, those after the length regulator too
    assert len(options["residuals"]) == report.plan.counts()["approximate"]
    assert any(name.startswith("decoder.") for name in options["residuals"])
    for fit in options["residuals"].values():
        assert fit["after"] <= fit["before"] + 1e-12
