"""Pieces of the ONNX Runtime quantizer benchmarks: the exact embedding retrade (``bench_quant_engines.retraded``)
and the patched GPTQ (``ort_gptq``).

What could be silently wrong: a retrade that is not exact (it moves a constant between writers that do not
reach the same tokens), one that is exact only at the table's own grid size (the resampled table must keep the
constant), a patched GPTQ that is no better than round-to-nearest, and an encoding whose stored codes and
scales do not give back GPTQ's own values.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

from tests import benchmark_modules

engines = benchmark_modules.load("bench_quant_engines")
gptq = benchmark_modules.load("ort_gptq")


def _tiny_dino(seed: int = 0) -> torch.nn.Module:
    """A 2-layer DINOv2-shaped model with massive class/position channels, randomised γ/β, float64."""
    model = benchmark_modules.tiny_dinov2(seed)
    g = torch.Generator().manual_seed(seed + 1)  # the plants' own draws (benchmark_modules used ``seed``'s)
    with torch.no_grad():
        model.embeddings.cls_token[..., :2] += 20
        model.embeddings.position_embeddings[..., 2:4] += 5
        model.embeddings.position_embeddings.add_(0.1 * torch.randn(model.embeddings.position_embeddings.shape,
                                                                    generator=g, dtype=torch.float64))
    return model


def _converted(model: torch.nn.Module) -> torch.nn.Module:
    import normswap

    conv = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(conv, trade_constants=False, stem_centering="weights")  # what ``retraded`` starts from
    return conv


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tiny model and its retraded conversion (one conversion for the tests below)."""
    model = _tiny_dino()
    return model, engines.retraded(_converted(model), model)


def test_retrade_is_exact_in_float64_and_keeps_the_stream_zero_mean(pair):
    model, retraded = pair
    px = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        ref, out = model(pixel_values=px), retraded(pixel_values=px)
        stream = retraded.embeddings(px)
    assert (out.last_hidden_state - ref.last_hidden_state).abs().max() <= 1e-9
    assert (out.pooler_output - ref.pooler_output).abs().max() <= 1e-9
    assert stream.mean(-1).abs().max() <= 1e-12
    # the patch rows of the table keep the original's entries up to the spread of the row means, not the means
    pos, pos0 = retraded.embeddings.position_embeddings[0], model.embeddings.position_embeddings[0]
    means = pos0.mean(-1)
    spread = (means[1:] - means[1:].mean()).abs().max()
    assert (pos[1:] - pos0[1:]).abs().max() <= spread + 1e-12
    assert spread < 0.5 * means[1:].abs().mean()  # the test model has a common row mean worth keeping
    assert (pos[0] - pos0[0]).abs().max() <= 1e-12  # the class row's table entry is the original's


def test_retrade_stays_exact_when_the_table_is_resampled(pair):
    """At another image size transformers resamples the grid bicubically (in float32): the constant moved
    into the table survives because the bicubic weights sum to 1."""
    model, retraded = pair
    px = torch.randn(2, 3, 84, 70, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        ref, out = model(pixel_values=px), retraded(pixel_values=px)
        stream = retraded.embeddings(px)
    assert stream.mean(-1).abs().max() <= 1e-6  # float32 resampling
    assert (out.last_hidden_state - ref.last_hidden_state).abs().max() <= 1e-5


def test_patched_gptq_beats_round_to_nearest_on_a_correlated_layer():
    losses = gptq.repro(0)
    assert losses["gptq, feedback fixed"] < 0.9 * losses["rtn (GPTQ's grid)"]


@pytest.mark.parametrize("scheme", ["sym", "asym"])
def test_exact_encoding_stores_gptqs_own_values(scheme):
    """The codes and scales handed to ``MatMulNBits`` dequantize to GPTQ's output exactly (no second rounding)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 24)).astype(np.float32)  # [in, out], three groups of 32
    x = rng.standard_normal((512, 96))
    gptq._GRIDS.clear()
    q = gptq.gptq_fixed(w, 2 * x.T @ x / 512, num_bits=4, group_size=32, scheme=scheme, blocksize=64)
    codes, scale, zero = gptq.encode_exact(q.T.copy(), 4, 32, scheme, "uint")
    assert codes.min() >= 0 and codes.max() <= 15
    back = ((codes - zero) * scale).reshape(24, 96).T
    np.testing.assert_allclose(back, q, rtol=0, atol=1e-12)
    assert not gptq._GRIDS  # one grid per layer, consumed


def test_online_variant_and_a_saved_matrix_are_exact_and_what_they_say(tmp_path):
    """``variant(model, "online")`` is the default checkpoint with online Hadamards before every Linear input
    (no γ folded: its norms' weights are the original's γ); ``q_file`` rotates by a saved matrix, the same model
    as rotating by it directly. Both exact in float64."""
    import normswap

    model = _tiny_dino(3)
    px = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    with torch.no_grad():
        ref = model(pixel_values=px).last_hidden_state
    online, note = engines.variant(model, "online", tmp_path)
    assert "online Hadamards before 10 Linear(s)" in note
    with torch.no_grad():
        out = online(pixel_values=px).last_hidden_state
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-9
    assert torch.equal(online.encoder.layer[0].norm1.weight, model.encoder.layer[0].norm1.weight)
    q, _ = normswap.rotation.rotate.rotation_matrix(32, "hadamard", 5)
    torch.save(q, tmp_path / "q.pt")
    turned, note = engines.variant(model, "q", tmp_path, q_file=tmp_path / "q.pt")
    assert "q.pt" in note
    with torch.no_grad():
        out = turned(pixel_values=px).last_hidden_state
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-9
    direct = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(direct, fold_gamma=True)
    normswap.rotate(direct, q, output="restore")
    assert all(torch.equal(a, b) for a, b in zip(turned.state_dict().values(), direct.state_dict().values(),
                                                  strict=True))


def test_export_leaves_an_eval_model_in_eval_mode(tmp_path):
    """torch.onnx.export restores its wrapper's mode recursively after exporting: a wrapper left in training mode
    put every module of the exported eval model in training mode, so eager timings after an export ran another
    graph (dropout and any train-only path) than the one exported."""
    model = benchmark_modules.tiny_dinov2(seed=1).float()
    engines.export(model, torch.randn(2, 3, 56, 56), tmp_path / "m.onnx")
    assert (tmp_path / "m.onnx").exists()
    assert not any(m.training for m in model.modules())


def test_rtn_activation_quantizers_round_every_linear_input_after_the_online_op_and_leave_the_model_float():
    """``--quantizers rtn-w8a4`` (``run_fake``): the rounding is on a copy (the model the next quantizer gets is
    still float), it changes the output, and on a replica with massive channels the online ops lower the 4-bit
    activation error (the op's spread reaches the Linear's input before its rounding)."""
    import normswap

    model = _tiny_dino(0)
    px = torch.randn(4, 3, 56, 56, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref = engines.Outputs(model)(px)[1]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _, tok = engines.run_fake(model, "rtn-w8a4", px)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    err = engines.one_minus_cos(ref, tok)
    assert err > 1e-8  # the float64 model against itself: 0
    online = _converted(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.rotate(online, "none", online=True)
    assert engines.one_minus_cos(ref, engines.run_fake(online, "rtn-w8a4", px)[1]) < err
