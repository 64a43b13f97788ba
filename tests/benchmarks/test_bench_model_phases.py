"""``benchmarks/bench_model.py``'s prefill and compiled-decode phases (which the GPU acceptance run
times on CUDA), run on CPU on a tiny model: the compiled decode really compiles, and both produce
what the eager model does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_model.py"
_spec = importlib.util.spec_from_file_location("bench_model", _PATH)
bench_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_model)


@pytest.fixture(scope="module")
def models():
    original = bench_model.build_model("gpt2-tiny")
    converted, summary = bench_model.convert(original)
    # exact everywhere; the tied input embedding is centered by one op, so every norm reads "with centering"
    assert set(summary["verdicts"]) <= {"exact", "exact-with-centering"} and sum(summary["verdicts"].values()) == 5
    assert summary["module_backend"]
    return original, converted


def test_compiled_decode_compiles_and_matches_eager_decode_on_the_converted_model(models):
    import torch._dynamo

    converted = models[1]
    eager = bench_model.decode_fn(converted, "cpu", torch.float32, 4)()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = bench_model.decode_fn(converted, "cpu", torch.float32, 4, compiled=True, compile_backend="eager")()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # generate did compile the forward
    assert torch.equal(compiled, eager) and compiled.shape == (1, 8 + 4)
    torch._dynamo.reset()


def test_prefill_returns_the_last_positions_logits_and_conversion_keeps_them(models):
    original, converted = models
    a = bench_model.prefill_fn(original, "cpu", torch.float32, 16)()
    b = bench_model.prefill_fn(converted, "cpu", torch.float32, 16)()
    assert a.shape == b.shape == (1, 1, bench_model.VOCAB)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)  # GPT-2 converts exactly
