"""``benchmarks/x86_inductor_int8.py``'s own logic on tiny random replicas: the exported graphs it quantizes
(dead ops dropped, each norm one fused op), the pooled embedding, the error and ratio figures, and the speed
cells' layout. No real checkpoint, no network; only the last test needs torchao (its point is torchao's quantizer)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

tf = pytest.importorskip("transformers")

import x86_inductor_int8 as bench  # noqa: E402

import normswap  # noqa: E402


def _randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def bert() -> torch.nn.Module:
    cfg = tf.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=16)
    return _randomised(tf.BertModel(cfg), 0)  # with its pooler (Linear + Tanh), which the embedding never reads


@pytest.fixture(scope="module")
def dino() -> tuple[torch.nn.Module, torch.nn.Module]:
    cfg = tf.Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, mlp_ratio=2, patch_size=7,
                          image_size=28, layer_norm_eps=1e-6)
    original = _randomised(tf.Dinov2Model(cfg), 1)
    converted = _randomised(tf.Dinov2Model(cfg), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(converted, beta_placement="keep")  # what `normswap convert` writes
    return original, converted


def _text_batch(n: int = 3, tokens: int = 8) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(1, 50, (n, tokens), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # a padded text
    return ids, mask, torch.zeros_like(ids)


def test_pooled_is_sentence_transformers_pooling(bert: torch.nn.Module) -> None:
    from bench_quant_encoders import pooled

    ids, mask, types = _text_batch()
    with torch.no_grad():
        got = bench.Pooled(bert)(ids, mask, types)
        want = pooled(bert(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state, mask)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_exported_graph_drops_the_unread_pooler(bert: torch.nn.Module) -> None:
    example = _text_batch()
    graph, info = bench.quantize(bench.Pooled(bert), example, "fp32", [])
    ops = bench.graph_ops(graph.graph)
    assert not any("tanh" in k for k in ops), ops  # the pooler's Linear + Tanh, which nothing reads
    assert info["norm_ops"] == {"aten.layer_norm.default": 2 + 1}
    with torch.no_grad():
        torch.testing.assert_close(graph(*example), bench.Pooled(bert)(*example))


def test_converted_norms_export_as_one_fused_op_each(dino: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    original, converted = dino
    px = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(3))
    norms = sum(isinstance(m, normswap.RMSNorm) for m in converted.modules())
    assert norms == 2 + 1
    _, info_o = bench.quantize(bench.Cls(original), (px,), "fp32", [])
    graph, info_c = bench.quantize(bench.Cls(converted), (px,), "fp32", [])
    assert info_o["norm_ops"] == {"aten.layer_norm.default": norms}
    assert info_c["norm_ops"] == {"aten.rms_norm.default": norms}
    with torch.no_grad():
        torch.testing.assert_close(graph(px), bench.Cls(original)(px), rtol=1e-4, atol=1e-5)


def test_errors_and_ratio_cell() -> None:
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    out = torch.tensor([[1.0, 0.0], [1.0, 1.0], [-1.0, -1.0]])
    err = bench.errors(out, ref)
    assert err == pytest.approx([0.0, 1 - 2 ** -0.5, 2.0])
    base = [0.5, 1.0, 2.0]
    cell = bench.ratio_cell([2 * e for e in base], base, ["a", "b", "c"])
    assert cell["ratio"] == pytest.approx(2.0) and cell["low"] == pytest.approx(2.0)
    assert cell["high"] == pytest.approx(2.0) and cell["original"] == pytest.approx(3.5 / 3)
    mixed = bench.ratio_cell([1.0, 3.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], ["p", "p", "q", "q"])
    assert mixed["ratio"] == pytest.approx(1.5) and mixed["low"] < 1.5 < mixed["high"]


def test_speed_cells_pair_each_program_with_the_originals_and_an_aa() -> None:
    calls: list[tuple[str, int]] = []

    def program(name: str):
        def run(x: torch.Tensor) -> torch.Tensor:
            calls.append((name, x.shape[0]))
            return x
        return run

    programs = {m: {f"{s}@{b}": program(f"{m}/{s}@{b}") for s in ("fp32", "static") for b in (1, 8)}
                for m in ("original", "converted")}
    cells = bench.speed_cells(programs, {1: (torch.zeros(1, 2),), 8: (torch.zeros(8, 2),)}, 0.0, min_quads=2)
    assert set(cells) == {"fp32@1", "fp32@8", "static@1", "static@8"}
    for key, cell in cells.items():
        assert cell["converted"]["quads"] == cell["aa"]["quads"] == 2
        batch = int(key.split("@")[1])
        # each cell runs the original and the converted program of its own key on its own batch, nothing else
        assert {c for c in calls if c[0].endswith(key)} == {(f"original/{key}", batch), (f"converted/{key}", batch)}
    assert "A/A" in bench.table("x", {"inputs": 3, "batch": 8, "cells": {}, "speed": cells})


def test_static_quantization_runs_past_the_unread_pooler(bert: torch.nn.Module) -> None:
    pytest.importorskip("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer")
    example = _text_batch()
    graph, info = bench.quantize(bench.Pooled(bert), example, "static", [example])
    assert info["quantized_ops"] > 0
    with torch.no_grad():
        err = bench.errors(graph(*example), bench.Pooled(bert)(*example))
    assert max(err) < 0.05
