"""Verification that knows its model: the feature axis of a changed output comes from the analysis (a
channels-first VitDet stream), models drawing random numbers in eval mode are compared under the same
draws (ViT-MAE's random masking), and only quantized *tensors* are refused as quantized (I-BERT with
``quant_mode=False`` computes on float weights). Tiny transformers replicas in float64, LayerNorm γ/β
randomised."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn

import normswap
from normswap import pipeline
from normswap.errors import NormswapError
from normswap.surgery.verify import RANDOM_NOTE, compare, raw_stream_error, same_draws


def _randomised(model: nn.Module) -> nn.Module:
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(torch.empty_like(m.weight).uniform_(0.5, 1.5, generator=gen))
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen, dtype=m.bias.dtype) * 0.2)
    return model.double().eval()


def _vitdet() -> nn.Module:
    cfg = tf.VitDetConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, image_size=32,
                          patch_size=8, pretrain_image_size=32)
    torch.manual_seed(0)
    return _randomised(tf.VitDetModel(cfg))


def _vitmae(cls: type = tf.ViTMAEModel) -> nn.Module:
    cfg = tf.ViTMAEConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          image_size=32, patch_size=8, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                          decoder_num_attention_heads=2, decoder_intermediate_size=64)
    torch.manual_seed(0)
    return _randomised(cls(cfg))


def _every_norm_converted(report: normswap.Report, model: nn.Module) -> None:
    assert report.changed and report.sites
    assert all(sp.convert and sp.verdict.startswith("exact") for sp in report.sites), report.plan.table()
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())


def test_a_channels_first_stream_output_is_centred_over_its_channel_axis():
    """Fails if the raw-stream check centred over the last axis: VitDet's output is (B, C, H, W)."""
    model = _vitdet()
    original = pipeline.working_copy(model, torch.float64)
    pixels = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    report = normswap.patch(model)
    _every_norm_converted(report, model)
    assert report.plan.changed_output_axes == {"last_hidden_state": -3}  # (B, C, H, W): C
    assert report.verification["raw_stream_rel_error"] < 1e-12
    with torch.no_grad():
        ref, out = original(pixel_values=pixels), model(pixel_values=pixels)
    # the outputs differ by a per-token constant over C (centering), not over W: only the analysis' axis says so
    axes = report.plan.changed_output_axes
    changed = set(report.plan.changed_outputs)
    assert raw_stream_error(ref, out, changed, lambda t: t, axes)["raw_stream_rel_error"] < 1e-12
    assert raw_stream_error(ref, out, changed, lambda t: t)["raw_stream_rel_error"] > 1e-4


@pytest.mark.parametrize("cls", [tf.ViTMAEModel, tf.ViTMAEForPreTraining])
def test_a_model_drawing_random_numbers_in_eval_mode_is_compared_under_the_same_draws(cls):
    """Fails if the original and the converted model ran with different random masks (ViT-MAE's)."""
    model = _vitmae(cls)
    pixels = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():  # the model really is random in eval mode: two runs differ
        a, b = model(pixel_values=pixels), model(pixel_values=pixels)
    assert not torch.equal(a.mask, b.mask)
    original = pipeline.working_copy(model, torch.float64)
    state = torch.get_rng_state()
    report = normswap.patch(model)
    assert torch.equal(torch.get_rng_state(), state)  # the user's random stream is untouched
    _every_norm_converted(report, model)
    assert RANDOM_NOTE in report.message
    assert report.verification["max_rel_error"] < 1e-12
    with torch.no_grad():
        with same_draws():
            ref = original(pixel_values=pixels)
        with same_draws():
            out = model(pixel_values=pixels)
    assert compare(ref, out, set(report.plan.changed_outputs))["worst_rel_error_any_output"] < 1e-12


def test_a_deterministic_model_is_not_said_to_draw_random_numbers():
    report = normswap.patch(_vitdet())
    assert RANDOM_NOTE not in report.message


def test_a_float_model_with_quant_in_its_class_names_is_not_refused_as_quantized():
    """I-BERT with quant_mode=False runs F.linear on float weights in classes named QuantLinear/QuantAct."""
    cfg = tf.IBertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         vocab_size=100, quant_mode=False)
    model = tf.IBertModel(cfg).double().eval()
    assert any("Quant" in type(m).__name__ for m in model.modules())
    assert pipeline.quantized_weight(model) is None
    pipeline.preflight(model)  # no "quantized layer" refusal


