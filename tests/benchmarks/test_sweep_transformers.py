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


def test_shrunk_sizes_that_derive_from_each_other_stay_consistent():
    """Sizes one config defines through another follow it when shrunk: multi-head latent attention's
    parts (qk_head_dim = nope + rope; as many kv heads as heads), per-channel conv groups and codebook
    vectors (Mimi, EnCodec), Swin's heads per stage (each divides its stage's width), CLAP's audio
    width (patch width x 2^(stages-1)), DPT's read layers, Autoformer's context over its label window."""
    sweep = _sweep()
    mla = tf.AutoConfig.for_model("deepseek_v2")
    sweep.shrink(mla)
    assert mla.qk_head_dim == mla.qk_nope_head_dim + mla.qk_rope_head_dim <= 16
    assert mla.num_key_value_heads == mla.num_attention_heads == 4 and mla.num_experts_per_tok
    mimi, encodec = tf.AutoConfig.for_model("mimi"), tf.AutoConfig.for_model("encodec")
    sweep.shrink(mimi)
    sweep.shrink(encodec)
    assert mimi.upsample_groups == mimi.hidden_size == 32 and encodec.codebook_dim == encodec.hidden_size == 32
    swin = tf.AutoConfig.for_model("swin")
    sweep.shrink(swin)
    assert all((swin.embed_dim * 2 ** i) % h == 0 for i, h in enumerate(swin.num_heads)), swin.num_heads
    last_stage = swin.image_size // swin.patch_size // 2 ** (len(swin.depths) - 1)
    assert last_stage >= swin.window_size and last_stage % swin.window_size == 0  # whole windows at every stage
    clap = tf.AutoConfig.for_model("clap")
    sweep.shrink(clap)
    audio = clap.audio_config
    assert audio.hidden_size == audio.patch_embeds_hidden_size * 2 ** (len(audio.depths) - 1)
    dpt = tf.AutoConfig.for_model("dpt")
    sweep.shrink(dpt)
    assert max(dpt.backbone_out_indices) < dpt.num_hidden_layers and len(dpt.backbone_out_indices) == 4
    autoformer = tf.AutoConfig.for_model("autoformer")
    sweep.shrink(autoformer)
    assert autoformer.context_length >= autoformer.label_length


def test_the_oracle_is_not_normswap_and_runnable_types_are_counted():
    """A forward normswap cannot build inputs for still counts as runnable when the oracle (here inputs
    written for the type) runs it; the measure counts runnable types only, and a timeout is unknown."""
    sweep = _sweep()
    model = sweep.build("DecisionTransformerModel", "decision_transformer")
    sources = [source for source, _ in sweep.oracle_inputs(model, "decision_transformer")]
    assert sources == ["inputs written for this type"]
    assert all(sweep.runs(model, kw) is None for _, kw in sweep.oracle_inputs(model, "decision_transformer"))
    ok = {"build": "ok", "patch": "ok", "counts": {"exact": 1}}
    failing = {"build": "ok", "patch": "refused: could not run X.forward on the example inputs (...)",
               "runnable": True, "runs_on": "the model's dummy_inputs"}
    dead = {"build": "ok", "patch": "refused: could not run X.forward on the example inputs (...)",
            "runnable": False, "not_run": "ValueError: ..."}
    late = {"class": "?", "build": "timeout after 150 s"}
    rows = [{"type": "a", "classes": [ok, ok]}, {"type": "b", "classes": [ok, failing]},
            {"type": "c", "classes": [dead]}, {"type": "d", "classes": [ok, dead]}, {"type": "e", "classes": [late]}]
    t = sweep.runnable_totals(rows)
    assert (t["runnable"], t["converted"], t["unknown"]) == (3, 2, 1)  # a, b, d runnable; a and d converted
    assert [r["type"] for r in t["not_runnable"]] == ["c"] and [r["type"] for r in t["failing"]] == ["b"]


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
