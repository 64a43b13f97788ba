"""Speech, omni and vision-language families whose forwards read metadata next to their media, which the
input builder now derives from the model (its config, its encoders' signatures, its own error messages)
rather than from a per-type table. Each is a tiny replica (float64, LayerNorm γ/β randomised, eval):

- Granite Speech indexes its projected audio rows with ``input_features_mask``: one boolean per projected
  row, not per feature frame (its check "audio features and audio tokens do not match" says so);
- MOSS Transcribe-Diarize's audio encoder requires ``padding_mask`` over the clip's raw samples;
- VideoLLaMA 3 merges each image's patches by ``image_merge_sizes``, one per image next to its grid;
- Nemotron 3.5 Transcribe keeps its mel count in ``audio_config.asr_config``;
- dots.note reads each clip's raw length (``chunk_sample_lengths``) and reports a "multimodal" mismatch;
- Voxtral's default config leaves ``audio_token_id`` unset: converted by towers, the report naming the key.

The first three convert with no inputs, every LayerNorm reached, the exact ones exact to 1e-9 on inputs
the analysis never saw; the others' built inputs run the model (their conversion is the sweep's to time).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import normswap
from normswap.inputs import hf_example_inputs
from tests.input_families import assert_family_converts_exactly, run_built
from tests.zoo import randomise

TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
AUDIO_TOKEN = 100


def granite_speech():
    return tf.GraniteSpeechForConditionalGeneration(tf.GraniteSpeechConfig(
        text_config=dict(TEXT, model_type="granite"), audio_token_index=AUDIO_TOKEN,
        encoder_config=dict(num_layers=2, hidden_dim=32, num_heads=4, input_dim=16, output_dim=16),
        projector_config=dict(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                              intermediate_size=64, encoder_hidden_size=32)))


def moss():
    text = dict(TEXT, head_dim=8, layer_types=["full_attention", "full_attention"])
    return tf.MossTranscribeDiarizeForConditionalGeneration(tf.AutoConfig.for_model(
        "moss_transcribe_diarize", text_config=text, audio_token_id=AUDIO_TOKEN,
        audio_config=dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, hidden_size=32,
                          num_mel_bins=16, max_source_positions=100)))


def video_llama_3():
    text = dict(TEXT, layer_types=["full_attention", "full_attention"])
    return tf.VideoLlama3ForConditionalGeneration(tf.AutoConfig.for_model(
        "video_llama_3", text_config=text, image_token_id=AUDIO_TOKEN, video_token_id=AUDIO_TOKEN + 1,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)))


FAMILIES = {
    "granite_speech (feature mask over projected rows)": granite_speech,
    "moss_transcribe_diarize (padding_mask over raw samples)": moss,
    "video_llama_3 (image_merge_sizes)": video_llama_3,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_built_inputs_run_the_model_and_it_converts_exactly(family):
    assert_family_converts_exactly(FAMILIES[family])


def test_the_metadata_follows_the_model():
    granite = hf_example_inputs(randomise(granite_speech(), 0))
    per_sample = int((granite["input_ids"][0] == AUDIO_TOKEN).sum())
    mask = granite["input_features_mask"]  # one boolean per projected audio row, as its processor makes it
    assert mask.dtype == torch.bool and tuple(mask.shape) == (granite["input_ids"].shape[0], per_sample)
    built = hf_example_inputs(randomise(moss(), 0))  # the clip's raw samples: 160 per 10 ms feature frame
    assert built["padding_mask"].shape[-1] == 160 * built["input_features_mask"].shape[-1]
    built = hf_example_inputs(randomise(video_llama_3(), 0))
    # its vision config names no merge factor: 1, as its image processor merges images
    assert built["image_merge_sizes"].tolist() == [1] * built["image_grid_thw"].shape[0]


def test_mel_count_of_a_nested_asr_config():
    """Nemotron 3.5 Transcribe's ``audio_config`` groups an ASR and a diarization config; the mel count the
    encoder reads (its 128, not the builder's default 80) is the ASR config's."""
    asr = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=4)
    config = tf.AutoConfig.for_model("nemo_speechlm")
    config.audio_config.asr_config = type(config.audio_config.asr_config)(**asr)
    config.text_config = type(config.text_config)(**dict(
        TEXT, num_hidden_layers=2, layers_block_type=["attention", "mlp"], mamba_num_heads=4, mamba_head_dim=8,
        n_groups=1, ssm_state_size=8))
    config.audio_token_id = AUDIO_TOKEN
    model = randomise(tf.Nemotron3_5TranscribeForConditionalGeneration(config), 0)
    built = run_built(model)
    assert config.audio_config.asr_config.num_mel_bins == 128 and built["input_features"].shape[-1] == 128


def test_an_unset_audio_token_sends_the_model_by_towers_and_says_why():
    """Voxtral's default config leaves ``audio_token_id`` None; its forward compares the prompt with it, so
    no whole-model input places the audio. The per-tower route (inputs.towers) converts it, and its report
    line says why the whole model could not run, naming the key; with the key set, whole-model inputs run."""
    config = tf.VoxtralConfig(text_config=dict(TEXT, model_type="llama"), audio_config=dict(
        num_mel_bins=16, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=64, d_model=32,
        max_source_positions=50, intermediate_size=128))
    model = randomise(tf.VoxtralForConditionalGeneration(config), 0)
    with pytest.raises(normswap.NormswapError) as err:  # the builder alone: one line naming the key
        run_built(model)
    assert "\n" not in str(err.value) and "set `config.audio_token_id`" in str(err.value), err.value
    report = normswap.patch(model)
    route = report.plan.options["analysis_inputs"]
    assert "per tower" in route and "`audio_token_id` is None" in route, route
    assert report.sites and all(s.verdict != "approximate" for s in report.sites)
    model.config.audio_token_id = AUDIO_TOKEN
    built = run_built(model)
    assert int((built["input_ids"] == AUDIO_TOKEN).sum()) > 0


def csm():
    """CSM: text with audio tokens, its clips encoded by a Mimi codec into one embedded frame per token."""
    layers = dict(intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return tf.CsmForConditionalGeneration(tf.AutoConfig.for_model(
        "csm", hidden_size=32, **layers, num_codebooks=4, vocab_size=64, text_vocab_size=128, codebook_pad_token_id=63,
        codebook_eos_token_id=0, audio_token_id=AUDIO_TOKEN, audio_eos_token_id=AUDIO_TOKEN + 1, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, max_position_embeddings=512,
        depth_decoder_config=dict(hidden_size=32, backbone_hidden_size=32, num_codebooks=4, vocab_size=64, **layers),
        codec_config=dict(hidden_size=32, codebook_size=64, num_quantizers=4, upsample_groups=32, num_hidden_layers=1,
                          intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=8)))


def test_audio_clips_end_where_the_cutoffs_say_and_fill_the_prompt():
    """CSM cuts each sample's audio at ``input_values_cutoffs`` (one clip per sample, all of it) and writes the
    codec's frames into the prompt's audio positions by index: torch's shape error there tells how many
    frames a clip makes, and the prompt then holds that many audio tokens."""
    model = randomise(csm(), 0)
    built = run_built(model)
    assert built["input_values_cutoffs"].tolist() == [[built["input_values"].shape[-1]]] * 2
    assert int((built["input_ids"][0] == AUDIO_TOKEN).sum()) > 1
