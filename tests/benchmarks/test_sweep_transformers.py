"""The transformers sweep's pieces (``benchmarks/sweep_transformers.py``): which types it finds, that a
shrunk config stays consistent (special token ids inside the vocabulary), one class swept end to end, and
how rows are counted (a refusal for want of runnable inputs is told apart from a crash)."""

from __future__ import annotations

import transformers as tf

from tests import benchmark_modules


def _sweep():
    return benchmark_modules.load("sweep_transformers")


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
    assert row["counts"]["exact"] + row["counts"]["exact-with-centering"] > 0
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


def test_multimodal_rope_sections_sum_to_the_partial_rotary_half_width():
    """GLM-4V-MoE rotates half of each head (``partial_rotary_factor`` 0.5): its multimodal RoPE sections sum to
    the rotated half-width, and the tiny text model runs on plain token ids (round 61: ``split_with_sizes``
    refused the sections summed to the whole head's half-width, so the type never ran)."""
    import torch

    sweep = _sweep()
    config = sweep.tiny_config("glm4v_moe_text", "Glm4vMoeTextModel")
    rope = config.rope_parameters
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert sum(rope["mrope_section"]) == int(head_dim * rope["partial_rotary_factor"]) // 2
    _runs(tf.Glm4vMoeTextModel(config), input_ids=torch.randint(0, config.vocab_size, (1, 5)))


def test_pvt_keeps_its_stage_count_and_runs():
    """PVT's cls token sits on its last stage, the one without sequence reduction: the tiny config keeps the four
    stages its per-stage tuples describe, and the model runs on normswap's built inputs (round 61: two stages, the
    cls token on a reducing stage, a reshape error)."""
    sweep = _sweep()
    model = sweep.build("PvtModel", "pvt")
    assert model.config.num_encoder_blocks == len(model.config.sequence_reduction_ratios)
    kw, status = sweep.built_inputs(model)
    assert status == "ok" and sweep.runs(model, kw) is None


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


def test_cross_references_survive_the_shrink():
    """References between keys stay valid in the tiny config: hidden states read out at listed layers keep
    their number inside the tiny depth (Mllama's ``intermediate_layers_indices`` with the width derived from
    it, VipLLaVA's ``vision_feature_layer`` into its vision tower's layers); a kind of layer named by index
    stays present (Mllama's cross-attention layers, SAM's global attention in DeepSeek-VL hybrid); a list
    named for the encoder is not renumbered with the decoder's layers; RoPE sections the code reads sum to
    the rotary half-width (GLM-4V); a token id the code reads but the config lacks is set (Qwen2.5-Omni's
    thinker); an image that is not a whole number of patches is cut to one (Aya Vision); a module inserted
    after a layer stays inside the tiny depth (MiniCPM-V's merger)."""
    sweep = _sweep()
    mllama = sweep.tiny_config("mllama", "MllamaModel")
    vision, text = mllama.vision_config, mllama.text_config
    read = vision.intermediate_layers_indices
    assert len(read) == 5 and len(set(read)) == 5 and all(0 <= i < vision.num_hidden_layers for i in read)
    assert vision.vision_output_dim == vision.hidden_size * (len(read) + 1)
    assert text.cross_attention_layers and all(0 <= i < text.num_hidden_layers for i in text.cross_attention_layers)
    vip = sweep.tiny_config("vipllava", "VipLlavaModel")
    depth = vip.vision_config.num_hidden_layers
    assert len(vip.vision_feature_layer) == 5 and all(-depth - 1 <= i <= depth for i in vip.vision_feature_layer)
    hybrid = sweep.tiny_config("deepseek_vl_hybrid", "DeepseekVLHybridModel").high_res_vision_config
    assert hybrid.global_attn_indexes and all(0 <= i < hybrid.num_hidden_layers for i in hybrid.global_attn_indexes)
    doclayout = sweep.tiny_config("pp_doclayout_v3", "PPDocLayoutV3Model")
    assert doclayout.encode_proj_layers == tf.AutoConfig.for_model("pp_doclayout_v3").encode_proj_layers
    glm = sweep.tiny_config("glm4v_text", "Glm4vTextModel")
    head_dim = getattr(glm, "head_dim", None) or glm.hidden_size // glm.num_attention_heads
    assert sum(glm.rope_parameters["mrope_section"]) == head_dim // 2
    omni = sweep.tiny_config("qwen2_5_omni_thinker", "Qwen2_5OmniThinkerModel")
    assert not hasattr(tf.AutoConfig.for_model("qwen2_5_omni_thinker"), "vision_start_token_id")
    assert omni.vision_start_token_id < omni.text_config.vocab_size
    assert omni.vision_start_token_id not in (omni.image_token_id, omni.audio_token_id, omni.video_token_id)
    minicpm = sweep.tiny_config("minicpm_ocr_vision", "MiniCPMOcrVisionModel")  # its merger runs after this layer
    assert 0 <= minicpm.insert_layer_id < minicpm.num_hidden_layers
    aya = sweep.tiny_config("aya_vision", "AyaVisionForConditionalGeneration")
    side = aya.vision_config.image_size // aya.vision_config.patch_size
    assert aya.vision_config.image_size % aya.vision_config.patch_size == 0 and side % aya.downsample_factor == 0
    assert sweep.largest_vocabulary(aya) <= sweep.MAX_VOCAB  # its image token 255,036 renumbered


