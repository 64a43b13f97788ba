"""Analysis inputs for the speech, detection, time-series and other non-vision-language families the
sweep (benchmarks/sweep_transformers.py) showed not running on normswap's own inputs: one tiny model per
rule, float64, LayerNorm γ/β randomised, eval.

- RT-DETR picks its queries as the top-k encoder positions: images whose feature maps hold fewer
  positions fail ("selected index k out of range"), so the builder sizes them from ``feat_strides``;
- Wav2Vec2-BERT reads two stacked 80-mel frames (``feature_projection_input_dim``), not ``num_mel_bins``;
- SpeechT5Model, built without pre-nets, takes hidden states on both sides;
- BROS needs a box per token, the Decision Transformer a trajectory, TimesFM its padding and frequency;
- CLAP's audio tower takes one-channel spectrogram images (B, 1, T, mels).

Each must get inputs with no help, run on them, reach every LayerNorm and convert, the exact norms exact
to 1e-9 on inputs the analysis never saw (another seed and shape). Wav2Vec2-BERT also checks that
verification's zero-mean evidence ignores rows that are zero to rounding: its first norm reads the
features centred at the input, and generated speech ends in silence, constant rows that centre to ~1e-16.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn

import normswap
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from tests.input_families import assert_exact_on_unseen_inputs, convert_with_no_inputs
from tests.zoo import float64_casts, randomise


def rt_detr():  # top-k query selection over the encoder's positions: 100 queries need 96 x 96 images
    backbone = tf.RTDetrResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                     out_features=["stage2", "stage3", "stage4"])
    return tf.RTDetrForObjectDetection(tf.RTDetrConfig(
        backbone_config=backbone, encoder_in_channels=[32, 64, 128], encoder_hidden_dim=32, d_model=32,
        decoder_in_channels=[32, 32, 32],
        encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4,
        decoder_layers=2, decoder_n_points=2, num_queries=100, num_labels=4))


def wav2vec2_bert():  # (B, T, F) features, F = feature_projection_input_dim (stacked frames)
    return tf.Wav2Vec2BertModel(tf.Wav2Vec2BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        feature_projection_input_dim=48, conv_depthwise_kernel_size=3, output_hidden_size=32))


def speecht5():  # no pre-nets: hidden states in, hidden states to the decoder
    return tf.SpeechT5Model(tf.SpeechT5Config(
        hidden_size=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64))


def bros():  # a box per token
    return tf.BrosModel(tf.BrosConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        dim_bbox_sinusoid_emb_2d=32, dim_bbox_sinusoid_emb_1d=4, dim_bbox_projection=8))


def decision_transformer():  # a trajectory: states, actions, rewards, returns-to-go, timesteps
    return tf.DecisionTransformerModel(tf.DecisionTransformerConfig(
        state_dim=5, act_dim=3, hidden_size=32, n_layer=2, n_head=4, n_inner=64, max_ep_len=64))


def timesfm():  # past values with their padding and a frequency class
    return tf.TimesFmModel(tf.TimesFmConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
        context_length=64, patch_length=16, horizon_length=16))


def clap():  # text + one-channel spectrogram images (B, 1, T, mels)
    audio = dict(spec_size=64, patch_size=4, patch_stride=[4, 4], window_size=4, depths=[1, 1],
                 num_attention_heads=[2, 2], patch_embeds_hidden_size=16, hidden_size=32, num_mel_bins=16,
                 projection_dim=16, enable_fusion=False)
    text = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64, projection_dim=16)
    return tf.ClapModel(tf.ClapConfig(audio_config=audio, text_config=text, projection_dim=16))


FAMILIES = {
    "rt_detr (top-k queries: image size)": rt_detr,
    "wav2vec2_bert (stacked features)": wav2vec2_bert,
    "speecht5 (no pre-nets)": speecht5,
    "bros (boxes)": bros,
    "decision_transformer (trajectory)": decision_transformer,
    "timesfm (padding, frequency)": timesfm,
    "clap (spectrogram images)": clap,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_built_inputs_run_the_model_and_it_converts_exactly(family):
    torch.manual_seed(0)
    _, original, exact, report = convert_with_no_inputs(randomise(FAMILIES[family](), 0))
    assert any(s.verdict != "approximate" for s in report.sites), "no exact norm to measure"
    assert_exact_on_unseen_inputs(original, exact, report)


def test_detector_images_hold_as_many_positions_as_queries():
    """The image side the builder picks for a top-k detector: the smallest multiple of the coarsest
    stride whose feature maps (strides 8, 16, 32) hold the 100 queries: 96 (189 positions; 64 holds 84)."""
    model = rt_detr()
    pixels = hf_example_inputs(model)["pixel_values"]
    assert tuple(pixels.shape[-2:]) == (96, 96)


def test_stacked_speech_features_run_the_model():
    """Wav2Vec2-BERT's features are (B, T, feature_projection_input_dim), two stacked mel frames: built so,
    they run it."""
    model = randomise(wav2vec2_bert(), 0)
    built = hf_example_inputs(model)
    assert built["input_features"].shape[-1] == 48
    with torch.no_grad(), default_dtype(torch.float64):
        model(**built)


def test_a_trajectory_follows_the_config():
    built = hf_example_inputs(decision_transformer(), batch=2, seq=6)
    assert built["states"].shape == (2, 6, 5) and built["actions"].shape == (2, 6, 3)
    assert built["timesteps"].dtype == torch.long and int(built["timesteps"].max()) < 64


def test_a_missing_input_is_named_in_one_line_in_cli_words():
    """A forward argument no rule builds is refused in one line naming it; on the command line the way
    out is a file of inputs (``--example-inputs``), not the Python keyword."""
    from normswap.cli.common import cli_words

    class NeedsQueries(nn.Module):
        main_input_name = "pixel_values"

        def __init__(self):
            super().__init__()
            self.config = tf.PretrainedConfig()
            self.norm = nn.LayerNorm(4)

        def forward(self, pixel_values, query_boxes):
            return self.norm(pixel_values)

    with pytest.raises(normswap.NormswapError) as caught:
        hf_example_inputs(NeedsQueries())
    line = cli_words(str(caught.value))
    assert "\n" not in line and "`query_boxes`" in line, line
    assert "--example-inputs FILE.safetensors holding it" in line and "example_inputs=" not in line, line


def test_a_text_to_speech_decoder_reads_one_code_per_codebook():
    """Dia's decoder embeds one audio code per codebook per step: its ids are (B, T, num_channels), and
    the whole model (text encoder and audio decoder) runs on them."""
    enc = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
               intermediate_size=64, vocab_size=64, max_position_embeddings=64)
    dec = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               intermediate_size=64, vocab_size=40, num_channels=3, cross_hidden_size=32, cross_num_attention_heads=4,
               cross_head_dim=8, cross_num_key_value_heads=4, max_position_embeddings=64, pad_token_id=37,
               eos_token_id=36, bos_token_id=38)
    model = tf.DiaModel(tf.DiaConfig(encoder_config=enc, decoder_config=dec, delay_pattern=[0, 1, 2])).double().eval()
    built = hf_example_inputs(model, batch=2, seq=6)
    ids = built["decoder_input_ids"]
    assert ids.shape[0] == 2 and ids.shape[-1] == 3 and ids.dim() == 3 and int(ids.max()) < 40
    with torch.no_grad(), default_dtype(torch.float64), float64_casts():
        model(**built)
