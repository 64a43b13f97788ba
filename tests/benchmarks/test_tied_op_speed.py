"""The tied-op speed benchmark's pieces (``benchmarks/bench_tied_op_speed.py``) on a tiny GPT-2: the three
variants it times are what they claim (tie kept with one op / untied / original, same logits), the module
wrapper it times against the hook gives the hooked embedding's values, and a timed decode step sees the same
cache every call. No real checkpoint, no timing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

pytest.importorskip("transformers")

import bench_tied_op_speed as bench  # noqa: E402


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return bench.build(layers=2, width=64, heads=4, dtype=torch.float64)


def test_variants_are_the_tied_default_with_one_op_the_untied_head_and_the_original(models):
    info = bench.describe(models)
    assert info["original"] == {**info["original"], "tied": True, "wte_forward_hooks": 0}
    assert info["default"]["tied"] and info["default"]["wte_forward_hooks"] == 1
    assert not info["untie"]["tied"] and info["untie"]["wte_forward_hooks"] == 0
    extra = models["untie"].lm_head.weight.numel()
    assert info["untie"]["parameters"] - info["default"]["parameters"] == extra
    assert info["control"]["max_abs_logit_diff"] == 0.0
    for name in ("default", "untie"):
        assert info[name]["max_abs_logit_diff"] < 1e-12


def test_the_wrapper_gives_the_hooked_embeddings_values_in_float64_with_randomised_norms(models):
    default = models["default"]
    hooked = default.transformer.wte
    wrapper = bench.CenteredEmbedding(torch.nn.Embedding(*hooked.weight.shape).double())
    with torch.no_grad():
        wrapper.embedding.weight.copy_(hooked.weight)
    ids = bench.ids_for(3, 7) % hooked.weight.shape[0]
    out = wrapper(ids)
    assert torch.equal(out, hooked(ids))
    assert out.mean(-1).abs().max() < 1e-15  # centered per token
    assert hooked.weight.mean(-1).abs().max() > 1e-3  # the table itself is not (the head shares it)
    # and the hooked embedding is what makes the tied default exact: without the hook the logits move
    original = models["original"]
    ids = bench.ids_for(2, 9) % hooked.weight.shape[0]
    with torch.inference_mode():
        ref = original(input_ids=ids, use_cache=False).logits
        got = default(input_ids=ids, use_cache=False).logits
        hook = next(iter(hooked._forward_hooks))
        saved = hooked._forward_hooks.pop(hook)
        try:
            unhooked = default(input_ids=ids, use_cache=False).logits
        finally:
            hooked._forward_hooks[hook] = saved
    scale = ref.abs().max()
    assert (got - ref).abs().max() / scale < 1e-12
    assert (unhooked - ref).abs().max() / scale > 1e-3


def test_a_timed_decode_step_sees_the_same_cache_every_call(models):
    model = models["default"]
    call = bench.decode_call(model, batch=2, past=5)
    first = call()
    for _ in range(3):
        again = call()
    assert first.shape == (2, 1, model.config.vocab_size)
    assert torch.equal(first, again)  # same cache length and contents: the step is cropped back