class _Int8Linear(nn.Module):
    """A layer whose weights are int8 (a parameter that is not a float)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4, dtype=torch.int8), requires_grad=False)


class _Packed(nn.Module):
    """A GPTQ-style layer: packed integer weights in a buffer, float scales."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("qweight", torch.zeros(4, 2, dtype=torch.int32))
        self.scales = nn.Parameter(torch.ones(4))


@pytest.mark.parametrize("layer, words", [
    (_Int8Linear(), "parameter `q.weight` is quantized (torch.int8)"),
    (_Packed(), "buffer `q.qweight` holds quantized weights (torch.int32)"),
])
def test_quantized_weights_are_refused_whatever_the_class_is_called(layer, words):
    model = nn.Sequential()
    model.add_module("norm", nn.LayerNorm(4))
    model.add_module("q", layer)
    with pytest.raises(NormswapError, match="convert the full-precision model") as err:
        pipeline.preflight(model)
    assert words in str(err.value)


def test_float8_weights_are_refused():
    model = nn.Linear(4, 4)
    model.weight.data = model.weight.data.to(torch.float8_e4m3fn)
    with pytest.raises(NormswapError, match="is quantized"):
        pipeline.preflight(model)


@pytest.mark.parametrize("build", [_vitdet, _vitmae])
def test_convert_and_verify_on_the_command_line(build, tmp_path):
    """Through the CLI: the reload check compares the raw stream bitwise (VitDet's only output) and
    ``verify`` judges it up to the per-token constant; ViT-MAE's random masks agree in every run, and
    its float32 yardstick is estimated (float64 draws other numbers), which the precision line says."""
    from click.testing import CliRunner

    from normswap.cli import main

    build().float().save_pretrained(tmp_path / "orig")
    res = CliRunner().invoke(main, ["convert", str(tmp_path / "orig"), "--out", str(tmp_path / "rms"), "-q"])
    assert res.exit_code == 0, res.output
    assert "reload_bitwise_equal=True" in res.stdout
    res = CliRunner().invoke(main, ["verify", str(tmp_path / "orig"), str(tmp_path / "rms")])
    assert res.exit_code == 0, res.output
    assert "exact conversion: max relative error" in res.stdout
    if build is _vitdet:
        assert "raw_stream_rel_error=" in res.stdout
    else:
        assert "ORIGINAL draws random numbers, which differ in float64" in res.stdout


def _hiera() -> nn.Module:
    cfg = tf.Sam2HieraDetConfig(hidden_size=16, embed_dim_per_stage=[16, 32, 64, 128],
                                num_attention_heads_per_stage=[1, 2, 4, 8], blocks_per_stage=[1, 2, 2, 2],
                                global_attention_blocks=[2, 4, 6], image_size=[64, 64])
    torch.manual_seed(0)
    return _randomised(tf.Sam2HieraDetModel(cfg))


def test_a_stream_returned_at_two_outputs_is_changed_at_both():
    """Fails if only one path of a value the model returns twice is counted as changed: SAM 2's Hiera
    returns its last stage as ``last_hidden_state`` and as ``intermediate_hidden_states[3]``. Its stream is
    centered after each max-pooling block, so both differ from the original by a per-token constant; with
    one path missed, verification compared it raw and refused a correct conversion (1.2e-3)."""
    model = _hiera()
    original = pipeline.working_copy(model, torch.float64)
    report = normswap.patch(model, mode="exact")  # the norms after a max-pool stay LayerNorm in this mode
    assert report.plan.hooks and report.plan.counts()["exact-with-centering"] > 0
    assert {"last_hidden_state", "intermediate_hidden_states[3]"} <= set(report.plan.changed_outputs)
    assert report.verification["raw_stream_rel_error"] < 1e-12  # every output is the stream, centered
    pixels = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        ref, out = original(pixel_values=pixels), model(pixel_values=pixels)
    assert (ref.last_hidden_state - out.last_hidden_state).abs().max() > 1e-6  # changed, by a per-token constant
    figures = compare(ref, out, set(report.plan.changed_outputs))
    assert figures["compared"] == [] and figures["raw_stream_rel_error"] < 1e-12