def test_fixed_cross_references_run_on_normswaps_inputs():
    """The models those configs build run on normswap's own inputs (before: "tuple index out of range",
    "stack expects a non-empty TensorList", "split_with_sizes expects split_sizes to sum exactly to 4")."""
    sweep = _sweep()
    for model_type, cls in (("vipllava", "VipLlavaModel"), ("mllama", "MllamaModel"), ("glm4v_text", "Glm4vTextModel"),
                            ("deepseek_vl_hybrid", "DeepseekVLHybridModel")):
        source, why = sweep.runnable(sweep.build(cls, model_type), model_type)
        assert source == "normswap's inputs", (model_type, why)


def test_sam_hiera_and_vocoder_types_shrink_to_tiny_models_that_run():
    """Sizes derived from the image, the stages and the vocoder follow the cut (before, each full shrink
    built a model that did not run, so the sweep fell back to the widths-kept one: 1024-px SAM images,
    a 26M-parameter Hiera, a vocoder at 512 channels and 256 samples a frame; out of time or memory at
    --limit 600): SAM's prompt grid is the image in patches and its position features half the prompt
    width, SAM-HQ's ``vit_dim`` the vision width (not 3 x its own), Hiera's per-stage widths follow its
    stem with the neck's channel list, its global-attention blocks inside the tiny stages, VITS' HiFi-GAN
    upsamples 2x a stage."""
    sweep = _sweep()
    sam = sweep.tiny_config("sam_hq", "SamHQModel")
    vision, prompt, decoder = sam.vision_config, sam.prompt_encoder_config, sam.mask_decoder_config
    assert vision.image_size <= 64 and prompt.image_embedding_size == prompt.image_size // prompt.patch_size
    assert decoder.vit_dim == vision.hidden_size and 2 * vision.num_pos_feats == prompt.hidden_size
    hiera = sweep.tiny_config("sam2_vision_model", "Sam2VisionModel")
    backbone = hiera.backbone_config
    assert backbone.embed_dim_per_stage[0] == backbone.hidden_size <= 32 and max(backbone.image_size) <= 128
    assert hiera.backbone_channel_list == backbone.embed_dim_per_stage[::-1]
    starts = [sum(backbone.blocks_per_stage[:i]) for i in range(len(backbone.blocks_per_stage))]
    # a global block is never a stage's first (that one pools) and lies inside the tiny depth
    assert backbone.global_attention_blocks and all(
        0 < i < sum(backbone.blocks_per_stage) and i not in starts for i in backbone.global_attention_blocks)
    nemo = sweep.tiny_config("nemo_speechlm", "Nemotron3_5TranscribeModel").text_config  # the kinds list is the depth
    assert len(nemo.layers_block_type) <= 4 and set(nemo.layers_block_type) == set(
        tf.AutoConfig.for_model("nemo_speechlm").text_config.layers_block_type)
    vits = sweep.tiny_config("vits", "VitsModel")
    assert list(vits.upsample_rates) == [2] * 4 and list(vits.upsample_kernel_sizes) == [4] * 4
    assert vits.upsample_initial_channel <= 32
    for model_type, cls in (("sam", "SamModel"), ("sam_hq", "SamHQModel"), ("sam2_vision_model", "Sam2VisionModel"),
                            ("vits", "VitsModel")):
        model = sweep.build(cls, model_type)
        assert sum(p.numel() for p in model.parameters()) < 3_000_000, model_type
        source, why = sweep.runnable(model, model_type)
        assert source == "normswap's inputs", (model_type, why)


