"""``benchmarks/fc2_sensitivity.py``'s re-roundings on a tiny DINOv2 replica (float64, LayerNorm γ/β, LayerScale λ
and biases randomised): a drawn row set computes the original's function (the next LayerNorm removes the shift),
and its centered form at ``v = 0`` is the default conversion's fc2 rows up to a per-row scale. No real checkpoint,
no engine, no network."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

tf = pytest.importorskip("transformers")

import fc2_sensitivity as bench  # noqa: E402

import normswap  # noqa: E402


def _tiny_dino() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = tf.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, patch_size=7,
                          image_size=28, layer_norm_eps=1e-6)
    model = tf.Dinov2Model(cfg).eval().double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambda1" in name:
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) * 2 + 1e-3)
            elif p.dim() == 1:
                base = 1.0 if name.endswith("weight") and "norm" in name else 0.0
                p.copy_(base + 0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


@pytest.mark.parametrize("centered", [False, True])
@torch.no_grad()
def test_drawn_rows_compute_the_originals_function(centered):
    model = _tiny_dino()
    px = torch.randn(3, 3, 28, 28, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref = model(pixel_values=px).last_hidden_state
    drawn = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    moved = 0.0
    for layer in drawn.encoder.layer:
        rows = bench.drawn_rows(layer, gen, centered)
        lam = layer.layer_scale2.lambda1.double()
        moved = max(moved, float((rows / lam[:, None] - layer.mlp.fc2.weight).abs().max()))
        layer.mlp.fc2.weight.copy_(rows / lam[:, None])
    assert moved > 1e-3  # the rows did move (a new rounding), ...
    out = drawn(pixel_values=px).last_hidden_state
    assert (out - ref).abs().max() < 1e-10  # ... and the function did not


@torch.no_grad()
def test_centered_rows_at_no_shift_are_the_default_conversions_up_to_a_row_scale():
    model = _tiny_dino()
    native = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(native, beta_placement="keep")
    for mine, theirs in zip(model.encoder.layer, native.encoder.layer, strict=True):
        rows = bench.drawn_rows(mine, None, centered=True)
        conv = theirs.mlp.fc2.weight.double() * theirs.layer_scale2.lambda1.double()[:, None]
        assert torch.allclose(rows, conv, atol=1e-12, rtol=0)
        assert not torch.allclose(rows, bench.drawn_rows(mine, None, centered=False), atol=1e-6, rtol=0)
