"""A checkpoint whose config names no architecture is built as the class that holds its tensors."""

import json

import torch
import transformers as tf
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from normswap.checkpoint import source
from normswap.cli import main


def _whisper_dir(tmp_path):
    config = tf.WhisperConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                              decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=64,
                              pad_token_id=1, bos_token_id=2, eos_token_id=2, decoder_start_token_id=3,
                              num_mel_bins=8, max_source_positions=16, max_target_positions=16)
    torch.manual_seed(0)
    path = tmp_path / "whisper"
    tf.WhisperForConditionalGeneration(config).save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("architectures")
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_a_config_without_architectures_loads_as_the_class_that_holds_every_tensor(tmp_path):
    path = _whisper_dir(tmp_path)
    src = source.resolve(str(path))
    config = tf.AutoConfig.from_pretrained(path)
    # the first fallback task (causal LM) has no place for the encoder's tensors
    assert source.model_class(config) is tf.WhisperForCausalLM
    assert source.source_class(src, config, None) is tf.WhisperForConditionalGeneration

    res = CliRunner().invoke(main, ["convert", str(path), "--out", str(tmp_path / "out"), "--quiet"])
    assert res.exit_code == 0, res.output
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["NormswapWhisperForConditionalGeneration"]


def test_tensors_no_fallback_class_holds_keep_the_clear_error(tmp_path):
    path = _whisper_dir(tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.encoder.extra_projection.weight"] = torch.zeros(4, 4)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = tf.AutoConfig.from_pretrained(path)
    assert source.source_class(source.resolve(str(path)), config, None) is tf.WhisperForCausalLM

    res = CliRunner().invoke(main, ["convert", str(path), "--out", str(tmp_path / "out")])
    assert res.exit_code != 0
    assert "does not use" in res.output and "--task" in res.output
    assert not (tmp_path / "out").exists()