def test_layernorms_never_called_make_a_class_partial():
    """A class whose patch succeeded while some LayerNorms were never called by the built inputs is
    ``partial``: counted apart (with how many), its type not converted, listed with the reason. The sweep
    reads the count from the planner's own reason, checked here on a model with an unused LayerNorm."""
    import torch
    from torch import nn

    import normswap

    sweep = _sweep()

    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.unused, self.head = nn.LayerNorm(8), nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.a(x))

    torch.manual_seed(0)
    report = normswap.patch(Unused().double().eval(), torch.randn(2, 5, 8, dtype=torch.float64))
    assert sweep.not_called(report.plan) == ["unused"], (report.plan.sites, report.plan.skipped)
    ok = {"class": "A", "build": "ok", "patch": "ok", "counts": {"exact": 2}, "not_called": 0, "runnable": True}
    partial = {"class": "B", "build": "ok", "patch": "ok", "counts": {"exact": 1, "skipped": 1}, "not_called": 1,
               "not_called_names": ["unused"], "runnable": True}
    assert (sweep.outcome(ok), sweep.outcome(partial)) == ("converted", "partial")
    rows = [{"type": "a", "classes": [ok]}, {"type": "b", "classes": [ok, partial]}]
    t = sweep.totals(rows)
    assert (t["classes_converted"], t["classes_partial"], t["layernorms_not_called"]) == (2, 1, 1)
    assert t["types_converted"] == 1
    rt = sweep.runnable_totals(rows)
    assert (rt["runnable"], rt["converted"]) == (2, 1) and [r["type"] for r in rt["failing"]] == ["b"]
    page = sweep.table(rows, None, 2, "5.24.0")
    assert "partly converted 1 (1 LayerNorms" in page and "| b | B | partial |" in page and "unused" in page


def test_help_and_page_say_how_to_regenerate_and_what_was_swept():
    """``--help`` gives the one command that regenerates everything; the page says which code the rows were
    swept on (each row's ``swept_on``) and with which transformers."""
    import subprocess
    import sys

    script = benchmark_modules.BENCHMARKS / "sweep_transformers.py"
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, check=True).stdout
    assert "--write --jobs 2" in out and "regenerate everything" in out
    sweep = _sweep()
    rows = [{"type": "a", "swept_on": "normswap 0123abcd", "classes": [{"class": "A", "build": "ok", "patch": "ok"}]}]
    page = sweep.table(rows, None, 1, "5.24.0")
    assert "transformers 5.24.0" in page and "normswap 0123abcd: 1 types" in page
    assert sweep.code_version(benchmark_modules.BENCHMARKS.parent).startswith("normswap ")
    assert "--write --jobs 2" in sweep.HEADER


def test_exact_mode_run_on_the_built_inputs_is_the_same_conversion():
    """The sweep's exact-mode run reuses the inputs it built once (``built_inputs``) instead of letting
    patch() build them again: the same verdicts and bitwise the same weights as patch() with no inputs."""
    import copy

    import torch

    import normswap

    sweep = _sweep()
    model = sweep.build("Blip2Model", "blip-2")
    kw, status = sweep.built_inputs(model)
    assert status == "ok"
    own, reused = copy.deepcopy(model), copy.deepcopy(model)
    a = normswap.patch(own, mode="exact", verify=False)
    b = normswap.patch(reused, dict(kw), mode="exact", verify=False)
    assert [(s.name, s.verdict) for s in a.plan.sites] == [(s.name, s.verdict) for s in b.plan.sites]
    assert a.plan.counts()["approximate"] > 0  # the case the sweep re-runs in exact mode
    wa, wb = own.state_dict(), reused.state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_compare_classes_each_difference_from_the_defaults_row():
    """``--compare`` (round 61): each class of an engine's sweep against the defaults' row, worst difference first;
    a --quantizer row stored compact (zero counts dropped, :func:`slim`) compares as the full row does."""
    sweep = _sweep()
    counts = {"exact": 3, "exact-with-centering": 0, "exact-with-per-norm-centering": 0, "approximate": 2, "skipped": 0}
    a = {"class": "A", "build": "ok", "patch": "ok", "counts": counts, "err": [1e-16, 2e-16], "message": "m"}

    def b(**kw):
        return {**a, **kw}

    assert sweep.difference(a, b(patch="crash: KeyError: x")) == "crash"
    assert sweep.difference(a, b(counts={**counts, "exact": 2, "approximate": 3})) == "exact lost"
    assert sweep.difference(a, b(err=[1e-16, 3e-8])) == "err"
    assert sweep.difference(a, b(patch="refused: verification failed")) == "refused"
    assert sweep.difference(a, {"class": "?", "build": "timeout after 150 s"}) == "timeout"
    moved = {**counts, "exact": 1, "exact-with-centering": 2}
    assert sweep.difference(a, b(counts=moved)) == "expected"
    assert sweep.difference(a, b(counts={**counts, "exact-with-per-norm-centering": 2, "approximate": 0})) == "better"
    row = sweep.slim({"type": "t", "swept_on": "normswap x", "classes": [b(err=[1.234e-16, "ValueError: …"])]})
    (c,) = row["classes"]
    assert "message" not in c and c["counts"] == {"exact": 3, "approximate": 2}
    assert c["err"] == [1.2e-16, "ValueError: …"]
    assert sweep.difference(a, c) == "err"  # a shape that fails only with the engine's options
    assert sweep.difference(a, sweep.slim({"type": "t", "classes": [a]})["classes"][0]) == "same"
    table = sweep.compare_table({"rows": [{"type": "t", "classes": [a]}]},
                                {"label": "--quantizer x", "rows": [{"type": "t", "classes": [b(counts=moved)]}]})
    assert "| t | A |" in table and "3/0/0/2/0 → 1/2/0/2/0" in table and "expected" in table


