"""Tiny Hugging Face models for comparing ``--low-memory`` with the in-memory conversion: five layers each (deeper
than the 3/4-layer proxies the streamed plan is made on, so it is extrapolated), one per structure the streamed
path treats apart (round 58: a task head over a pooler, and bias slots inside the layers). Shared by
``tests/checkpoint/test_streaming_combos.py`` and ``benchmarks/lowmem_option_sweep.py``; and the streaming test
files' once-per-module conversions (:func:`converting_once`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers as tf
from safetensors import safe_open

SPECIAL = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}

MODELS: dict[str, Callable[[], tuple[type, Any]]] = {
    # a tied LM head (GPT-2), Pre-LN
    "gpt2": lambda: (tf.GPT2LMHeadModel,
                     tf.GPT2Config(n_layer=5, n_embd=32, n_head=4, vocab_size=99, n_positions=64, **SPECIAL)),
    # a tied LM head, Pre-LN, learned positions with an offset
    "opt": lambda: (tf.OPTForCausalLM,
                    tf.OPTConfig(num_hidden_layers=5, hidden_size=32, num_attention_heads=4, ffn_dim=64,
                                 vocab_size=99, max_position_embeddings=64, word_embed_proj_dim=32, **SPECIAL)),
    # Post-LN: approximate norms (refused streamed unless --mode exact), mean carries
    "bert": lambda: (tf.BertForMaskedLM,
                     tf.BertConfig(hidden_size=32, num_hidden_layers=5, num_attention_heads=4, intermediate_size=64,
                                   vocab_size=99, max_position_embeddings=64, pad_token_id=0)),
    # LayerScale, a patch convolution stem, a class token
    "dinov2": lambda: (tf.Dinov2Model,
                       tf.Dinov2Config(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=5,
                                       num_attention_heads=4, mlp_ratio=2, layerscale_value=0.5)),
    # round 58: a task head on top of a pooler (--task base leaves the head out, in memory and streamed)
    "bert_cls": lambda: (tf.BertForSequenceClassification,
                         tf.BertConfig(hidden_size=32, num_hidden_layers=5, num_attention_heads=4,
                                       intermediate_size=64, vocab_size=99, max_position_embeddings=64,
                                       pad_token_id=0, num_labels=3)),
    # round 58: bias slots inside the layers (q/k/v have no bias; ln_1 also feeds fc_in, which has one) and an
    # LM head with a bias, parallel attention and MLP
    "gptj": lambda: (tf.GPTJForCausalLM,
                     tf.GPTJConfig(n_layer=5, n_embd=32, n_head=4, rotary_dim=4, vocab_size=99, n_positions=64,
                                   **SPECIAL)),
    # encoder-decoder, a tied decoder head, a conv stem
    "whisper": lambda: (tf.WhisperForConditionalGeneration,
                        tf.WhisperConfig(d_model=32, encoder_layers=5, decoder_layers=5, encoder_attention_heads=4,
                                         decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                         vocab_size=99, num_mel_bins=8, max_source_positions=16,
                                         max_target_positions=32, decoder_start_token_id=0, **SPECIAL)),
}


def written_tensors(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor a conversion wrote into ``d``: the weights by name, the side files' (``normswap*.safetensors``)
    prefixed by their file name."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[f"{f.name if f.name.startswith('normswap') else ''}:{k}"] = h.get_tensor(k)
    return out


def converting_once(sources: dict[str, Path], root: Path) -> Callable[..., tuple[Path, Any]]:
    """``convert(name, low_memory, **options)``: ``normswap.convert(sources[name], DIR, low_memory=low_memory,
    **options)`` made once per (name, low_memory, options) under ``root``, returning ``(DIR, report)``; a test that
    asks for the same conversion as another reads the same output (read only) rather than converting again."""
    import normswap

    done: dict[str, tuple[Path, Any]] = {}

    def convert(name: str, low_memory: bool, **options: Any) -> tuple[Path, Any]:
        key = json.dumps([name, low_memory, options], sort_keys=True)
        if key not in done:
            out = root / f"c{len(done)}-{'stream' if low_memory else 'mem'}"
            done[key] = out, normswap.convert(sources[name], out, low_memory=low_memory, **options)
        return done[key]

    return convert
