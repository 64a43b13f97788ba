"""Built inputs ask for no loss: normswap compares outputs, and a config that asks for a loss by default
demands labels no built input has. FLAVA pre-training (``config.return_loss=True``) refused with
"`codebook_pixel_value` are required to generate `mim_labels` if loss is expected"; its images were
also built at 64 pixels whatever `image_config.image_size` said."""

from __future__ import annotations

import copy
import warnings

import torch
import transformers as tf

import normswap
from normswap.inputs import hf_example_inputs
from normswap.inputs.from_file import no_cache
from tests.zoo import randomise

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)


def tiny_flava_pretraining() -> tf.FlavaForPreTraining:
    config = tf.FlavaConfig(
        text_config={**SMALL, "vocab_size": 99, "max_position_embeddings": 64},
        image_config={**SMALL, "image_size": 32, "patch_size": 8},
        multimodal_config=SMALL,
        image_codebook_config={"hidden_size": 16, "num_groups": 1, "num_blocks_per_group": 1, "vocab_size": 64},
        hidden_size=32, projection_dim=32)
    assert config.return_loss  # the default this test is about
    torch.manual_seed(0)
    return randomise(tf.FlavaForPreTraining(config), 0)


def test_flava_pretraining_runs_on_built_inputs_and_converts():
    model = tiny_flava_pretraining()
    kwargs = hf_example_inputs(model)
    assert kwargs["return_loss"] is False
    assert kwargs["pixel_values"].shape[-1] == 32  # the image size of FLAVA's `image_config`
    original = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(model)
    assert report.changed and report.plan.counts()["exact"] > 0
    # every exact norm exact: the same model with the approximate norms kept as LayerNorm
    exact = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(exact, mode="exact", verify=False)
        probe = hf_example_inputs(original, batch=2, seq=7, seed=3)
        with torch.no_grad():
            ref, out = original(**probe), exact(**probe)
    for key in ("contrastive_logits_per_image", "mmm_text_logits"):
        assert float((out[key] - ref[key]).abs().max() / ref[key].abs().max()) < 1e-9, key


def test_inputs_from_a_file_ask_for_no_loss_either():
    model = tiny_flava_pretraining()
    got = no_cache(model, {"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    assert got["return_loss"] is False
    assert no_cache(model, {"return_loss": True})["return_loss"] is True  # the user's say stands
