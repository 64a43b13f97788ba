"""The sweep's tiny configs keep the widths one tower hands another (``benchmarks/sweep_transformers.py``,
``_follow_widths_across`` and ``_token_offsets``): without these a type's tiny model fails on every input, so
the sweep counted a model normswap's inputs run as not running."""

from __future__ import annotations

from tests import benchmark_modules


def _sweep():
    return benchmark_modules.load("sweep_transformers")


def test_widths_handed_from_tower_to_tower_follow_the_cut():
    sweep = _sweep()
    molmo = sweep.tiny_config("molmo2", "Molmo2Model")  # the adapter writes text-wide rows (default: 3584 vs 4096)
    assert molmo.adapter_config.text_hidden_size == molmo.text_config.hidden_size <= 64
    ocr = sweep.tiny_config("unlimited_ocr", "UnlimitedOcrModel").vision_config  # SAM's last channels feed CLIP
    assert ocr.sam_config.downsample_channels[-1] == ocr.encoder_config.hidden_size <= 64
    dots = sweep.tiny_config("dots3_note", "Dots3NoteForConditionalGeneration")  # audio rows into the prompt
    assert dots.audio_config.adapter_out_dim == dots.text_config.hidden_size <= 64


def test_code_blocks_placed_in_the_vocabulary_fit_it():
    """Apertus 1.5 embeds its image and audio tokenizers' codes at ``<kind>_token_offset`` of the text vocabulary:
    each block follows the one before, past every special id, and the vocabulary holds the last."""
    sweep = _sweep()
    config = sweep.tiny_config("apertus1p5", "Apertus1p5Model")
    image, audio = config.image_token_offset, config.audio_token_offset
    assert max(sweep.all_special_ids(config)) < image
    assert audio == image + config.vision_config.codebook_size
    assert audio + config.audio_config.codebook_size <= config.text_config.vocab_size <= 1024
