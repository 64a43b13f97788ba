"""Shared fixtures for the recipe tests: small models trained here on a synthetic grammar (offline).

Training and distillation run with one torch thread: on a shared 2-core machine two threads
spin-wait on each other and tiny models get ~50x slower, while one thread is never slower here.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

from normswap.recipes import toy


@contextlib.contextmanager
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="session")
def recipe_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("recipes")


def built_once(tmp_path_factory, name: str, build) -> Path:
    """``build(directory)`` run once for the whole test run, whichever xdist worker asks first: the others
    wait for it and read the same directory. Under ``--dist loadfile`` the files that use a trained model
    land on both workers, so a session fixture alone trained it once per worker (tiny_bert: 3 files).

    The directory is in the run's own temporary root (``pytest-N``, the workers' common parent), never in
    one shared between runs; without xdist it is this process's basetemp."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    out = base / "recipe-models" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        done = out.parent / f"{name}.done"
        if not done.exists():
            with one_thread():  # session fixtures are built before the module-scoped autouse one
                built = Path(build(out))
            assert built == out, (built, out)
            done.write_text("ok")
    return out


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    """A 2-layer Post-LN BertForMaskedLM (hidden 64) trained with MLM on the grammar (~5 s), once a run."""
    return built_once(tmp_path_factory, "bert", lambda d: toy.train_tiny_bert(d, hidden=64, layers=2, steps=300,
                                                                               bert_like_norms=2.0))


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "gpt2", lambda d: toy.train_tiny_causal_lm(d, hidden=32, layers=2, steps=80))


@pytest.fixture(scope="session")
def tiny_opt_post_ln(recipe_dir) -> Path:
    """A 2-layer Post-LN OPTForCausalLM (hidden 64, OPT-350m's layout) trained on the grammar (~10 s)."""
    with one_thread():
        return toy.train_tiny_causal_lm(recipe_dir / "opt", arch="opt-post-ln", hidden=64, layers=2, steps=300,
                                        bert_like_norms=2.0)


@pytest.fixture(scope="session")
def corpus(recipe_dir) -> Path:
    """Held-in text from the same grammar, different seed from the pretraining corpus."""
    return toy.write_corpus(recipe_dir / "corpus.txt", 1500, seed=5)


@pytest.fixture(scope="session")
def make_config():
    """``make_config(source, corpus, out, task=..., train={...})``: a small, fast recipe dict."""
    return base_config


def base_config(source: Path, corpus: Path, out: Path, task: str = "masked-lm", **sections) -> dict:
    """A small, fast recipe dict; ``sections`` override whole keys (``train={"steps": 4}``)."""
    cfg = {
        "task": task,
        "model": {"source": str(source)},
        "data": {
            "path": str(corpus),
            "seq_len": 32,
            "batch_size": 16,
            "eval_batch_size": 32,
            "eval_fraction": 0.05,
        },
        "train": {"steps": 150, "lr": 3e-4, "warmup_steps": 10},
        "eval": {"every": 50},
        "log": {"every": 10, "progress_bar": False, "plot": False},
        "checkpoint": {"every": 1000},
        "output": {"dir": str(out)},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg
