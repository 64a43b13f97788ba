"""The low-memory (streamed) conversion holds an exact conversion to what the precision explains for the model,
as the in-memory path does (issue 38, after issue 39 §5): the truncated models' tolerance is
``precision_limit`` of the original's own error in the checkpoint's dtype, stated with its derivation, not a
flat 2e-3. A genuine streamed conversion passes; the same with one weight of a verified layer scaled by 1.01
fails, and nothing is written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers as tf

import normswap
from normswap.checkpoint import stream_io
from normswap.errors import VerificationFailed
from normswap.surgery.verify import exact_limit, precision_limit
from tests.custom_models import randomise_layer_norms

SPECIAL = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


@pytest.fixture(scope="module")
def gpt2_6(tmp_path_factory) -> Path:
    """A 6-layer GPT-2 (deeper than the 3/4-layer proxies: the truncated check runs layers 0, 1 and 5)."""
    root = tmp_path_factory.mktemp("gpt2-6")
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=6, n_embd=32, n_head=4, vocab_size=99, n_positions=64,
                                             **SPECIAL)).eval()
    with torch.no_grad():  # LayerNorm γ/β randomised: a conversion that ignored them would show
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.2)
    model.save_pretrained(root / "src")
    return root / "src"


def _tamper_streamed(monkeypatch: pytest.MonkeyPatch, name: str, factor: float = 1.01) -> None:
    """Scale the tensor ``name`` by ``factor`` as the streaming writer produces it."""
    write = stream_io.write_shards

    def write_tampered(layout, out, max_shard_size, progress, **kwargs):  # noqa: ANN001, ANN003, ANN202
        assert any(entry[0] == name for entry in layout), name
        layout = [(k, dt, shape, (lambda p=produce: p() * factor) if k == name else produce)
                  for k, dt, shape, produce in layout]
        return write(layout, out, max_shard_size, progress, **kwargs)

    monkeypatch.setattr(stream_io, "write_shards", write_tampered)


def test_a_genuine_streamed_conversion_passes_under_the_derived_tolerance(gpt2_6, tmp_path):
    report = normswap.convert(gpt2_6, tmp_path / "out", low_memory=True)
    ver = report.verification
    assert report.streamed and ver["verify_dtype"] == "float64"
    own = ver["own_rounding_error"]
    assert 0 < own < 1e-5
    assert ver["verify_tolerance"] == precision_limit(torch.float32, own) < 1e-4 < exact_limit(torch.float32)
    assert ver["truncated_max_rel_error"] <= ver["verify_tolerance"]
    assert "16 x the original's own float32 error" in ver["verify_precision"]
    assert "against its float64 run, on the same layers and inputs" in ver["verify_precision"]


@pytest.mark.parametrize("name", ["transformer.h.0.mlp.c_proj.weight", "transformer.h.1.attn.c_attn.weight",
                                  "transformer.h.5.mlp.c_fc.weight"])
def test_one_weight_times_1_01_in_a_verified_layer_fails_and_nothing_is_written(gpt2_6, tmp_path, monkeypatch,
                                                                                  name):
    _tamper_streamed(monkeypatch, name)
    with pytest.raises(VerificationFailed, match=r"the streamed checkpoint's layers .* differ from the original by "
                                                 r".*16 x the original's own float32 error.*nothing was written") as e:
        normswap.convert(gpt2_6, tmp_path / "out", low_memory=True)
    assert list(tmp_path.iterdir()) == []
    error = float(re.search(r"differ from the original by ([0-9.e+-]+) ", str(e.value)).group(1))
    assert error < exact_limit(torch.float32)  # what the flat 2e-3 let through


def test_the_cli_states_the_derivation(gpt2_6, tmp_path):
    from click.testing import CliRunner

    from normswap.cli import main

    res = CliRunner().invoke(main, ["convert", str(gpt2_6), "--out", str(tmp_path / "out"), "--low-memory"])
    assert res.exit_code == 0, res.output
    assert "(= min(0.002, max(16 x the original's own float32 error" in res.stdout


def test_a_model_drawing_random_numbers_gets_an_estimated_yardstick(tmp_path):
    """ViT-MAE's random masking draws other numbers in float32 than in float64 under the same seed: a measured
    float32-vs-float64 error would be the two masks' difference, and the tolerance the flat ceiling."""
    cfg = tf.ViTMAEConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          image_size=32, patch_size=8, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                          decoder_num_attention_heads=2, decoder_intermediate_size=64)
    torch.manual_seed(0)
    model = tf.ViTMAEModel(cfg).eval()
    randomise_layer_norms(model, beta_std=0.2)
    model.save_pretrained(tmp_path / "src")
    ver = normswap.convert(tmp_path / "src", tmp_path / "out", low_memory=True).verification
    assert "(the model draws random numbers, which differ in another dtype)" in ver["verify_precision"]
    assert ver["truncated_max_rel_error"] <= ver["verify_tolerance"] < 1e-4
