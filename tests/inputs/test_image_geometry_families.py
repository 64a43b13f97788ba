"""Image inputs whose geometry the builder read wrongly from the config (round 63), each on a tiny replica built
from its transformers config (float64, LayerNorm γ/β randomised, eval):

- MGP-STR: ``image_size`` is a ``(height, width)`` pair, ``(32, 128)``; the builder took its first entry for a
  square side and the model refuses any image but its own size;
- NeoMME: the forward takes flattened patch rows ``(N, 3·p²)`` with no grid, placed at the prompt's image tokens,
  and its factorized token embedding (vocabulary → rank → hidden) is narrower than the rows that replace them;
- PP-OCRv5 mobile rec: its backbone strides 2 at the stem and at 4 of its 5 stages (32 in all), then pools 3 x 2:
  the default 64-pixel image leaves 2 x 2 positions, too few; the builder reads the stage count from the config.

Each gets inputs with no help, runs on them, and converts with every LayerNorm reached, the exact ones exact to
1e-9 on inputs the analysis never saw.
"""

from __future__ import annotations

import pytest
import transformers as tf

from normswap.inputs import hf_example_inputs
from normswap.inputs.media import image_sides, max_backbone_stride
from tests.input_families import assert_family_converts_exactly, run_built
from tests.zoo import randomise


def mgp_str():
    return tf.MgpstrForSceneTextRecognition(tf.MgpstrConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2.0, num_bpe_labels=64,
        num_wordpiece_labels=64, max_token_length=8))


def neomme():
    config = tf.AutoConfig.for_model(
        "neomme", vocab_size=128, embedding_rank=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, patch_size=4, embedding_dim=32,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512)
    return tf.NeoMMEModel(config)


def pp_ocrv5_mobile_rec():
    config = tf.AutoConfig.for_model("pp_ocrv5_mobile_rec", hidden_size=32, num_attention_heads=4, depth=1,
                                     head_out_channels=40)
    config.backbone_config.scale = 0.25  # narrower stages, the same strides
    return tf.PPOCRV5MobileRecForTextRecognition(config)


def test_an_image_size_pair_is_read_as_height_and_width():
    model = randomise(mgp_str(), 0).double().eval()
    assert image_sides(model.config) == (32, 128)
    built = run_built(model)
    assert tuple(built["pixel_values"].shape[-2:]) == (32, 128)


def test_flat_patch_rows_fill_the_prompts_image_tokens():
    model = randomise(neomme(), 0).double().eval()
    built = run_built(model)
    rows = built["pixel_values"]
    assert rows.dim() == 2 and rows.shape[1] == 3 * 4 * 4
    assert int((built["input_ids"] == model.config.image_token_id).sum()) == rows.shape[0]


def test_an_image_large_enough_for_every_backbone_stride():
    model = randomise(pp_ocrv5_mobile_rec(), 0).double().eval()
    assert max_backbone_stride(model.config.backbone_config) == 32
    built = run_built(model)
    assert min(built["pixel_values"].shape[-2:]) >= 4 * 32
    assert hf_example_inputs(model)["pixel_values"].shape == built["pixel_values"].shape


@pytest.mark.parametrize("build", [mgp_str, neomme, pp_ocrv5_mobile_rec], ids=lambda f: f.__name__)
def test_converts_with_no_inputs(build):
    report = assert_family_converts_exactly(build)
    assert report.plan.sites