def test_round63_size_rules_build_tiny_models_that_run():
    """Round 63's size rules, each on the type that lacked it (round 62: built tiny, none ran; vibevoice's
    acoustic tokenizer did not build under MAX_PARAMS): Sapiens2's per-layer key/value head counts follow the
    head cut (each divides the tiny head count); SAM 3 tracker's per-level feature-map sizes follow the tiny
    image (the image in patches, x4, x2, x1); X-Codec's ``codebook_dim`` follows its computed hidden size
    (acoustic + semantic); MuseSpark audio's per-layer strides are cut with its layers (its samples per
    token is their product); VibeVoice's acoustic tokenizer keeps two downsampling stages; NeoMME's 2-D
    M-RoPE keeps 4 rotated channels a head. Each runs on normswap's own inputs."""
    sweep = _sweep()
    sapiens = sweep.tiny_config("sapiens2", "Sapiens2Model")
    heads = sapiens.num_attention_heads
    assert all(heads % n == 0 for n in sapiens.num_key_value_heads_per_layer), sapiens.num_key_value_heads_per_layer
    assert len(set(sapiens.num_key_value_heads_per_layer)) == 2  # still full and grouped layers
    sam3 = sweep.tiny_config("sam3_tracker", "Sam3TrackerModel").vision_config
    grid = sam3.backbone_config.image_size // sam3.backbone_config.patch_size
    assert sam3.backbone_feature_sizes == [[4 * grid] * 2, [2 * grid] * 2, [grid] * 2]
    xcodec = sweep.tiny_config("xcodec", "XcodecModel")
    assert xcodec.codebook_dim == xcodec.hidden_size <= 64
    muse = sweep.tiny_config("muse_spark_audio", "MuseSparkAudioModel")
    assert len(muse.patch_sizes) == len(muse.hidden_sizes) == muse.num_hidden_layers == 2
    assert muse.samples_per_token == muse.patch_sizes[0] * muse.patch_sizes[1]
    vibe = sweep.tiny_config("vibevoice_acoustic_tokenizer", "VibeVoiceAcousticTokenizerModel")
    assert len(vibe.downsampling_ratios) == 2 and len(vibe.depths) == 3
    neomme = sweep.tiny_config("neomme", "NeoMMEModel")  # its row and column axes each keep a rotated frequency
    assert neomme.head_dim * neomme.rope_parameters["full_attention"]["partial_rotary_factor"] >= 4
    for model_type, cls in (("sapiens2", "Sapiens2Model"), ("xcodec", "XcodecModel"),
                            ("muse_spark_audio", "MuseSparkAudioModel"),
                            ("vibevoice_acoustic_tokenizer", "VibeVoiceAcousticTokenizerModel"),
                            ("sam3_tracker", "Sam3TrackerModel")):
        model = sweep.build(cls, model_type)
        assert sum(p.numel() for p in model.parameters()) < sweep.MAX_PARAMS, model_type
        kw, status = sweep.built_inputs(model)
        assert status == "ok" and sweep.runs(model, kw) is None, (model_type, status)


def test_round63_rules_leave_staged_lists_without_a_derived_size_whole():
    """The round-63 rules' reach: the stride-list rule cuts per-layer tuples only where the config derives a size
    from them (SegFormer's per-stage lists, no such property, stay as long as before; PVT keeps its four stages),
    and a key/value head count follows only the query heads of its own stack."""
    sweep = _sweep()
    segformer = tf.AutoConfig.for_model("segformer")
    sweep.shrink(segformer)
    assert len(segformer.strides) == len(segformer.hidden_sizes) == 4
    assert sweep.tiny_config("pvt", "PvtModel").num_encoder_blocks == 4
    # a key/value head count follows the heads of its own stack: Moonshine's encoder keeps its 8 heads, so its
    # 8 key/value heads stay (the decoder's cut, 8 -> 4 heads, once halved them and the tiny model did not run)
    moonshine = tf.AutoConfig.for_model("moonshine")
    sweep.shrink(moonshine)
    assert moonshine.encoder_num_key_value_heads == moonshine.encoder_num_attention_heads
