"""``--max-shard-size`` splits a streamed checkpoint as it splits the in-memory one (round 59): the same
``model.safetensors.index.json`` byte for byte, the same shard files (names, tensor sets, bytes). Before, the
streamed writer split in the checkpoint's tensor order, and a tensor over the limit opened the next shard; the
in-memory path (``save_pretrained``) splits in its save order, with such a tensor in a shard of its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf

import normswap
from normswap import presets
from normswap.checkpoint import stream_io

# GPT-2 (a tied head, untied by the conversion: a tensor the checkpoint lacks) and BERT (an encoder whose
# checkpoint order differs from its save order), 4 layers: deeper than the 3-layer proxy
MODELS = {
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=99, n_positions=64,
                                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "bert": lambda: tf.BertModel(tf.BertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                               intermediate_size=64, vocab_size=99, max_position_embeddings=64,
                                               pad_token_id=0)),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shards")
    out = {}
    for name, make in MODELS.items():
        torch.manual_seed(0)
        model = presets.randomise_norms(make()).eval()
        model.save_pretrained(root / name, max_shard_size="40KB")
        out[name] = root / name
    return out


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())
            if p.name.endswith(".safetensors") or p.name.endswith(".index.json")}


# 9KB: the 99x32 float32 embedding (12.7 KB) is over the limit and gets a shard of its own
@pytest.mark.parametrize("name, size, options", [
    ("gpt2", "9KB", {}),
    ("gpt2", "30KB", {"format": "compat", "fold_gamma": True}),
    ("bert", "9KB", {"mode": "exact"}),
    ("bert", "60KB", {"mode": "exact", "dtype": "bfloat16"}),
])
def test_streamed_shards_are_the_in_memory_shards(sources, tmp_path, name, size, options):
    mem, stream = tmp_path / "mem", tmp_path / "stream"
    normswap.convert(sources[name], mem, low_memory=False, max_shard_size=size, verify=False, **options)
    normswap.convert(sources[name], stream, low_memory=True, max_shard_size=size, verify=False, **options)
    a, b = _files(mem), _files(stream)
    assert "model.safetensors.index.json" in a  # the size splits these checkpoints
    assert a["model.safetensors.index.json"] == b["model.safetensors.index.json"]
    assert sorted(a) == sorted(b)
    different = [f for f in a if a[f] != b[f]]
    assert not different, different


def test_split_is_save_pretrained_s():
    """The split rule itself, against huggingface_hub's on the same sizes in the same order."""
    from huggingface_hub import split_torch_state_dict_into_shards

    sizes = [40, 8, 120, 32, 28, 100, 4, 64, 64, 200, 4]  # bytes of float32 tensors
    state = {f"t{i}": torch.zeros(n // 4) for i, n in enumerate(sizes)}
    for limit in (50, 64, 100, 128, 1000):
        want = split_torch_state_dict_into_shards(state, max_shard_size=limit).filename_to_tensors
        got = [[f"t{i}" for i in shard] for shard in stream_io.split_shards(sizes, limit)]
        assert got == list(want.values()), limit
