"""Vision-language and entity families whose inputs the common layouts did not build, now built from the
config and the forward signature (:mod:`normswap.inputs.vision`, :mod:`normswap.inputs.structured`). Each is a
tiny replica (float64, LayerNorm γ/β randomised, eval):

- Inkling 2 (and Inkling 2 Loop): patches channels-last, one ``m·p × m·p`` square of merged patches per prompt
  token, with ``image_grid_thw`` counted in prompt tokens;
- Inkling: ``t × p × p`` patch cubes channels-last, one per prompt token, no grid (it has no LayerNorm: the
  inputs run it and patch says there is nothing to do);
- Molmo 2: crops of patch rows pooled into prompt tokens by index (``image_token_pooling``, ``image_grids``);
- LUKE: entities next to the text (``entity_ids``, ``entity_position_ids`` …), which alone reach its entity
  embeddings' LayerNorm and its masked-LM head's entity predictions.

The ones with LayerNorms convert with no inputs, every LayerNorm reached, the exact ones exact to 1e-9 on
inputs the analysis never saw.
"""

from __future__ import annotations

import pytest
import transformers as tf

import normswap
from normswap.inputs import hf_example_inputs, vision
from normswap.inputs.builder import describe
from tests.input_families import assert_family_converts_exactly, eager_experts, run_built
from tests.zoo import randomise

IMAGE_TOKEN = 100
HYBRID_TEXT = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, swa_head_dim=8, layer_types=["hybrid_sliding", "hybrid"], max_position_embeddings=512,
                   intermediate_size=64, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                   eos_token_id=2)


def inkling2(model_type: str = "inkling2"):
    config = tf.AutoConfig.for_model(
        model_type, text_config=dict(HYBRID_TEXT, unpadded_vocab_size=128), image_token_id=IMAGE_TOKEN,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           patch_size=4, spatial_merge_size=2, posemb_grid_size=8, projection_hidden_dim=64,
                           text_hidden_size=32))
    return tf.AutoModel.from_config(config)


def molmo2():
    layers = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=8, intermediate_size=64)
    config = tf.AutoConfig.for_model(
        "molmo2", vision_config=dict(layers, num_hidden_layers=2, image_size=[56, 56], patch_size=14),
        adapter_config=dict(layers, vision_feature_layer=[1, 0], text_hidden_size=32),
        text_config=dict(layers, num_key_value_heads=2, vocab_size=128, num_hidden_layers=2,
                         max_position_embeddings=512, rope_scaling_layers=[0, 1]),
        image_start_token_id=101, low_res_image_start_token_id=102, image_end_token_id=103,
        image_patch_id=IMAGE_TOKEN, frame_start_token_id=104, frame_end_token_id=105)
    return tf.Molmo2ForConditionalGeneration(config)


def luke():
    return tf.LukeForMaskedLM(tf.LukeConfig(
        vocab_size=128, entity_vocab_size=64, entity_emb_size=16, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64))


FAMILIES = {
    "inkling2 (merged channels-last patches, grid in prompt tokens)": inkling2,
    "inkling2_loop (the same tower)": lambda: inkling2("inkling2_loop"),
    "molmo2 (image_token_pooling, image_grids)": molmo2,
    "luke (entity_ids, entity_position_ids)": luke,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_built_inputs_run_the_model_and_it_converts_exactly(family):
    assert_family_converts_exactly(FAMILIES[family])


def test_the_patch_rows_follow_the_tower():
    """Inkling 2: one row per prompt token, ``m·p`` pixels a side, channels last; the grid in prompt tokens."""
    model = randomise(inkling2(), 0)
    built = hf_example_inputs(model)
    vision = model.config.vision_config
    side = vision.spatial_merge_size * vision.patch_size
    rows = int((built["input_ids"] == IMAGE_TOKEN).sum())
    assert tuple(built["pixel_values"].shape) == (rows, side, side, vision.num_channels)
    assert int(built["image_grid_thw"].prod(-1).sum()) == rows


def test_pooled_crops_index_every_patch_once():
    """Molmo 2: one crop per image of the tower's position-table size; each prompt token pools a 2 × 2 window of
    its crop's patches, every patch in exactly one window; ``image_grids`` holds as many tokens as the prompt."""
    model = randomise(molmo2(), 0)
    built = hf_example_inputs(model)
    crops, patches, _ = built["pixel_values"].shape
    assert patches == model.config.vision_config.num_position_embeddings
    pooled = built["image_token_pooling"]
    assert sorted(pooled[pooled >= 0].tolist()) == list(range(crops * patches))
    grids = built["image_grids"]
    tokens = int((grids[:, 0] * grids[:, 1] + grids[:, 2] * grids[:, 3]).sum())
    assert tokens == pooled.shape[0] == int((built["input_ids"] == IMAGE_TOKEN).sum())


def test_entities_mention_the_prompts_words():
    """LUKE: each entity's positions are words of the prompt (at the model's position ids), padded with -1."""
    model = randomise(luke(), 0)
    built = hf_example_inputs(model)
    positions = built["entity_position_ids"]
    words = built["input_ids"].shape[1]
    offset = model.config.pad_token_id + 1
    used = positions[positions >= 0]
    assert used.numel() and int(used.min()) >= offset + 1 and int(used.max()) < offset + words
    assert built["entity_ids"].shape == built["entity_attention_mask"].shape == positions.shape[:2]
    assert int(built["entity_ids"].min()) >= 3  # past the padding, unknown and mask entities
    assert "`entity_ids` (2, 2)" in describe(model, built)  # the report says the entities were built


def test_patch_cubes_run_a_model_with_no_layernorm():
    """Inkling's tower folds ``t × p × p`` channels-last cubes into one token each; it has no LayerNorm, so
    patch, with the built inputs running it, has nothing to do (it was refused as not running before)."""
    text = dict(HYBRID_TEXT, mlp_layer_types=["sparse", "sparse"], n_shared_experts=1)
    config = tf.AutoConfig.for_model(
        "inkling_mm_model", text_config=text, image_token_id=IMAGE_TOKEN, audio_token_id=IMAGE_TOKEN + 1,
        image_bos_token_id=IMAGE_TOKEN + 2, audio_bos_token_id=IMAGE_TOKEN + 3,
        audio_config=dict(mel_vocab_size=64, text_hidden_size=32),
        vision_config=dict(text_hidden_size=32, hidden_size=32, n_layers=2, num_attention_heads=4, patch_size=4))
    model = eager_experts(randomise(tf.AutoModel.from_config(config), 0))
    built = run_built(model)
    vision = config.vision_config
    assert tuple(built["pixel_values"].shape[1:]) == (vision.temporal_patch_size, 4, 4, vision.num_channels)
    report = normswap.patch(model)
    assert not report.sites and "no LayerNorm" in report.message


def test_a_patch_size_given_as_a_pair_builds_inputs() -> None:
    """Hiera and InternVL give ``patch_size`` as ``[h, w]``: the channels-last rules, tried for every image
    model, read it as a side instead of crashing the builder (``int()`` of a list)."""
    config = tf.HieraConfig(embed_dim=8, image_size=[64, 64], num_heads=[1, 1, 1, 1], depths=[1, 1, 1, 1],
                            patch_size=[7, 7], patch_stride=[4, 4], patch_padding=[3, 3], mlp_ratio=2.0,
                            masked_unit_size=[8, 8], query_stride=[2, 2], num_query_pool=2)
    model = tf.HieraModel(config).double().eval()
    built = hf_example_inputs(model)
    assert tuple(built["pixel_values"].shape) == (2, 3, 64, 64)
    assert vision.patch_side(config, "patch_size", default=14) == 7
