"""Built-in offline presets: tiny named models with seeded weights, for quickstarts and tests.

``normswap convert tiny-gpt2 --out ./tiny-gpt2-rms`` works on a fresh machine with no network:
the model is built from a config, its weights are seeded (LayerNorm γ/β and biases randomised so
the conversion is non-trivial: default γ=1, β=0 would hide folding mistakes), and text presets
come with a small byte-level BPE tokenizer trained on a built-in paragraph, so ``generate()`` and
``pipeline()`` work on the converted output. Vision and audio presets come with an image
processor / feature extractor sized for them.

>>> from normswap import presets
>>> presets.names()                                      # doctest: +SKIP
['tiny-bert', 'tiny-bloom', 'tiny-gpt2', 'tiny-opt', 'tiny-phi', 'tiny-vit', 'tiny-whisper']
>>> model, processor = presets.build("tiny-gpt2")        # doctest: +SKIP
>>> presets.save("tiny-gpt2", "/tmp/tiny-gpt2")          # a normal HF directory  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.integrations.quiet import quietly

CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.
A layer norm subtracts the mean and divides by the standard deviation of its input.
An RMS norm only divides by the root mean square, which is cheaper and just as stable.
When every writer of the residual stream is centered, the mean is already zero.
Then the two norms compute the same thing, and the swap is exact to the last bit that matters.
Small models are useful for tests: they build in a moment and never need the network.
The river runs to the sea, the sea rises to the clouds, and the clouds rain on the hills.
Numbers like one, two, three, four, five, six, seven, eight, nine and ten appear here too.
Hello world! How are you today? I am fine, thank you, and the weather is nice.
Models read tokens, tokens become vectors, vectors flow through layers, and layers predict words.
"""

SEED = 1234
GPT_SPECIALS = ["<|endoftext|>"]
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WHISPER_SPECIALS = ["<|pad|>", "<|startoftranscript|>", "<|endoftext|>"]


@dataclass(frozen=True)
class Preset:
    """One named tiny model."""

    name: str
    description: str
    model_class: str  # transformers class name
    config: Callable[[int], Any]  # vocab size -> config
    modality: str  # text | image | audio
    specials: tuple[str, ...] = tuple(GPT_SPECIALS)
    vocab_size: int = 320


def _tf() -> Any:
    import transformers

    return transformers


# Shared sizes: two layers of width 64 and four heads keep every preset's conversion under a second.
_LAYERS = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
_ONE_SPECIAL = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}  # <|endoftext|> is token 0


def _config(class_name: str, *, no_vocab: bool = False, **fields: Any) -> Callable[[int], Any]:
    """A ``vocab size -> config`` builder for a transformers config class (``vocab_size`` filled in
    unless the preset has no vocabulary, as an image classifier does)."""

    def make(vocab: int) -> Any:
        return getattr(_tf(), class_name)(**fields, **({} if no_vocab else {"vocab_size": vocab}))

    make.__name__ = f"{class_name}_builder"
    return make


_LABELS = ["cat", "dog", "fox", "bird", "fish"]
_gpt2 = _config("GPT2Config", n_layer=2, n_embd=64, n_head=4, n_positions=128, **_ONE_SPECIAL)
_opt = _config("OPTConfig", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
               word_embed_proj_dim=64, max_position_embeddings=128, **_ONE_SPECIAL)
_bloom = _config("BloomConfig", hidden_size=64, n_layer=2, n_head=4, **_ONE_SPECIAL)
_phi = _config("PhiConfig", **_LAYERS, max_position_embeddings=128, **_ONE_SPECIAL)
_bert = _config("BertConfig", **_LAYERS, max_position_embeddings=128, pad_token_id=0)
_vit = _config("ViTConfig", **_LAYERS, image_size=32, patch_size=8, num_labels=len(_LABELS),
               id2label=dict(enumerate(_LABELS)), label2id={k: i for i, k in enumerate(_LABELS)}, no_vocab=True)
# 16 encoder positions = 32 mel frames: the preset's feature extractor makes 1 s of 16 kHz audio into
# exactly that (hop 500), which keeps conversions fast.
_whisper = _config(
    "WhisperConfig", d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=8,
    max_source_positions=16, max_target_positions=64, pad_token_id=0, decoder_start_token_id=1,
    bos_token_id=1, eos_token_id=2, begin_suppress_tokens=None, suppress_tokens=None,
)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny-gpt2", "GPT-2 (Pre-LN, tied head): exact", "GPT2LMHeadModel", _gpt2, "text"),
        Preset("tiny-opt", "OPT (Pre-LN): exact", "OPTForCausalLM", _opt, "text"),
        Preset(
            "tiny-bloom",
            "BLOOM (embedding LayerNorm): exact with one centering op",
            "BloomForCausalLM",
            _bloom,
            "text",
        ),
        Preset("tiny-phi", "Phi (parallel attention/MLP): exact", "PhiForCausalLM", _phi, "text"),
        Preset(
            "tiny-bert",
            "BERT masked LM (Post-LN): approximate, use --mode all",
            "BertForMaskedLM",
            _bert,
            "text",
            tuple(BERT_SPECIALS),
        ),
        Preset(
            "tiny-vit",
            "ViT image classifier (Pre-LN): exact with one centering op",
            "ViTForImageClassification",
            _vit,
            "image",
        ),
        Preset(
            "tiny-whisper",
            "Whisper speech-to-text (encoder needs a centering op): exact",
            "WhisperForConditionalGeneration",
            _whisper,
            "audio",
            tuple(WHISPER_SPECIALS),
        ),
    )
}


