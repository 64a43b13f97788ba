"""The automatic switch to the streaming path uses the in-memory path's real peak: the model, a
working copy (float64 for small models, float32 for half-precision ones), the reloaded checkpoint
and the activations. Memory is limited by patching the available-memory probe."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf

import normswap
from normswap import memory, pipeline
from normswap.checkpoint import conversion, proxy
from normswap.checkpoint import source as source_mod


@pytest.fixture(scope="module")
def half_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = tf.GPT2LMHeadModel(cfg).eval().to(torch.float16)
    out = tmp_path_factory.mktemp("ckpt") / "gpt2-fp16"
    model.save_pretrained(out)
    return out


def test_predicted_peak_counts_the_working_copy_in_its_dtype():
    gib = 1 << 30
    small, big = 50_000_000, 2_600_000_000
    # a float64 working copy beside the model, whatever its size (the precision's choice asks for it)
    assert memory.in_memory_peak(small, 4, 8) == small * 4 + small * 8 + memory.ACTIVATION_BYTES
    assert memory.in_memory_peak(big, 2, 8) == big * 2 + big * 8 + memory.ACTIVATION_BYTES
    # the cheapest copy (the switch's prediction): a big half model gets a float32 working copy (2x the
    # checkpoint), or its float32 run; the reloaded checkpoint replaces the freed model, it is not held beside it
    assert memory.in_memory_peak(big, 2) == big * 2 + big * 4 + memory.ACTIVATION_BYTES
    # a float32 model: the written tensors beside it
    assert memory.in_memory_peak(big, 4) <= 1.5 * big * 4 + gib
    assert memory.in_memory_peak(small, 4) == small * 4 + small * 2 + memory.ACTIVATION_BYTES
    # the bound the task sets for the cheapest copy: 2 x the model in its compute dtype (float32 here) + 1 GiB
    for n, size in ((big, 2), (big, 4), (small, 2), (small, 4)):
        assert memory.in_memory_peak(n, size) <= 2 * n * max(size, 4) + 2 * gib


def test_the_switch_streams_when_the_predicted_peak_does_not_fit(half_checkpoint, tmp_path, monkeypatch):
    src = source_mod.resolve(str(half_checkpoint))
    numel = src.nbytes // 2
    peak = memory.in_memory_peak(numel, 2)
    assert peak > 2 * src.nbytes  # the old rule (half the RAM) would have let this peak through
    monkeypatch.setattr(proxy, "available_memory", lambda: 8 << 30)  # the small proxies fit
    # just too little memory for the in-memory path: streamed, with a note that says why
    monkeypatch.setattr(conversion, "available_memory", lambda: int(peak / memory.PEAK_SHARE) - 1)
    notes: list[str] = []
    report = normswap.convert(half_checkpoint, tmp_path / "s", echo=notes.append)
    assert report.streamed and any("--low-memory" in n and "available RAM" in n for n in notes), notes
    # just enough: in memory
    monkeypatch.setattr(conversion, "available_memory", lambda: int(peak / memory.PEAK_SHARE) + 1)
    notes.clear()
    report = normswap.convert(half_checkpoint, tmp_path / "m", echo=notes.append)
    assert not report.streamed and not any("--low-memory" in n for n in notes)
    # the old rule's case: a checkpoint of 45% of RAM went in memory and needed ~3x that
    monkeypatch.setattr(conversion, "available_memory", lambda: int(src.nbytes / 0.45))
    assert conversion.wants_low_memory(src, "auto")


def test_a_half_model_is_worked_on_in_float32_and_measured_in_its_own_dtype(monkeypatch):
    """Where a float64 copy does not fit but a float32 one does, a float16 model's analysis, calibration
    and verification run in float32 (fast on a CPU); the cast back is measured against the original in
    float16."""
    torch.manual_seed(0)
    cfg = tf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        vocab_size=99, max_position_embeddings=64)
    model = tf.BertForMaskedLM(cfg).eval().to(torch.float16)
    numel = sum(p.numel() for p in model.parameters())
    # just enough memory for the float32 copy's predicted peak: not for a float64 one
    room = math.ceil(memory.in_memory_peak(numel, 2, 4) / memory.PEAK_SHARE) - numel * 2
    monkeypatch.setattr(memory, "available_memory", lambda: room)
    assert pipeline.working_precision(model).dtype == torch.float32
    seen: list[torch.dtype] = []
    original_forward = tf.BertModel.forward

    def spy(self, *a, **k):  # noqa: ANN001, ANN002, ANN003
        seen.append(self.embeddings.word_embeddings.weight.dtype)
        return original_forward(self, *a, **k)

    monkeypatch.setattr(tf.BertModel, "forward", spy)
    report = normswap.patch(model, mode="all", allow_unusable=True)
    assert report.changed and model.bert.embeddings.word_embeddings.weight.dtype == torch.float16
    assert seen.count(torch.float32) > seen.count(torch.float16) >= 1  # float16 only to measure the cast
    assert math.isfinite(report.verification["dtype_error_ratio"])
    assert report.verification["in_model_dtype"] is not None and report.verification["original_in_model_dtype"] > 0


def test_the_converted_model_is_freed_before_the_reload_check(half_checkpoint, tmp_path, monkeypatch):
    """The reloaded checkpoint (and a half model's float32 run of it) takes the converted model's
    place: holding both was the 0.8B float16 peak's excess over 2 x model + 1 GB."""
    import gc
    import weakref

    refs: list[weakref.ref] = []
    load = source_mod.load_model

    def spy_load(*a, **k):  # noqa: ANN002, ANN003
        model, proc = load(*a, **k)
        refs.append(weakref.ref(model))
        return model, proc

    alive: list[bool] = []
    check = conversion.reload_check

    def spy_check(*a, **k):  # noqa: ANN002, ANN003
        gc.collect()
        alive.append(refs[0]() is not None)
        return check(*a, **k)

    monkeypatch.setattr(source_mod, "load_model", spy_load)
    monkeypatch.setattr(conversion, "reload_check", spy_check)
    report = normswap.convert(half_checkpoint, tmp_path / "o", low_memory=False)
    assert not report.streamed and alive == [False]
    assert report.verification["reload_bitwise_equal"] is True
