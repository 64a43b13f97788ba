"""The round-51 baseline of the online-op speed benchmarks (``dinov2_online_speed.r51_ops_``, the ``online-r51``
variants of ``dinov2_online_speed.py`` and ``whisper_online_speed.py``), no timing: a model whose ops capture round
51's stock form computes the same function in float64, and its captured graph multiplies by round 51's factors (the
whole ``H_{2^m}``, then the scale), not round 52's split, so the side-by-side compares the two forms."""

from __future__ import annotations

import copy
import warnings

import torch

import normswap
from normswap.inputs import hf_example_inputs
from tests import benchmark_modules
from tests.benchmark_modules import tiny_dinov2

speed = benchmark_modules.load("dinov2_online_speed")


def _traced_matrices(model: torch.nn.Module, x: torch.Tensor) -> tuple[set[tuple[int, ...]], torch.jit.ScriptModule]:
    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, px: torch.Tensor) -> torch.Tensor:
            return self.m(pixel_values=px).last_hidden_state

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(Hidden(), (x,), check_trace=False)
    consts = [n.output().toIValue() for n in traced.inlined_graph.nodes() if n.kind() == "prim::Constant"
              and n.output().type().kind() == "TensorType"]
    return {tuple(c.shape) for c in consts if isinstance(c, torch.Tensor) and c.dim() == 2}, traced


def test_the_r51_variant_is_the_same_function_captured_in_round_51s_form():
    model = tiny_dinov2(seed=3)  # widths 32 and 128 (K = 1): round 51 multiplied by H_32 and H_128
    probe = hf_example_inputs(model, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(model, beta_placement="keep")
        normswap.rotate(model, "none", online=True, seed=4)
    old = copy.deepcopy(model)
    assert speed.r51_ops_(old) == 6
    x = probe["pixel_values"]
    new_shapes, new = _traced_matrices(model, x)
    old_shapes, r51 = _traced_matrices(old, x)
    assert (128, 128) in old_shapes and (128, 128) not in new_shapes  # round 52 splits H_128 = H_4 ⊗ H_32
    with torch.no_grad():
        want = model(pixel_values=x).last_hidden_state
        # round 51's trace took n^-½ from a traced size, in float32 (its exported graphs did too)
        assert float((r51(x) - want).abs().max()) <= 1e-6 * float(want.abs().max())
        assert float((new(x) - want).abs().max()) <= 1e-9 * float(want.abs().max())
