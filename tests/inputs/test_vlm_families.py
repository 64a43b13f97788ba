"""Vision-language families whose analysis inputs the builder used to get wrong, each a tiny replica
(float64, LayerNorm γ/β randomised, eval), converted with no inputs as the CLI does:

- Aria: its projector takes only the patch counts ``projector_patch_to_query_dict`` names;
- Idefics (v1): images per sample with an ``image_attention_mask`` over the prompt;
- Mllama: tiled images with aspect-ratio ids, a tile mask and a ``cross_attention_mask``;
- DeepSeek-VL hybrid: a second, high-resolution image for its SAM tower (``high_res_pixel_values``);
- Qwen2.5-Omni: image and audio spans one after the other in the prompt (its rope index reads them so);
- BLIP-2's Q-Former alone (``query_embeds``) and a Qwen-VL style vision tower alone (``hidden_states``
  with ``grid_thw``).

Each gets inputs with no help, runs on them, and converts with every LayerNorm reached (found by the
analysis, so converted or skipped with a reason) and the exact ones exact to 1e-9 on inputs the
analysis never saw. A config whose media token is unset (old BLIP-2 checkpoints) is refused in one
line naming the key; tokenised probe and calibration text keep the prompt's image tokens.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as tf

import normswap
from normswap import inputs, presets
from normswap.inputs import hf_example_inputs
from normswap.surgery import calibrate
from tests.input_families import assert_family_converts_exactly
from tests.zoo import randomise

TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            vocab_size=128, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
           patch_size=8)


def aria():  # image 32 px of 8 px patches = 16 patches, which the projector does not take: 36 does
    vision = tf.Idefics3VisionConfig(**VIT)
    text = tf.AriaTextConfig(**TEXT, moe_num_experts=2, moe_topk=1, moe_intermediate_size=32, moe_num_shared_experts=1)
    return tf.AriaForConditionalGeneration(tf.AriaConfig(
        vision_config=vision, text_config=text, projector_patch_to_query_dict={36: 4, 256: 8}, image_token_index=100))


def idefics():
    return tf.IdeficsForVisionText2Text(tf.IdeficsConfig(
        vocab_size=128, additional_vocab_size=2, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, cross_layer_interval=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        vision_config=dict(embed_dim=32, image_size=32, patch_size=8, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64),
        perceiver_config=dict(use_resampler=True, resampler_n_latents=4, resampler_depth=1, resampler_n_heads=2,
                              resampler_head_dim=8)))


def mllama():
    vision = tf.MllamaVisionConfig(hidden_size=32, num_hidden_layers=2, num_global_layers=1, attention_heads=4,
                                   intermediate_size=64, image_size=16, patch_size=8, max_num_tiles=4,
                                   intermediate_layers_indices=[0, 1], vision_output_dim=96,
                                   supported_aspect_ratios=[[1, 1], [1, 2], [2, 1], [2, 2]])
    text = tf.MllamaTextConfig(**{k: v for k, v in TEXT.items() if k != "max_position_embeddings"},
                               cross_attention_layers=[1])
    return tf.MllamaForConditionalGeneration(tf.MllamaConfig(vision_config=vision, text_config=text,
                                                             image_token_index=100))


def deepseek_vl_hybrid():
    high = tf.SamVisionConfig(hidden_size=32, output_channels=32, num_hidden_layers=2, num_attention_heads=4,
                              image_size=64, patch_size=16, mlp_dim=64, global_attn_indexes=[1], window_size=2)
    return tf.DeepseekVLHybridForConditionalGeneration(tf.DeepseekVLHybridConfig(
        text_config=tf.LlamaConfig(**TEXT), vision_config=tf.SiglipVisionConfig(**VIT), high_res_vision_config=high,
        image_token_id=100))


def qformer():  # BLIP-2's Q-Former alone: query rows, cross-attending to image features of width 24
    return tf.Blip2QFormerModel(tf.Blip2QFormerConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                      intermediate_size=64, encoder_hidden_size=24, vocab_size=128))


def glm4v_vision():  # a Qwen-VL style tower alone: flattened patches as hidden_states, with grid_thw
    return tf.Glm4vVisionModel(tf.Glm4vVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                                                    out_hidden_size=32, patch_size=4, spatial_merge_size=2,
                                                    temporal_patch_size=2, image_size=32))


def qwen2_5_omni():  # images and audio in one prompt: the audio span after the image span, never inside it
    text = dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    audio = dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, d_model=32,
                 max_source_positions=100, n_window=50, output_dim=32)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=16, out_hidden_size=32, fullatt_block_indexes=[1])
    config = tf.Qwen2_5OmniThinkerConfig(text_config=text, audio_config=audio, vision_config=vision,
                                         audio_token_index=100, image_token_index=101, video_token_index=102,
                                         audio_start_token_id=103, audio_end_token_id=104)
    config.vision_start_token_id, config.vision_end_token_id = 105, 106  # checkpoints set them; 5.24's defaults not
    return tf.Qwen2_5OmniThinkerForConditionalGeneration(config)


FAMILIES = {
    "qwen2_5_omni_thinker (image and audio spans)": qwen2_5_omni,
    "aria (projector patch counts)": aria,
    "idefics (image_attention_mask)": idefics,
    "mllama (tiles, aspect-ratio ids, cross-attention mask)": mllama,
    "deepseek_vl_hybrid (high-resolution images)": deepseek_vl_hybrid,
    "blip_2_qformer (query_embeds)": qformer,
    "glm4v_vision (hidden_states with grid_thw)": glm4v_vision,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_inputs_are_built_and_every_norm_is_reached(family):
    assert_family_converts_exactly(FAMILIES[family])


def test_the_built_layouts_follow_the_config():
    aria_kw = hf_example_inputs(randomise(aria(), 0))
    assert aria_kw["pixel_values"].shape[-1] == 6 * 8  # 6 x 6 = 36 patches: the smallest count the projector takes
    mllama_kw = hf_example_inputs(randomise(mllama(), 0))
    assert mllama_kw["pixel_values"].shape[:3] == (2, 1, 4)  # one image of max_num_tiles tiles per sample
    assert mllama_kw["aspect_ratio_ids"].tolist() == [[4], [4]]  # [2, 2]: the ratio that uses all 4 tiles
    assert mllama_kw["cross_attention_mask"].shape == (*mllama_kw["input_ids"].shape, 1, 4)
    ds = hf_example_inputs(randomise(deepseek_vl_hybrid(), 0))
    assert ds["high_res_pixel_values"].shape[-1] == 64 and ds["pixel_values"].shape[-1] == 32


def test_an_unset_media_token_is_refused_in_one_line_naming_it():
    """Old BLIP-2 checkpoints leave ``image_token_index`` null; transformers 5's forward then cannot place
    the query outputs in the prompt on any input, so normswap says which key to set."""
    config = tf.Blip2Config(vision_config=dict(**VIT), qformer_config=dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, encoder_hidden_size=32,
        vocab_size=128), text_config=tf.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                  ffn_dim=64, vocab_size=128, word_embed_proj_dim=32),
        num_query_tokens=4, image_token_index=None)
    model = randomise(tf.Blip2ForConditionalGeneration(config), 0)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(normswap.NormswapError) as err:
        normswap.patch(model)
    text = str(err.value)
    assert "\n" not in text and "`image_token_index` is None" in text and "set `config.image_token_index`" in text
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is untouched
    model.config.image_token_index = 100  # as recent checkpoints have it: converts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert normswap.patch(model).plan.counts()


def llava_with_a_real_vocabulary():
    vision = tf.CLIPVisionConfig(**VIT, projection_dim=32)
    return tf.LlavaForConditionalGeneration(tf.LlavaConfig(
        vision_config=vision, text_config=tf.LlamaConfig(**dict(TEXT, vocab_size=400)), image_token_id=399,
        projector_hidden_act="gelu", vision_feature_layer=-1))


def test_tokenised_probe_and_calibration_text_keep_the_image_tokens():
    """With a tokenizer, the probe and the calibration are real text, and each row still holds the image's
    placeholder tokens (as many as the encoder makes), so the vision tower runs on them too."""
    model = randomise(llava_with_a_real_vocabulary(), 0)
    tok = presets.tokenizer("tiny-gpt2")  # ids up to 319: inside the vocabulary of 400
    built = hf_example_inputs(model)
    per_sample = int((built["input_ids"][0] == 399).sum())
    probe = inputs.verification_probe(model, tok)
    assert probe.text and "media span" in probe.source, probe.source
    assert ((probe.kwargs["input_ids"] == 399).sum(dim=1) == per_sample).all()
    words = probe.kwargs["input_ids"][probe.kwargs["attention_mask"].bool() & (probe.kwargs["input_ids"] != 399)]
    assert set(words.tolist()) <= set(range(320))  # the rest is the tokenizer's text
    with torch.no_grad():
        model(**probe.kwargs)  # it runs: tokens and image features agree
    batches, source = calibrate.builtin_batches(model, tok, batches=1, batch_size=4)
    ids = batches[0][1]["input_ids"]
    assert "English sentences" in source and ((ids == 399).sum(dim=1) == per_sample).all(), source
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(model, tokenizer=tok)
    assert report.verification["probe"].startswith("built-in English text"), report.verification["probe"]
    assert "image_outputs.last_hidden_state" in report.verification["compared"]  # the tower was verified
