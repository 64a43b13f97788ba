"""A model with custom modeling code (``auto_map``, ``trust_remote_code``) converts on both paths and they write the
same checkpoint (round 59; the sweep had no such model). Before: the in-memory compat conversion failed its reload
check (``normswap.load`` looked the custom class up in transformers), ``--low-memory`` could not read the config
(no ``trust_remote_code``), and the compat config kept only two of the source's ``auto_map`` entries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import normswap
from tests.checkpoint.test_streaming_combos import assert_same_output
from tests.remote_code_model import AUTO_MAP, save_remote_code_model


@pytest.fixture(scope="module")
def custom(tmp_path_factory) -> Path:
    return save_remote_code_model(tmp_path_factory.mktemp("remote") / "tinyln")


@pytest.mark.parametrize("options", [{}, {"fold_gamma": True, "max_shard_size": "16KB"}])
def test_custom_code_model_streams_as_it_converts_in_memory(custom, tmp_path, options):
    mem, stream = tmp_path / "mem", tmp_path / "stream"
    normswap.convert(custom, mem, format="compat", trust_remote_code=True, low_memory=False, **options)
    report = normswap.convert(custom, stream, format="compat", trust_remote_code=True, low_memory=True, **options)
    assert report.streamed
    assert_same_output(mem, stream)
    for out in (mem, stream):
        assert json.loads((out / "config.json").read_text())["auto_map"] == AUTO_MAP  # every entry kept
        assert (out / "modeling_tinyln.py").exists()
    if "max_shard_size" in options:
        assert (mem / "model.safetensors.index.json").read_bytes() == \
            (stream / "model.safetensors.index.json").read_bytes()
    # the written model computes the original's logits (stock LayerNorms, centered writers: exact)
    original = transformers.AutoModelForCausalLM.from_pretrained(custom, trust_remote_code=True).double().eval()
    converted = normswap.load(stream, trust_remote_code=True).double().eval()
    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = original(input_ids=ids).logits, converted(input_ids=ids).logits
    assert float((a - b).abs().max() / a.abs().max()) < 1e-6
    base = transformers.AutoModel.from_pretrained(stream, trust_remote_code=True)  # auto_map's AutoModel kept
    assert type(base).__name__ == "TinyLNModel"
