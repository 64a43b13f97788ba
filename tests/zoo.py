"""Tiny random models for tests: every architecture family normswap claims, built from configs.

LayerNorm γ/β and every bias are randomised (the default 1/0 init hides folding bugs), models
are in eval mode and float64, so an exact conversion must match to ~1e-15.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import torch
import transformers as tf
from torch import nn

import normswap
from normswap.analysis import precision

SPECIAL = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
LLM = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99,
           max_position_embeddings=64, **SPECIAL)

# name -> (model class, config factory)
# image classifiers get 32 classes: with the default 2, their logits are 2 numbers per image, too few for
# an error ratio to measure anything (data2vec-vision read 0.75-2.35 from one random model to the next)
CLASSES = dict(num_labels=32)

EXACT = {
    "gpt2": lambda: (tf.GPT2LMHeadModel, tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=99,
                                                           n_positions=64, **SPECIAL)),
    "gpt2-untied": lambda: (tf.GPT2LMHeadModel, tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=99,
                                                                  n_positions=64, tie_word_embeddings=False,
                                                                  **SPECIAL)),
    "gpt_neo": lambda: (tf.GPTNeoForCausalLM, tf.GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=4,
                                                              vocab_size=99, max_position_embeddings=64,
                                                              attention_types=[[["global", "local"], 1]],
                                                              **SPECIAL)),
    "gptj": lambda: (tf.GPTJForCausalLM, tf.GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4,
                                                       vocab_size=99, n_positions=64, **SPECIAL)),
    "gpt_neox-parallel": lambda: (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(**LLM, use_parallel_residual=True)),
    "gpt_neox-sequential": lambda: (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(**LLM, use_parallel_residual=False)),
    "opt": lambda: (tf.OPTForCausalLM, tf.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                    ffn_dim=64, word_embed_proj_dim=32, vocab_size=99,
                                                    max_position_embeddings=64, **SPECIAL)),
    "bloom": lambda: (tf.BloomForCausalLM, tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=99,
                                                          **SPECIAL)),
    "falcon-7b-style": lambda: (tf.FalconForCausalLM, tf.FalconConfig(**LLM, parallel_attn=True,
                                                                          new_decoder_architecture=False)),
    "falcon-new-arch": lambda: (tf.FalconForCausalLM, tf.FalconConfig(**LLM, new_decoder_architecture=True,
                                                                          num_kv_heads=2)),
    "falcon-sequential": lambda: (tf.FalconForCausalLM, tf.FalconConfig(**LLM, parallel_attn=False,
                                                                            new_decoder_architecture=False)),
    "phi": lambda: (tf.PhiForCausalLM, tf.PhiConfig(**LLM)),
    "phi-qk-layernorm": lambda: (tf.PhiForCausalLM, tf.PhiConfig(**LLM, qk_layernorm=True)),
    "codegen": lambda: (tf.CodeGenForCausalLM, tf.CodeGenConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4,
                                                                vocab_size=99, n_positions=64, n_ctx=64,
                                                                **SPECIAL)),
    "gpt_bigcode": lambda: (tf.GPTBigCodeForCausalLM, tf.GPTBigCodeConfig(n_layer=2, n_embd=32, n_head=4,
                                                                          vocab_size=99, n_positions=64,
                                                                          **SPECIAL)),
    "mpt": lambda: (tf.MptForCausalLM, tf.MptConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=64,
                                                    vocab_size=99, **SPECIAL)),
    "stablelm": lambda: (tf.StableLmForCausalLM, tf.StableLmConfig(**{**LLM, "hidden_size": 64},
                                                                   num_key_value_heads=4)),
    "stablelm-parallel-qk": lambda: (tf.StableLmForCausalLM, tf.StableLmConfig(
        **{**LLM, "hidden_size": 64}, num_key_value_heads=4, use_parallel_residual=True, qk_layernorm=True)),
    "persimmon": lambda: (tf.PersimmonForCausalLM, tf.PersimmonConfig(**LLM)),
    "olmo": lambda: (tf.OlmoForCausalLM, tf.OlmoConfig(**LLM)),
    "cohere": lambda: (tf.CohereForCausalLM, tf.CohereConfig(**LLM)),
    "cohere-qk-norm": lambda: (tf.CohereForCausalLM, tf.CohereConfig(**LLM, use_qk_norm=True)),
    "biogpt": lambda: (tf.BioGptForCausalLM, tf.BioGptConfig(**LLM)),
    "xglm": lambda: (tf.XGLMForCausalLM, tf.XGLMConfig(d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                                                       vocab_size=99, max_position_embeddings=64, **SPECIAL)),
    "vit": lambda: (tf.ViTForImageClassification, tf.ViTConfig(**CLASSES, image_size=32, patch_size=8, hidden_size=32,
                                                               num_hidden_layers=2, num_attention_heads=4,
                                                               intermediate_size=64)),
    "clip-text": lambda: (tf.CLIPTextModelWithProjection, tf.CLIPTextConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99,
        max_position_embeddings=64, projection_dim=16, **SPECIAL)),
    "clip-vision": lambda: (tf.CLIPVisionModelWithProjection, tf.CLIPVisionConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
        patch_size=8, projection_dim=16)),
    "whisper": lambda: (tf.WhisperForConditionalGeneration, tf.WhisperConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=99, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, decoder_start_token_id=0, **SPECIAL)),
}

ENC_DEC = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=99, max_position_embeddings=64,
               decoder_start_token_id=0, **SPECIAL)

DINOV3 = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_register_tokens=2)

# More families of the same kinds, with the verdicts normswap must reach (all exact, or some approximate).
MORE = {
    "nemotron": (lambda: (tf.NemotronForCausalLM, tf.NemotronConfig(**LLM, num_key_value_heads=4, head_dim=8)),
                 "exact"),
    "mbart": (lambda: (tf.MBartForConditionalGeneration, tf.MBartConfig(**ENC_DEC)), "exact"),
    "m2m100": (lambda: (tf.M2M100ForConditionalGeneration, tf.M2M100Config(**ENC_DEC)), "exact"),
    "pegasus": (lambda: (tf.PegasusForConditionalGeneration, tf.PegasusConfig(**ENC_DEC)), "exact"),
    "deit": (lambda: (tf.DeiTForImageClassification, tf.DeiTConfig(**CLASSES,
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64)), "exact"),
    "wav2vec2-stable": (lambda: (tf.Wav2Vec2ForCTC, tf.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(32, 32),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        do_stable_layer_norm=True, feat_extract_norm="layer", vocab_size=20)), "exact"),
    "clip": (lambda: (tf.CLIPModel, tf.CLIPConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         vocab_size=99, max_position_embeddings=64, **SPECIAL),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           image_size=32, patch_size=8), projection_dim=16)), "exact"),
    "marian": (lambda: (tf.MarianMTModel, tf.MarianConfig(**ENC_DEC)), "approximate"),
    "convnext": (lambda: (tf.ConvNextForImageClassification, tf.ConvNextConfig(**CLASSES,
        hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32)), "approximate"),
    # channels-first LayerNorm after a depthwise conv that reads the stream: no exact conversion
    "convnextv2": (lambda: (tf.ConvNextV2ForImageClassification, tf.ConvNextV2Config(**CLASSES,
        hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32)), "approximate"),
    # Swin-V2: the block norms read one Linear each (exact); the final norm reads a post-norm stream
    "swinv2": (lambda: (tf.Swinv2ForImageClassification, tf.Swinv2Config(**CLASSES,
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)), "approximate"),
    # q/k norms that are RMS over the whole projection (not per head), and RMS block norms after each
    # sublayer: every norm reported skipped, already RMS-style
    "olmo2": (lambda: (tf.Olmo2ForCausalLM, tf.Olmo2Config(**LLM)), "skipped"),
    # GroupNorm(1, C): recognised and kept, with the reason (walker.identify)
    "poolformer": (lambda: (tf.PoolFormerForImageClassification, tf.PoolFormerConfig(**CLASSES,
        hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2, patch_sizes=[7, 3], strides=[4, 2],
        padding=[2, 1], num_attention_heads=[1, 1], mlp_ratio=2.0)), "skipped"),
    "swin": (lambda: (tf.SwinForImageClassification, tf.SwinConfig(**CLASSES,
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)), "approximate"),
    # LayerScale λ folds into the writer's rows (then λ = 1): exact
    "beit-layerscale": (lambda: (tf.BeitForImageClassification, tf.BeitConfig(**CLASSES,
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, use_mean_pooling=False)), "exact"),
    "data2vec-vision": (lambda: (tf.Data2VecVisionForImageClassification, tf.Data2VecVisionConfig(**CLASSES,
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, use_mean_pooling=False)), "exact"),
    # RoPE on the patch keys and a bias-less k_proj: β stays in norm1 (rotary keys are not shift-invariant)
    "dinov3-vit": (lambda: (tf.DINOv3ViTModel, tf.DINOv3ViTConfig(**DINOV3)), "exact"),
    # value_bias=False: norm1's β reaches v_proj, and moves through attention into o_proj's bias
    "dinov3-vit-no-value-bias": (lambda: (tf.DINOv3ViTModel, tf.DINOv3ViTConfig(
        **DINOV3, key_bias=True, value_bias=False)), "exact"),
    "dinov2": (lambda: (tf.Dinov2ForImageClassification, tf.Dinov2Config(**CLASSES,
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2)),
        "exact"),
}

APPROXIMATE = {
    "bert": lambda: (tf.BertForMaskedLM, tf.BertConfig(**LLM)),
    "roberta": lambda: (tf.RobertaForMaskedLM, tf.RobertaConfig(**{**LLM, "pad_token_id": 1})),
    "distilbert": lambda: (tf.DistilBertForMaskedLM, tf.DistilBertConfig(dim=32, n_layers=2, n_heads=4,
                                                                         hidden_dim=64, vocab_size=99,
                                                                         max_position_embeddings=64,
                                                                         pad_token_id=0)),
    "bart": lambda: (tf.BartForConditionalGeneration, tf.BartConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=99, max_position_embeddings=64,
        decoder_start_token_id=0, forced_eos_token_id=None, **SPECIAL)),
    "opt-post-ln": lambda: (tf.OPTForCausalLM, tf.OPTConfig(hidden_size=32, num_hidden_layers=2,
                                                            num_attention_heads=4, ffn_dim=64,
                                                            word_embed_proj_dim=32, vocab_size=99,
                                                            max_position_embeddings=64,
                                                            do_layer_norm_before=False, **SPECIAL)),
    # the families of the sentence encoders and cross-encoders people convert: MPNet (relative position
    # bias, all-mpnet-base-v2), ALBERT (one layer shared across depth, a factorised embedding),
    # ELECTRA (an embedding projection), DeBERTa-v2 (disentangled relative attention)
    "mpnet": lambda: (tf.MPNetForMaskedLM, tf.MPNetConfig(**{**LLM, "pad_token_id": 1})),
    "albert": lambda: (tf.AlbertForMaskedLM, tf.AlbertConfig(**LLM, embedding_size=16)),
    "electra": lambda: (tf.ElectraForMaskedLM, tf.ElectraConfig(**LLM, embedding_size=16)),
    "deberta-v2": lambda: (tf.DebertaV2ForMaskedLM, tf.DebertaV2Config(
        **LLM, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
        max_relative_positions=16)),
}


def randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random LayerNorm γ/β and biases (so folding mistakes show), eval mode, float64."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.dim() == 1 and ("norm" in name.lower() or "ln" in name.lower() or leaf == "bias"):
                base = 1.0 if leaf in ("weight", "gamma", "scale") else 0.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2 and "norm" in name.lower():  # per-head norm params (cohere)
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            if "lambda" in leaf:  # LayerScale (BEiT, DINOv2): per-channel, so a fold that ignores it shows
                p.copy_(0.1 + 0.05 * torch.randn(p.shape, generator=gen))
    return model.double().eval()


def build(table: dict, name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cls, config = table[name]()
    return randomise(cls(config), seed)


def patched_copies(model: nn.Module, example_inputs, option_sets: dict[str, dict]) -> dict[str, nn.Module]:
    """A converted deep copy of ``model`` per named option set (``normswap.patch(copy, example_inputs,
    **options)``), its warnings silenced: the tests that compare option sets assert on plans and outputs."""
    out = {}
    for name, options in option_sets.items():
        converted = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            normswap.patch(converted, example_inputs, **options)
        out[name] = converted
    return out


def float64_reference(model: nn.Module, example_inputs=None) -> nn.Module:
    """A copy whose norms compute in float64 end to end.

    Some HF norms (OLMo, Cohere, ...) upcast to float32 and back *inside* the module even for a
    float64 model, which puts float32 rounding in the "original". The exactness claim is about the
    math, so the reference replaces each norm's forward with the same formula in float64.
    """
    from normswap.pipeline import find_norms

    ref = copy.deepcopy(model)
    for site in find_norms(ref, example_inputs).sites:
        module = ref.get_submodule(site.path)
        module.forward = lambda x, *a, _s=site, _m=module, **k: _s.reference(_m, x)
    return ref


# State-space, recurrent and hybrid language models, with the verdict normswap must reach. Only RWKV and
# xLSTM have LayerNorms: RWKV's gated feed-forward joins the residual stream block after block, so past
# the stream-start op its norms are approximate (a chain of centering ops is LayerNorm by another name);
# xLSTM's multi-head LayerNorm flattens its heads before γ (no RMSNorm of that shape) and is kept. The
# others are RMS-only (their gated norms included): every norm is reported skipped with its formula,
# and fold_gamma folds γ into the readers where it can.
SSM_LLM = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, **SPECIAL)
SSM = {
    # rescale_every=0: RWKV otherwise divides its own weights in eval mode (refused, see test_ssm.py)
    "rwkv": (lambda: (tf.RwkvForCausalLM, tf.RwkvConfig(
        **SSM_LLM, context_length=64, attention_hidden_size=32, intermediate_size=64, rescale_every=0)),
        "approximate"),
    "xlstm": (lambda: (tf.xLSTMForCausalLM, tf.xLSTMConfig(
        **SSM_LLM, num_heads=4, qk_dim_factor=0.5, v_dim_factor=1.0, mode="inference")), "skipped"),
    "mamba": (lambda: (tf.MambaForCausalLM, tf.MambaConfig(**SSM_LLM, state_size=8, intermediate_size=64)),
              "skipped"),
    "mamba2": (lambda: (tf.Mamba2ForCausalLM, tf.Mamba2Config(
        **SSM_LLM, state_size=8, num_heads=8, head_dim=8, n_groups=2, expand=2, chunk_size=8)), "skipped"),
    "falcon_mamba": (lambda: (tf.FalconMambaForCausalLM, tf.FalconMambaConfig(
        **SSM_LLM, state_size=8, intermediate_size=64)), "skipped"),
    "jamba": (lambda: (tf.JambaForCausalLM, tf.JambaConfig(
        **LLM, num_key_value_heads=2, mamba_d_state=8, mamba_expand=2, attn_layer_period=2, attn_layer_offset=1,
        num_experts=1)), "skipped"),
    "zamba2": (lambda: (tf.Zamba2ForCausalLM, tf.Zamba2Config(
        **LLM, num_key_value_heads=4, mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8, num_mem_blocks=1,
        chunk_size=8, layers_block_type=["mamba", "hybrid"])), "skipped"),
    "bamba": (lambda: (tf.BambaForCausalLM, tf.BambaConfig(
        **LLM, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8,
        attn_layer_indices=[1])), "skipped"),
    "granitemoehybrid": (lambda: (tf.GraniteMoeHybridForCausalLM, tf.GraniteMoeHybridConfig(
        **LLM, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8,
        layer_types=["mamba", "attention"], num_local_experts=0, shared_intermediate_size=64)), "skipped"),
    "nemotron_h": (lambda: (tf.NemotronHForCausalLM, tf.NemotronHConfig(
        **LLM, num_key_value_heads=2, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8, chunk_size=8,
        n_groups=1, layers_block_type=["mamba", "attention"])), "skipped"),
    "lfm2": (lambda: (tf.Lfm2ForCausalLM, tf.Lfm2Config(
        **LLM, num_key_value_heads=2, layer_types=["conv", "full_attention"])), "skipped"),
    "falcon_h1": (lambda: (tf.FalconH1ForCausalLM, tf.FalconH1Config(
        **LLM, num_key_value_heads=2, mamba_d_state=8, mamba_d_head=8, mamba_n_heads=8, mamba_chunk_size=8,
        mamba_d_ssm=64, mamba_rms_norm=True)), "skipped"),
    "qwen3_next": (lambda: (tf.Qwen3NextForCausalLM, tf.Qwen3NextConfig(
        **LLM, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[0, 1],
        layer_types=["linear_attention", "full_attention"])), "skipped"),
    "recurrent_gemma": (lambda: (tf.RecurrentGemmaForCausalLM, tf.RecurrentGemmaConfig(
        **SSM_LLM, num_attention_heads=4, num_key_value_heads=1, intermediate_size=64, lru_width=32,
        attention_window_size=8, block_types=["recurrent", "attention"])), "skipped"),
}


@contextlib.contextmanager
def float64_casts() -> Iterator[None]:
    """Run a float64 model without the float32 round trips HF code writes inside modules (RMS norms,
    gated norms, reference SSM scans, rotary tables: ``x.to(torch.float32)``, ``x.float()``): within,
    "float32" stands for float64, so an exactness check compares the math, not float32 rounding.

    What ``patch`` does to the working copy's forwards (:class:`normswap.analysis.precision.HoldCasts`): every
    cast to a lower-precision floating dtype, whatever form it takes (``.float()``, ``.to(torch.float32)``,
    ``.to(device, dtype=torch.float32)``, ``dtype=`` of a factory or softmax), gives float64 instead, so
    the two operands of one op cannot disagree (transformers computes rotary tables as a matmul, which
    does not promote, of ``inv_freq`` and ``position_ids.float()``)."""
    with precision.holding(torch.float64):
        yield


# Already RMS-style: fold_gamma folds their γ into the readers (effective γ becomes 1).
RMS = {
    "llama": lambda: (tf.LlamaForCausalLM, tf.LlamaConfig(**LLM, num_key_value_heads=2)),
    "mistral": lambda: (tf.MistralForCausalLM, tf.MistralConfig(**LLM, num_key_value_heads=2)),
    "qwen2": lambda: (tf.Qwen2ForCausalLM, tf.Qwen2Config(**LLM, num_key_value_heads=2)),
    "gemma": lambda: (tf.GemmaForCausalLM, tf.GemmaConfig(**LLM, num_key_value_heads=2, head_dim=8)),
    "t5": lambda: (tf.T5ForConditionalGeneration, tf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                               vocab_size=99, decoder_start_token_id=0, **SPECIAL)),
}
