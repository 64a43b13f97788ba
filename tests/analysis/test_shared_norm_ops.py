"""A per-norm centering op on a norm called more than once (ALBERT's layer, shared across depth).

Round 61's ``--quantizer`` sweep: the Post-LN option set (``per_norm_centering=True, mean_carry=False``, which
``openvino-int8``, ``onnxruntime-dynamic`` and the OpenVINO int4 engines set) took away the MLP carry that makes
ALBERT's FFN-output norm exact with the defaults, and refused the op it asks for instead because the norm is
called once per depth: a norm exact with the defaults came out approximate. An op on a norm's own input removes a
mean the norm removes anyway, so it is exact at every call. What could be silently wrong: a norm left approximate;
the op installed on one call only (the other calls' RMSNorm reading an uncentered stream: not exact); the
conversion not exact at another input shape.
"""

from __future__ import annotations

import pytest
import torch

from normswap import RMSNorm
from normswap.analysis.plan import plan_of
from tests.zoo import APPROXIMATE, build, patched_copies

TOL = 1e-10
EXACT = ("exact", "exact-with-centering", "exact-with-per-norm-centering")
SHARED = "albert.encoder.albert_layer_groups.0.albert_layers.0."


def _ids(seed: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(5, 90, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def albert() -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
    model = build(APPROXIMATE, "albert")
    assert model.config.num_hidden_layers > model.config.num_hidden_groups  # the layer runs at every depth
    return model, patched_copies(model, {"input_ids": _ids(1, 2, 9)}, {
        "defaults": {}, "post-ln ops": {"per_norm_centering": True, "mean_carry": False},
        "openvino-int8": {"quantizer": "openvino-int8"}})


@pytest.mark.parametrize("option", ["post-ln ops", "openvino-int8"])
def test_every_norm_exact_with_the_defaults_stays_exact_and_the_shared_norms_center_their_input(albert, option):
    _, converted = albert
    before = {s.name: s.verdict for s in plan_of(converted["defaults"]).sites}
    after = {s.name: s.verdict for s in plan_of(converted[option]).sites}
    assert [n for n, v in before.items() if v in EXACT and after[n] not in EXACT] == [], after
    for name in ("attention.LayerNorm", "full_layer_layer_norm"):
        assert after[SHARED + name] == "exact-with-per-norm-centering", after
        norm = converted[option].get_submodule(SHARED + name)
        assert isinstance(norm, RMSNorm) and norm.centers_input  # one op, run at every call of the layer


@pytest.mark.parametrize("option", ["post-ln ops", "openvino-int8"])
def test_the_conversion_is_exact_at_every_depth_and_two_shapes(albert, option):
    model, converted = albert
    conv = converted[option]
    for seed, batch, seq in ((3, 1, 5), (4, 2, 11)):
        ids = _ids(seed, batch, seq)
        with torch.no_grad():
            ref, out = model(input_ids=ids).logits, conv(input_ids=ids).logits
        assert float((out - ref).abs().max()) <= TOL * max(1.0, float(ref.abs().max())), option
