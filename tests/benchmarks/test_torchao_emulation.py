"""``benchmarks/quant_utils.py``'s round-53 pieces: the photograph-resampling bootstrap and torchao's int8 grid and
W8A8 Linear emulated in float. Synthetic data and a tiny DINOv2 replica; torchao itself is not needed."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import quant_utils  # noqa: E402


def _clustered(clusters: int = 12, per: int = 60, spread: float = 0.25, seed: int = 0):
    """Errors whose variant/base ratio differs by cluster (a photograph) and barely within one."""
    rng = np.random.default_rng(seed)
    base = rng.lognormal(0.0, 0.5, clusters * per)
    effect = np.repeat(rng.lognormal(0.0, spread, clusters), per)
    variant = base * effect * rng.lognormal(0.0, 0.01, clusters * per)
    labels = np.repeat([f"photo{i}" for i in range(clusters)], per)
    return variant, base, labels


def test_cluster_bootstrap_is_wider_than_resampling_inputs_when_clusters_differ() -> None:
    variant, base, labels = _clustered()
    ratio, lo, hi = quant_utils.cluster_bootstrap(variant, base, labels)
    assert ratio == pytest.approx(variant.mean() / base.mean())
    assert lo < ratio < hi
    # one label per input is the ordinary paired bootstrap over inputs: far narrower on the same data
    _, lo1, hi1 = quant_utils.cluster_bootstrap(variant, base, range(len(base)))
    assert hi - lo > 3 * (hi1 - lo1)
    # the same per-input noise with no effect between clusters: both intervals about as wide
    flat_v, flat_b, flat_l = _clustered(spread=0.0)
    _, a_lo, a_hi = quant_utils.cluster_bootstrap(flat_v, flat_b, flat_l)
    assert a_hi - a_lo < (hi - lo) / 5


def test_cluster_bootstrap_constant_ratio_and_bad_lengths() -> None:
    base = np.linspace(1.0, 3.0, 40)
    ratio, lo, hi = quant_utils.cluster_bootstrap(1.5 * base, base, np.arange(40) // 8)
    assert (ratio, lo, hi) == pytest.approx((1.5, 1.5, 1.5))
    with pytest.raises(ValueError, match="one entry per input"):
        quant_utils.cluster_bootstrap(base, base, np.arange(39))


def test_torchao_grid_is_absmax_over_127_5_clamped_short_at_the_top() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=gen) * torch.logspace(-3, 2, 64)[:, None]
    q, s = quant_utils.torchao_int8_grid(x)
    assert torch.equal(q, q.round()) and q.min() >= -128 and q.max() <= 127
    assert torch.allclose(s.squeeze(1), x.abs().amax(1) / 127.5)
    rows = torch.arange(64)
    amax = x.abs().argmax(1)
    positive = x[rows, amax] > 0
    assert positive.any() and (~positive).any()
    # where a row's extreme value is positive it lands on 127, half a step short (127.5 rounds to 128, clamped)
    assert torch.all(q[rows, amax][positive] == 127)
    assert torch.all(q[rows, amax][~positive].abs() >= 127)
    err = (q * s - x).abs() / s
    assert err.max() <= 0.5 + 1e-4
    # the extreme element carries the largest error there is: half a step
    assert torch.allclose(err[rows, amax], torch.full((64,), 0.5), atol=1e-4)


def test_torchao_linear_is_per_token_and_per_row() -> None:
    gen = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(48, 24, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 48, generator=gen))
    x = torch.randn(2, 5, 48, generator=gen)
    y_float = lin(x)
    quant_utils.torchao_linear_(lin)
    y = lin(x)
    assert y.shape == y_float.shape and not torch.equal(y, y_float)
    assert (y - y_float).abs().max() < 0.05 * y_float.abs().max()
    # per token: one token scaled by a power of two scales its own output exactly and leaves the others alone
    x2 = x.clone()
    x2[1, 3] *= 1024
    y2 = lin(x2)
    assert torch.equal(y2[1, 3], 1024 * y[1, 3])
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3] = False
    assert torch.equal(y2[mask], y[mask])


def test_writer_and_reader_emulations_split_the_linears() -> None:
    tf = pytest.importorskip("transformers")
    import int8w_dinov2 as bench

    cfg = tf.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, patch_size=7,
                          image_size=28)
    model = tf.Dinov2Model(cfg).eval()
    names = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    for how, expect in (("sim-tao-x", names), ("sim-tao-xw", {n for n in names if n.endswith((".o_proj", ".fc2"))}),
                        ("sim-tao-xr", {n for n in names if not n.endswith((".o_proj", ".fc2"))})):
        q = bench.simulated(model, how)
        swapped = {n for n, m in q.named_modules() if type(m) is torch.nn.Linear and "forward" in m.__dict__}
        assert swapped == expect and expect
    px = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        assert not torch.equal(bench.simulated(model, "sim-tao-x")(pixel_values=px).last_hidden_state,
                               model(pixel_values=px).last_hidden_state)
