"""The output that stands for a model in summaries and usability figures must carry information."""

from __future__ import annotations

import torch

from normswap.surgery.calibrate import unusable
from normswap.surgery.verify import primary_key


def test_a_constant_output_does_not_stand_for_the_model():
    outputs = {"logits_audio_text": torch.zeros(2, 2), "audio_embeds": torch.randn(2, 8)}
    assert primary_key(outputs) == "audio_embeds"


def test_a_conventional_name_wins_when_it_varies_and_loses_when_it_does_not():
    assert primary_key({"other": torch.randn(2, 3), "logits": torch.randn(2, 3)}) == "logits"
    assert primary_key({"logits": torch.ones(2, 3), "other": torch.randn(2, 3)}) == "other"
    assert primary_key({"a": torch.zeros(3), "b": torch.zeros(3)}) == "a"  # nothing varies: the first


def test_cosine_of_an_informative_output_is_not_called_unusable():
    ref = torch.randn(4, 8, dtype=torch.float64)
    out = ref + 1e-3 * torch.randn_like(ref)
    cos = float(torch.nn.functional.cosine_similarity(ref, out, dim=-1).mean())
    assert unusable({"cosine": cos}) is None
    assert unusable({"cosine": 0.0}) is not None
