"""Speech models are probed and calibrated on generated speech, not Gaussian features."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from normswap import inputs
from normswap.inputs import speech
from normswap.surgery import calibrate


def _whisper(max_source_positions: int = 1500) -> tf.WhisperForConditionalGeneration:
    config = tf.WhisperConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                              decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=64,
                              pad_token_id=1, bos_token_id=2, eos_token_id=2, decoder_start_token_id=3,
                              num_mel_bins=80, max_source_positions=max_source_positions, max_target_positions=16)
    return tf.WhisperForConditionalGeneration(config).eval()


def test_features_are_what_whisper_s_own_feature_extractor_computes():
    waves = speech.generated_speech(2, 16000 * 3, torch.Generator().manual_seed(0))
    ours = speech.speech_features(waves, 80, 300)
    extractor = tf.WhisperFeatureExtractor(feature_size=80, chunk_length=3)
    theirs = extractor([w.float().numpy() for w in waves], sampling_rate=16000, return_tensors="pt")
    assert theirs.input_features.shape == ours.shape
    assert (theirs.input_features.double() - ours).abs().max() < 1e-3


def test_generated_speech_has_voice_pauses_and_trailing_silence():
    waves = speech.generated_speech(3, 16000 * 30, torch.Generator().manual_seed(1))
    assert torch.isfinite(waves).all() and waves.abs().max() <= 1.0
    for wave in waves:
        frames = wave.reshape(-1, 160).pow(2).mean(1)  # 10 ms energy
        voiced = (frames > 1e-4 * frames.max()).nonzero()
        assert 150 <= voiced.max() < 900  # speech for 2-8 s, then silence, as a padded short clip
        inside = frames[: voiced.max()]
        assert (inside < 1e-6 * frames.max()).any()  # pauses between syllables
        # voiced speech is harmonic: the spectrum of a voiced stretch has distinct peaks
        spectrum = torch.fft.rfft(wave[: 16000]).abs()
        assert spectrum.max() > 20 * spectrum.median()


@pytest.mark.parametrize("positions", [30, 1500])
def test_the_probe_of_a_speech_model_is_speech_and_fits_30_seconds(positions):
    probe = inputs.verification_probe(_whisper(positions))
    feats = probe.kwargs["input_features"].double()
    assert "generated speech" in probe.source and "random" not in probe.source
    assert feats.shape[-1] == 2 * positions
    # a Whisper log-mel lies in [-1.5, 2]: 8 decades under the loudest bin, scaled by (x + 4) / 4
    assert feats.min() >= -1.5 and feats.max() <= 2.0
    # a 30 s window is one clip (as many 10 ms frames as 3000 allows), short windows keep the batch
    assert feats.shape[0] == (1 if positions == 1500 else inputs.PROBE_BATCH)
    assert probe.kwargs["decoder_input_ids"].shape[0] == feats.shape[0]


def test_built_in_calibration_of_a_speech_model_is_generated_speech():
    model = _whisper(30)
    batches, description = calibrate.builtin_batches(model, batches=2, batch_size=3)
    assert description.endswith("(2 x 3)")
    assert "generated speech" in description
    for _, kwargs in batches:
        feats = kwargs["input_features"]
        assert feats.shape == (3, 80, 60) and feats.min() >= -1.5 and feats.max() <= 2.0
    assert not torch.equal(batches[0][1]["input_features"], batches[1][1]["input_features"])
    # a 30-second window costs 1500 encoder tokens: one clip per batch, and the description says so
    long_batches, long_description = calibrate.builtin_batches(_whisper(1500), batches=2, batch_size=3)
    assert long_description.endswith("(2 x 1)")
    assert [b[1]["input_features"].shape for b in long_batches] == [(1, 80, 3000)] * 2


def test_waveform_models_get_normalised_speech():
    config = tf.Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                               conv_dim=(8, 8), conv_stride=(5, 4), conv_kernel=(10, 4), num_feat_extract_layers=2,
                               num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, vocab_size=16)
    probe = inputs.verification_probe(tf.Wav2Vec2ForCTC(config).eval())
    values = probe.kwargs["input_values"].double()
    assert probe.source == speech.GENERATED_SPEECH
    assert torch.allclose(values.mean(-1), torch.zeros(values.shape[0], dtype=values.dtype), atol=1e-6)
    assert torch.allclose(values.std(-1), torch.ones(values.shape[0], dtype=values.dtype), atol=1e-2)
