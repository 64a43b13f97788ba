"""The transformers sweep's pieces (``benchmarks/sweep_transformers.py``): which types it finds, that a
shrunk config stays consistent (special token ids inside the vocabulary), one class swept end to end, and
how rows are counted (a refusal for want of runnable inputs is told apart from a crash)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import transformers as tf

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "sweep_transformers.py"


def _sweep():
    spec = importlib.util.spec_from_file_location("sweep_transformers", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    assert row["counts"]["exact"] > 0
    assert all(isinstance(e, float) and e <= 1e-9 for e in row["err"]), row["err"]
    no_run = {"build": "ok", "patch": "refused: could not run X.forward on the example inputs (...)"}
    crash = {"build": "ok", "patch": "crash: TypeError: ..."}
    totals = sweep.totals([{"type": "a", "classes": [row, no_run]}, {"type": "b", "classes": [crash]}])
    assert (totals["classes_converted"], totals["classes_no_run"], totals["classes_crashed"]) == (1, 1, 1)
    assert totals["types_converted"] == 0
