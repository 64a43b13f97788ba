"""The Whisper online-Hadamard speed benchmark's graphs (``benchmarks/whisper_online_speed.py``), no timing.

What can be wrong without anything crashing: a "cached step" that recomputes the cross-attention keys and values
(timing a different graph than a greedy decoder step runs), or one that reads the cache at the wrong position,
and an online variant whose step drops the ops.
"""

from __future__ import annotations

import copy
import warnings

import torch

from tests import benchmark_modules

speed = benchmark_modules.load("whisper_online_speed")


def _full_last_logits(model: torch.nn.Module, feats: torch.Tensor, past: int) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (feats.shape[0], past + 1),
                        generator=torch.Generator().manual_seed(0))  # step_inputs' tokens
    with torch.no_grad():
        return model(input_features=feats, decoder_input_ids=ids, use_cache=False).logits[:, -1:]


def test_the_cached_step_is_the_uncached_forwards_last_position_and_reads_no_encoder_output():
    import normswap

    original = benchmark_modules.tiny_whisper().double()
    online = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(online, beta_placement="keep")
        normswap.rotate(online, "none", online=True)
    feats = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = _full_last_logits(original, feats, past=5)
    for model in (original, online):
        inputs = speed.step_inputs(model, feats, past=5)
        assert inputs[0].shape == (2, 1) and len(inputs) == 1 + 4 * 2
        assert inputs[3].shape[2] == 16  # the cross-attention cache holds every encoder position
        with torch.no_grad():
            got = speed.Step(model)(*inputs)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    # the step takes the cross-attention keys and values from the cache: other values give other logits
    inputs = speed.step_inputs(original, feats, past=5)
    moved = list(inputs)
    moved[4] = 2 * moved[4]  # the first layer's cross-attention values
    with torch.no_grad():
        assert not torch.allclose(speed.Step(original)(*moved), want)


def test_the_eager_step_leaves_its_inputs_as_they_were():
    """The eager engine calls the same step on the same inputs again and again: a step that grew or overwrote the
    cache it is given would time ever longer caches, and its second call would differ from its first."""
    model = benchmark_modules.tiny_whisper().double()
    feats = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    inputs = speed.step_inputs(model, feats, past=5)
    before = [t.clone() for t in inputs]
    step = speed.Step(model)
    with torch.inference_mode():
        first, second = step(*inputs), step(*inputs)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(inputs, before, strict=True))


def test_the_thread_clock_counts_this_threads_work_and_not_a_wait():
    """``--clock thread`` (round 60): time a timing takes on this thread's CPU; a sleep (the core given to another
    job on a loaded machine) adds wall time and not thread time."""
    import time

    wall, thread = speed.CLOCKS["wall"], speed.CLOCKS["thread"]
    t0w, t0t = wall(), thread()
    time.sleep(0.2)
    assert wall() - t0w >= 0.2 and thread() - t0t < 0.05
    t0t = thread()
    x = torch.randn(256, 256)
    for _ in range(50):
        x = torch.tanh(x @ x)
    assert thread() - t0t > 0
