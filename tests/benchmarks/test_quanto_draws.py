"""Pieces of ``bench_quanto.py``'s rounding draws: the exact reorderings (``permuted``) that make a grouped
4-bit quantizer round other numbers, and the verdict over draws (``draw_ratio``, ``draw_sets``).

What could be silently wrong: a reordering that changes the function (then a "draw" measures a different
model, not a different rounding), one that changes nothing a grouped quantizer sees (no draw at all), a
converted model's draw N that is not the same reordering as the original's, and an interval that leaves out
the spread between draws (the round-47 image-only interval did).
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

from tests import benchmark_modules

quanto_bench = benchmark_modules.load("bench_quanto")


def _tiny_dino() -> torch.nn.Module:
    """A 2-layer DINOv2-shaped model (4 heads of 8), LayerNorm γ/β and LayerScale randomised, float64."""
    return benchmark_modules.tiny_dinov2(heads=4)


def _tokens(model: torch.nn.Module, px: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(pixel_values=px).last_hidden_state


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    import normswap

    original = _tiny_dino()
    converted = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(converted)  # the native default the quanto draws are taken of
    px = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return original, converted, px


@pytest.mark.parametrize("attention", [False, True])
def test_reordering_is_exact_for_original_and_converted(models, attention: bool) -> None:
    original, converted, px = models
    ref = _tokens(original, px)
    for model in (original, converted):
        drawn = quanto_bench.permuted(model, seed=3, attention=attention)
        assert (_tokens(drawn, px) - ref).abs().max() < 1e-10  # the same function, float64
        layer, before = drawn.encoder.layer[0], model.encoder.layer[0]
        # fc2's inputs (and with attention o_proj's) are in another order: its groups hold other entries ...
        assert not torch.equal(layer.mlp.fc2.weight, before.mlp.fc2.weight)
        assert torch.equal(layer.attention.o_proj.weight, before.attention.o_proj.weight) != attention
        # ... the rows of every reader keep their entries (they round alike), only their order moves
        for new, old in ((layer.mlp.fc1, before.mlp.fc1), (layer.attention.v_proj, before.attention.v_proj)):
            assert torch.equal(new.weight.sort(0).values, old.weight.sort(0).values)


def test_same_seed_same_reordering_on_the_converted_model(models) -> None:
    original, converted, _ = models
    # the native default keeps γ in the norm, so fc1's and q/k's weights are the original's: the draws must
    # move them the same way, or draw N of the conversion would not be the original's draw N
    for attention in (False, True):
        a = quanto_bench.permuted(original, seed=5, attention=attention).encoder.layer[1]
        b = quanto_bench.permuted(converted, seed=5, attention=attention).encoder.layer[1]
        assert torch.equal(a.mlp.fc1.weight, b.mlp.fc1.weight)
        assert torch.equal(a.attention.q_proj.weight, b.attention.q_proj.weight)
    assert not torch.equal(quanto_bench.permuted(original, seed=5).encoder.layer[1].mlp.fc1.weight,
                           quanto_bench.permuted(original, seed=6).encoder.layer[1].mlp.fc1.weight)


def test_draw_ratio_holds_the_draw_spread() -> None:
    rng = np.random.default_rng(0)
    orig = rng.uniform(0.5, 1.5, size=(4, 64))
    # paired draws (same seeds) that the conversion doubles: 2, with no spread from draws or images
    for typical in (False, True):
        point, lo, hi = quanto_bench.draw_ratio(orig, 2 * orig, typical=typical, paired=True)
        assert point == pytest.approx(2) and lo == pytest.approx(2) and hi == pytest.approx(2)
    # the same draws unpaired: the interval now holds the spread between draws around the same point
    point, lo, hi = quanto_bench.draw_ratio(orig, 2 * orig)
    assert point == pytest.approx(2) and lo < 1.99 and hi > 2.01
    # no image noise at all, draws at 1 and 3 against a converted model at 2: ratio 1, but the interval
    # must reach both 2/3 and 2 (an interval over images only would be 1-1)
    point, lo, hi = quanto_bench.draw_ratio(np.stack([np.ones(64), 3 * np.ones(64)]), 2 * np.ones((2, 64)))
    assert point == pytest.approx(1) and lo == pytest.approx(2 / 3) and hi == pytest.approx(2)
    with pytest.raises(ValueError, match="as many"):
        quanto_bench.draw_ratio(orig, orig[:2], paired=True)


def test_draw_sets_and_names() -> None:
    names = ["original", "reordered-2", "permuted-1", "reordered-1", "native", "native-reordered-1",
             "native-keep-centerop-permuted-4"]
    assert quanto_bench.draw_sets(names) == {
        ("original", "reordered"): ["original", "reordered-1", "reordered-2"],
        ("original", "permuted"): ["original", "permuted-1"],
        ("original", "all"): ["original", "permuted-1", "reordered-1", "reordered-2"],
        ("native", "reordered"): ["native", "native-reordered-1"],
        ("native-keep-centerop", "permuted"): ["native-keep-centerop-permuted-4"]}
    assert quanto_bench.DRAW.match("native-keep-centerop-permuted-4")["base"] == "native-keep-centerop"
