"""Analysis inputs built for every family of transformers model: one tiny model per family whose inputs
the builder used to get wrong (vision-language prompts with image tokens, Qwen-VL ``grid_thw``,
images per sample, any-resolution tiles, omni pixel + audio, (B, T, F) speech features, raw audio,
time series with a forecast window, XLNet's unlimited positions), float64, γ/β randomised, eval.

Each must get inputs with no help, run on them, and convert with every LayerNorm reached (each one
found by the analysis, so converted or skipped with a reason) and the exact ones exact to 1e-9 on
inputs the analysis never saw. The CLI test converts saved tiny Idefics3 and LLaVA-OneVision
directories end to end (both used to end in an internal error).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from click.testing import CliRunner
from torch import nn

import normswap
from normswap.inputs import hf_example_inputs
from tests.input_families import assert_exact_on_unseen_inputs, convert_with_no_inputs, layernorms
from tests.zoo import randomise

TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            vocab_size=128, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
           patch_size=8)


def llava():
    vision = tf.CLIPVisionConfig(**VIT, projection_dim=32)
    return tf.LlavaForConditionalGeneration(tf.LlavaConfig(
        vision_config=vision, text_config=tf.LlamaConfig(**TEXT), image_token_id=100, projector_hidden_act="gelu",
        vision_feature_layer=-1))


def idefics3():
    return tf.Idefics3ForConditionalGeneration(_idefics3_config())


def _idefics3_config():
    vision = tf.Idefics3VisionConfig(**VIT)
    return tf.Idefics3Config(vision_config=vision, text_config=tf.LlamaConfig(**TEXT), image_token_id=100,
                             scale_factor=2)


def qwen2_vl():
    text = dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    return tf.Qwen2VLForConditionalGeneration(tf.Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=100, video_token_id=101, vision_start_token_id=102,
        vision_end_token_id=103))


def llava_onevision():
    vision = tf.SiglipVisionConfig(**VIT)
    return tf.LlavaOnevisionForConditionalGeneration(tf.LlavaOnevisionConfig(
        vision_config=vision, text_config=tf.Qwen2Config(**TEXT), image_token_id=100, video_token_id=101,
        image_grid_pinpoints=[[32, 32], [32, 64]], vision_feature_layer=-1))


def speech_to_text():  # log-mel filterbank features as (B, T, F)
    return tf.Speech2TextForConditionalGeneration(tf.Speech2TextConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128, input_feat_per_channel=20, input_channels=1,
        conv_channels=32, max_source_positions=200, max_target_positions=64, decoder_start_token_id=2))


def wav2vec2():  # raw mono audio
    return tf.Wav2Vec2ForCTC(tf.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
        vocab_size=32, do_stable_layer_norm=True, feat_extract_norm="layer"))


def time_series():  # a forecaster: its decoder runs only on the future window
    return tf.TimeSeriesTransformerModel(tf.TimeSeriesTransformerConfig(
        prediction_length=4, context_length=8, lags_sequence=[1, 2], d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        num_time_features=2))


def patchtst():  # multivariate (B, L, C)
    return tf.PatchTSTForPrediction(tf.PatchTSTConfig(
        num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, d_model=32, num_hidden_layers=2,
        num_attention_heads=4, ffn_dim=64, prediction_length=8, norm_type="layernorm"))


def xlnet():  # max_position_embeddings = -1: no limit, not a negative length
    return tf.XLNetLMHeadModel(tf.XLNetConfig(vocab_size=128, d_model=32, n_layer=2, n_head=4, d_inner=64))


FAMILIES = {
    "llava (image tokens)": llava,
    "idefics3 (images per sample)": idefics3,
    "qwen2_vl (grid_thw, mm_token_type_ids)": qwen2_vl,
    "llava_onevision (any-resolution tiles, image_sizes)": llava_onevision,
    "speech_to_text (B, T, F features)": speech_to_text,
    "wav2vec2 (raw audio)": wav2vec2,
    "time_series_transformer (forecast window)": time_series,
    "patchtst (multivariate series)": patchtst,
    "xlnet (no position limit)": xlnet,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_inputs_are_built_and_every_norm_is_reached(family):
    torch.manual_seed(0)
    built, original, exact, report = convert_with_no_inputs(randomise(FAMILIES[family](), 0))
    note = report.plan.options["analysis_inputs"]  # the report says what was built and how it reached the towers
    assert note.startswith("built from the config") and ("one run of the whole model" in note) == (
        "pixel_values" in built and "input_ids" in built), note
    assert_exact_on_unseen_inputs(original, exact, report)


def test_a_required_input_with_no_rule_is_refused_by_name():
    class NeedsBoxes(nn.Module):
        main_input_name = "pixel_values"

        def __init__(self):
            super().__init__()
            self.config = tf.PretrainedConfig()
            self.norm = nn.LayerNorm(4)

        def forward(self, pixel_values, boxes):
            return self.norm(pixel_values)

    with pytest.raises(normswap.NormswapError, match="requires `boxes`"):
        hf_example_inputs(NeedsBoxes())


@pytest.mark.parametrize("family", [idefics3, llava_onevision], ids=["idefics3", "llava_onevision"])
def test_cli_converts_a_saved_vision_language_model(tmp_path, family):
    from normswap.cli import main as cli

    torch.manual_seed(0)
    model = randomise(family(), 0).float()
    model.save_pretrained(tmp_path / "model")
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "model"), "--out", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    reloaded = normswap.load(tmp_path / "out")
    assert not layernorms(reloaded)
