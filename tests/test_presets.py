"""Built-in offline presets: deterministic, non-trivial norms, usable tokenizers, normal HF directories."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from normswap import presets
from normswap.errors import NormswapError

REQUIRED = {"tiny-gpt2", "tiny-opt", "tiny-bloom", "tiny-phi", "tiny-vit", "tiny-bert", "tiny-whisper"}


def test_required_presets_exist():
    assert REQUIRED <= set(presets.names())
    with pytest.raises(NormswapError, match="unknown preset"):
        presets.get("tiny-gpt3")


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_preset_is_seeded_and_non_trivial(name):
    a = presets.build_model(name)
    b = presets.build_model(name)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb), ka
    norms = [m for m in a.modules() if isinstance(m, nn.LayerNorm)]
    assert norms, "presets must contain LayerNorms to convert"
    for m in norms:  # default init (γ=1, β=0) would hide folding bugs
        assert not torch.allclose(m.weight, torch.ones_like(m.weight))
        assert not torch.allclose(m.bias, torch.zeros_like(m.bias))
    assert not a.training
    with torch.no_grad():
        out = a(**presets.example_inputs(name))
    logits = out.logits if hasattr(out, "logits") else out[0]
    assert torch.isfinite(logits).all()


def test_tokenizer_round_trip_and_vocab_matches_model():
    tok = presets.tokenizer("tiny-gpt2")
    ids = tok("The quick brown fox").input_ids
    assert tok.decode(ids) == "The quick brown fox"
    assert tok("unseen wordz ünïcode").input_ids  # byte-level BPE: no unknown tokens
    model = presets.build_model("tiny-gpt2")
    assert model.config.vocab_size == len(tok)
    bert_tok = presets.tokenizer("tiny-bert")
    enc = bert_tok("hello [MASK] world")
    assert enc.input_ids[0] == bert_tok.cls_token_id and enc.input_ids[-1] == bert_tok.sep_token_id
    assert bert_tok.mask_token_id in enc.input_ids
    assert presets.tokenizer("tiny-vit") is None


def test_generate_works_on_a_text_preset():
    model, tok = presets.build("tiny-gpt2")
    enc = tok("The quick", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, enc.input_ids.shape[1] + 4)


def test_save_writes_a_normal_hf_directory(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = presets.save("tiny-gpt2", tmp_path / "g")
    assert (d / "config.json").is_file() and (d / "model.safetensors").is_file()
    assert (d / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(d)
    ref = presets.build_model("tiny-gpt2")
    x = presets.example_inputs("tiny-gpt2")
    with torch.no_grad():
        assert torch.equal(model(**x).logits, ref(**x).logits)
    assert (
        AutoTokenizer.from_pretrained(d)("hello").input_ids
        == presets.tokenizer("tiny-gpt2")("hello").input_ids
    )


def test_save_vision_and_audio_presets_include_processors(tmp_path):
    vit = presets.save("tiny-vit", tmp_path / "v")
    assert (vit / "preprocessor_config.json").is_file()
    whisper = presets.save("tiny-whisper", tmp_path / "w")
    assert (whisper / "preprocessor_config.json").is_file() and (whisper / "tokenizer.json").is_file()
    feats = presets.example_inputs("tiny-whisper")["input_features"]
    assert feats.shape[-1] == 2 * presets.build_model("tiny-whisper").config.max_source_positions
