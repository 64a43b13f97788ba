"""The transformers sweep's pieces (``benchmarks/sweep_transformers.py``): which types it finds, that a
shrunk config stays consistent (special token ids inside the vocabulary), one class swept end to end, and
how rows are counted (a refusal for want of runnable inputs is told apart from a crash)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import transformers as tf

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "sweep_transformers.py"


def _sweep():
    spec = importlib.util.spec_from_file_location("sweep_transformers", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_types_and_classes():
    sweep = _sweep()
    types = sweep.layernorm_types()
    assert {"gpt2", "vit", "whisper", "idefics3", "xlnet", "patchtst"} <= set(types)
    assert len(types) > 400
    assert sweep.classes("whisper") == ["WhisperModel", "WhisperForConditionalGeneration"]


def test_shrunk_configs_keep_their_token_ids_in_the_vocabulary():
    sweep = _sweep()
    config = tf.AutoConfig.for_model("llava")
    sweep.shrink(config)
    assert config.text_config.hidden_size <= 64 and config.text_config.num_hidden_layers <= 2
    assert config.image_token_id < config.text_config.vocab_size


def test_one_class_swept_and_counted():
    sweep = _sweep()
    row = sweep.run_class("GPT2LMHeadModel", "gpt2")
    assert sweep.outcome(row) == "converted", row
    assert row["counts"]["exact"] > 0
    assert all(isinstance(e, float) and e <= 1e-9 for e in row["err"]), row["err"]
    no_run = {"build": "ok", "patch": "refused: could not run X.forward on the example inputs (...)"}
    crash = {"build": "ok", "patch": "crash: TypeError: ..."}
    totals = sweep.totals([{"type": "a", "classes": [row, no_run]}, {"type": "b", "classes": [crash]}])
    assert (totals["classes_converted"], totals["classes_no_run"], totals["classes_crashed"]) == (1, 1, 1)
    assert totals["types_converted"] == 0


def _runs(model, **inputs) -> None:
    import torch

    with torch.no_grad():
        model.eval()(**inputs)


def test_tiny_mla_moe_config_is_self_consistent_and_runs():
    """DeepSeek-V3: the multi-head latent attention widths shrink together (head_dim is the rope width,
    qk_head_dim = nope + rope, key/value heads = heads) and the experts to 4, 2 per token."""
    import torch

    sweep = _sweep()
    config = sweep.tiny_config("deepseek_v3", "DeepseekV3Model")
    assert config.qk_head_dim == config.qk_nope_head_dim + config.qk_rope_head_dim
    assert config.head_dim == config.qk_rope_head_dim <= 16
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.n_routed_experts == 4 and config.num_experts_per_tok <= 2 and config.n_group == 1
    assert config.kv_lora_rank <= 32 and config.q_lora_rank <= 32
    _runs(tf.DeepseekV3Model(config), input_ids=torch.randint(0, config.vocab_size, (1, 5)))


def test_tiny_configs_rotary_width_and_windows_fit():
    """GPT-J's rotary width fits its (cut) head width; Swin's windows fit its last stage."""
    import torch

    sweep = _sweep()
    config = sweep.tiny_config("gptj", "GPTJModel")
    assert config.rotary_dim <= config.n_embd // config.n_head
    _runs(tf.GPTJModel(config), input_ids=torch.randint(0, config.vocab_size, (1, 5)))
    config = sweep.tiny_config("swin", "SwinModel")
    assert config.embed_dim <= 64 and all(config.embed_dim * 2 ** i % h == 0 for i, h in enumerate(config.num_heads))
    _runs(tf.SwinModel(config), pixel_values=torch.randn(1, config.num_channels, config.image_size, config.image_size))


def test_per_layer_lists_keep_one_layer_of_each_kind():
    """A hybrid model stays hybrid: Qwen3.5's linear and full attention both kept, every per-layer list
    as long as the layer count; Llama 4's layer-index lists renumbered into the kept layers."""
    sweep = _sweep()
    config = tf.AutoConfig.for_model("qwen3_5_text")
    sweep.shrink(config)
    assert set(config.layer_types) == {"linear_attention", "full_attention"}
    assert len(config.layer_types) == config.num_hidden_layers <= 4
    config = tf.AutoConfig.for_model("llama4_text")
    sweep.shrink(config)
    assert len(config.no_rope_layers) == len(config.layer_types) == config.num_hidden_layers
    assert all(0 <= i < config.num_hidden_layers for i in config.moe_layers)


def test_fallbacks_when_the_full_shrink_does_not_build():
    """MobileBERT's MLM head does not build with its widths cut apart: the mild shrink (widths kept)
    does. Gemma 4's special ids near 260,000 are renumbered, so its vocabulary is tiny too."""
    sweep = _sweep()
    config = sweep.tiny_config("mobilebert", "MobileBertForMaskedLM")
    assert config.hidden_size == tf.AutoConfig.for_model("mobilebert").hidden_size and config.num_hidden_layers <= 2
    config = sweep.tiny_config("gemma4", "Gemma4Model")
    assert config.text_config.vocab_size < 1024
    assert config.image_token_id < config.text_config.vocab_size
