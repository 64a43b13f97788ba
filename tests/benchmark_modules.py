"""Load a benchmark script (``benchmarks/<name>.py``) as a module for the tests of its pieces: the
benchmarks folder is not a package, and a script's dataclasses look their module up in ``sys.modules``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, executed once per test session and registered under ``name``."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def tiny_dinov2(seed: int = 0, heads: int = 2) -> torch.nn.Module:
    """A 2-layer DINOv2-shaped model (hidden 32, ``heads`` heads) in float64, eval mode, LayerNorm γ/β and
    LayerScale λ randomised: the replica the quantization benchmarks' pieces are tested on."""
    import transformers as tf

    cfg = tf.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=heads, intermediate_size=64,
                          image_size=56, patch_size=14, layerscale_value=1.0)
    torch.manual_seed(seed)
    model = tf.Dinov2Model(cfg).eval().double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((1 + 0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype)) if name.endswith("weight")
                        else 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif "lambda" in name:
                p.copy_(torch.exp(torch.randn(p.shape, generator=g, dtype=p.dtype) - 2))
    return model


def tiny_bert(seed: int = 0) -> torch.nn.Module:
    """A 2-layer Post-LN BERT (hidden 32, 2 heads, FFN 64), eval mode, float32, LayerNorm γ ~ U(0.5, 2) and
    β ~ N(0, 0.5): the sentence encoders' replica (MiniLM, MPNet) for the online-op tests."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=32)
    model = tf.BertModel(config).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 2.0)
                m.bias.normal_(0, 0.5)
    return model


def tiny_whisper() -> torch.nn.Module:
    """A 2 + 2-layer Whisper (width 64, 4 heads of 16: ``out_proj`` has two blocks of 32; FFN 128), eval mode,
    float32, LayerNorm γ/β randomised (β std 0.3): the replica the Whisper benchmarks' pieces are tested on."""
    import transformers as tf

    from tests.custom_models import randomise_layer_norms

    config = tf.WhisperConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=99,
                              num_mel_bins=8, max_source_positions=16, max_target_positions=32,
                              decoder_start_token_id=0, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = tf.WhisperForConditionalGeneration(config).eval()
    randomise_layer_norms(model, beta_std=0.3)
    return model