def names() -> list[str]:
    """Preset names, sorted."""
    return sorted(PRESETS)


def get(name: str) -> Preset:
    if name not in PRESETS:
        raise NormswapError(f"unknown preset {name!r}; presets: {', '.join(names())}")
    return PRESETS[name]


def is_preset(name: str) -> bool:
    """True for a preset name that is not shadowed by a local directory of the same name."""
    return name in PRESETS and not Path(name).exists()


# ------------------------------------------------------------------------------------ tokenizers
@functools.cache
def _tokenizer_json(specials: tuple[str, ...], vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    if specials == tuple(BERT_SPECIALS):
        from tokenizers import processors

        tok.post_processor = processors.BertProcessing(
            ("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]"))
        )
    return tok.to_str()


def tokenizer(name: str) -> Any:
    """A fresh ``PreTrainedTokenizerFast`` for a text/audio preset (``None`` for image presets)."""
    preset = get(name)
    if preset.modality == "image":
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_tokenizer_json(preset.specials, preset.vocab_size))
    fast = _tf().PreTrainedTokenizerFast
    if preset.specials == tuple(BERT_SPECIALS):
        return fast(
            tokenizer_object=tok,
            pad_token="[PAD]",
            unk_token="[UNK]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
            model_max_length=128,
        )
    if preset.specials == tuple(WHISPER_SPECIALS):
        return fast(
            tokenizer_object=tok,
            pad_token="<|pad|>",
            bos_token="<|startoftranscript|>",
            eos_token="<|endoftext|>",
            model_max_length=64,
        )
    return fast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        model_max_length=128,
    )


def processor(name: str) -> Any:
    """Tokenizer, image processor or feature extractor that goes with the preset."""
    preset = get(name)
    if preset.modality == "image":
        tf = _tf()
        # the PIL backend needs no torchvision (the default backend warns without it)
        cls = getattr(tf, "ViTImageProcessorPil", None) or tf.ViTImageProcessor
        return cls(size={"height": 32, "width": 32}, do_resize=True)
    if preset.modality == "audio":
        return _tf().WhisperFeatureExtractor(
            feature_size=8, sampling_rate=16000, hop_length=500, chunk_length=1, n_fft=512
        )
    return tokenizer(name)


# ------------------------------------------------------------------------------------ models
def randomise_norms(model: nn.Module, seed: int = SEED, scale: float = 0.3) -> nn.Module:
    """Random LayerNorm γ (around 1) and β, and random biases, from a fixed seed.

    Default initialisation (γ=1, β=0, bias=0) makes folding a no-op, so a broken fold would pass
    every test. Works on any module; only 1-d parameters named like norms or ``bias`` are touched.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            low = name.lower()
            if p.dim() == 1 and ("norm" in low or ".ln" in low or low.startswith("ln") or leaf == "bias"):
                base = 1.0 if leaf in ("weight", "gamma", "scale") else 0.0
                p.copy_(base + scale * torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype))
    return model


def build_model(name: str, *, seed: int = SEED, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The preset's model with seeded weights, in eval mode."""
    preset = get(name)
    cls = getattr(_tf(), preset.model_class)
    vocab = len(tokenizer(name)) if preset.modality != "image" else 0
    config = preset.config(vocab)
    config.name_or_path = name
    previous = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = cls(config)
    finally:
        torch.random.set_rng_state(previous)
    randomise_norms(model, seed)
    if (
        preset.modality == "text"
        and hasattr(model, "generation_config")
        and model.generation_config is not None
    ):
        model.generation_config.pad_token_id = config.pad_token_id
    return model.to(dtype).eval()


def build(name: str, *, seed: int = SEED, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any]:
    """``(model, processor)`` for a preset (processor: tokenizer / image processor / feature extractor)."""
    return build_model(name, seed=seed, dtype=dtype), processor(name)


@quietly
def save(
    name: str,
    out_dir: str | os.PathLike,
    *,
    seed: int = SEED,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write the preset as a normal Hugging Face model directory (config, safetensors, tokenizer...)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, proc = build(name, seed=seed, dtype=dtype)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    if proc is not None:
        proc.save_pretrained(out)
    if get(name).modality == "audio":
        tokenizer(name).save_pretrained(out)
    return out


def example_inputs(name: str, batch: int = 2) -> dict[str, torch.Tensor]:
    """Real preprocessed inputs for the preset (text, a synthetic image, or a second of noise)."""
    preset = get(name)
    gen = torch.Generator().manual_seed(0)
    if preset.modality == "image":
        images = [(torch.rand(32, 32, 3, generator=gen) * 255).to(torch.uint8).numpy() for _ in range(batch)]
        return dict(processor(name)(images=images, return_tensors="pt"))
    if preset.modality == "audio":
        audio = [torch.randn(16000, generator=gen).numpy() for _ in range(batch)]
        feats = processor(name)(audio, sampling_rate=16000, return_tensors="pt")
        return {
            "input_features": feats["input_features"],
            "decoder_input_ids": torch.tensor([[1, 5, 6, 7]] * batch),
        }
    lines = CORPUS.splitlines()[:batch]
    enc = tokenizer(name)(lines, return_tensors="pt", padding=True, truncation=True, max_length=24)
    return dict(enc)
