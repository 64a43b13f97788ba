"""Pieces of ``benchmarks/carry_row_grids.py`` (round 64): the torch replica of NNCF's INT8_ASYM weight compression
and the two-scale mean carry it measures.

What could be silently wrong: a replica that rounds on another grid than NNCF's (the weight-group split would then
measure another quantizer), a two-scale carry that changes the function (it would be measured as a conversion it is
not), and one whose first pair's entries are not on each row's grid (then it is the default's carry again).
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

import normswap
from tests import benchmark_modules
from tests.zoo import APPROXIMATE, build

grids = benchmark_modules.load("carry_row_grids")


@pytest.mark.parametrize("shape", [(16, 40), (96, 3080)])  # the second large enough for NNCF's optimized path
def test_the_replica_rounds_as_nncf_int8_asym(shape):
    nncf = pytest.importorskip("nncf")
    from nncf.quantization.algorithms.weight_compression.config import WeightCompressionConfig
    from nncf.quantization.algorithms.weight_compression.weight_lowering import do_integer_quantization
    from nncf.tensor import Tensor

    torch.manual_seed(0)
    w = torch.randn(*shape) * torch.linspace(0.05, 2.0, shape[0])[:, None] + 0.1
    w[3] = w[3].abs()  # a row with no negative entry: the range still holds 0
    config = WeightCompressionConfig(mode=nncf.CompressWeightsMode.INT8_ASYM)
    got = do_integer_quantization(Tensor(w.numpy()), config, reduction_axes=(1,))
    q, scale, zp = (np.asarray(t.data) for t in (got.tensor, got.scale, got.zero_point))
    theirs = (q.astype(np.float32) - zp.astype(np.float32)) * scale.astype(np.float32)
    ours = grids.nncf_int8_asym(w).numpy()
    np.testing.assert_array_equal(ours, theirs)
    assert np.abs(ours - w.numpy()).max() > 1e-4  # it rounds


@pytest.fixture(scope="module")
def bert():
    original = build(APPROXIMATE, "bert").base_model
    conv = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        carries = normswap.patch(conv, calibration=False, beta_placement="keep").plan.mean_carries
    assert carries and all(c.added >= 8 for c in carries)
    return original, conv, carries


def _out(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).last_hidden_state


@pytest.mark.parametrize("target", ["asym", "sym", "multi"])
def test_two_scale_carry_is_exact_in_float64_and_its_first_pair_on_the_grid(bert, target):
    original, conv, carries = bert
    two = copy.deepcopy(conv)
    grids.two_scale(two, carries, ratio=16.0, target=target)
    ids = torch.randint(0, 99, (3, 11), generator=torch.Generator().manual_seed(3))
    ref, before, after = _out(original, ids), _out(conv, ids), _out(two, ids)
    assert (after - ref).abs().max() > 1e-6  # the default is approximate here (attention-output norms): a real model
    assert (after - before).abs().max() < 1e-10  # the re-plan changes nothing in float64
    for c in carries:
        w = two.get_submodule(c.down).weight.detach()
        c1, n = -w[:, c.hidden], c.hidden
        assert torch.allclose(w[:, n + 1], c1) and torch.allclose(w[:, n + 2], -c1)
        assert torch.allclose(c1 * c.scale - w[:, n + 4] * c.scale / 16.0, torch.ones_like(c1), atol=1e-12)
        if target == "asym":  # NNCF's per-row grid keeps the first pair's entries exactly (rows whose range holds them)
            real = w[:, :n].float()
            inside = (c1.float() <= real.amax(1)) & (-c1.float() >= real.amin(1))
            assert inside.float().mean() > 0.5
            rounded = grids.nncf_int8_asym(torch.cat([real, w[:, n:n + 1].float()], 1))[:, -1]
            assert torch.equal(rounded[inside], (-c1).float()[inside])
            # since round 65 this is the product's default carry: the re-plan leaves every bit as patch wrote it
            assert torch.equal(w, conv.get_submodule(c.down).weight.detach())
            assert torch.equal(two.get_submodule(c.up).weight, conv.get_submodule(c.up).weight)
