"""The learned-rotation benchmarks' bookkeeping, no model run: per-image errors and their paired bootstrap
(``bench_quant_rotation.py``), the variant names it parses into ``rotate``'s settings, and the rotation's own ops
left in float by ``bench_quant_whisper.py --float-ops``.

What can be wrong without anything crashing: an interval that resamples the two sides independently (wide
where the ratio is in fact exact), a ``+scales`` variant that silently learns without scales, and a
``--float-ops`` run that quantizes the rotation's ``Qᵀ`` anyway.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests import benchmark_modules

rot = benchmark_modules.load("bench_quant_rotation")
bqw = benchmark_modules.load("bench_quant_whisper")


def test_per_image_errors_average_to_the_overall_figure():
    gen = torch.Generator().manual_seed(0)
    ref_pool, ref_tok = torch.randn(6, 8, generator=gen), torch.randn(6, 5, 8, generator=gen)
    pool, tok = ref_pool + 0.3 * torch.randn(6, 8, generator=gen), ref_tok + 0.3 * torch.randn(6, 5, 8, generator=gen)
    overall, per = rot.errors(ref_pool, ref_tok, pool, tok)
    assert len(per["tok"]) == len(per["cls"]) == 6
    for metric in ("tok", "cls"):
        assert overall[metric] == pytest.approx(sum(per[metric]) / 6, rel=1e-12)
    cos = torch.nn.functional.cosine_similarity(ref_tok.double(), tok.double(), dim=-1)
    assert overall["tok"] == pytest.approx(float((1 - cos).mean()), rel=1e-12)


def test_bootstrap_pairs_each_image_with_itself():
    """Errors spread over three decades, the variant exactly half the original on every image: paired, the
    interval is 0.5 to the digit; resampled independently it would span a wide range."""
    base = [10.0 ** (k % 4 - 3) for k in range(64)]
    lo, hi = rot.bootstrap([0.5 * b for b in base], base)
    assert lo == pytest.approx(0.5, rel=1e-12) and hi == pytest.approx(0.5, rel=1e-12)
    noisy = [b * (0.4 if k % 2 else 0.6) for k, b in enumerate(base)]
    lo, hi = rot.bootstrap(noisy, base)
    point = sum(noisy) / sum(base)
    assert 0.4 <= lo < point < hi <= 0.6  # per image the ratio is 0.4 or 0.6: no resample leaves that range


def test_table_prints_the_interval_next_to_each_ratio():
    rows = {"original": {"errors": {"nbits-rtn": {"tok": 2.0, "cls": 1.0}},
                         "per_image": {"nbits-rtn": {"tok": [1.0, 3.0], "cls": [1.0, 1.0]}}},
            "v": {"errors": {"nbits-rtn": {"tok": 1.0, "cls": 1.0}},
                  "per_image": {"nbits-rtn": {"tok": [0.5, 1.5], "cls": [1.0, 1.0]}}}}
    text = rot.table({"model": "m", "images": 2, "rows": rows}, "tok")
    assert "(0.50x, 0.50-0.50)" in text


@pytest.mark.parametrize("name, expected", [
    ("learned-w4g32f+scales", {"bits": 4, "group_size": 32, "grid": "full", "scales": True}),
    ("learned-w4g32f+online", {"bits": 4, "group_size": 32, "grid": "full"}),
    ("learned-w4a4+online", {"bits": 4, "act_bits": 4, "grid": "symmetric"}),
])
def test_variant_names_become_rotate_settings(name, expected):
    got = rot.learn_target(name)
    assert {k: got[k] for k in expected} == expected
    assert got.get("scales", False) == expected.get("scales", False)
    assert got["steps"] == rot.LEARN_STEPS and got["lr"] == rot.LEARN_LR


def test_whisper_float_ops_reads_the_nodes_written_beside_the_export(tmp_path, monkeypatch):
    fp32 = tmp_path / "model.onnx"
    (tmp_path / "float_nodes.json").write_text(json.dumps(["/model/encoder/layer_norm/MatMul"]))
    monkeypatch.setattr(bqw, "FLOAT_OPS", False)
    assert bqw.excluded(fp32) == []  # without --float-ops every MatMul is quantized, as before
    monkeypatch.setattr(bqw, "FLOAT_OPS", True)
    assert bqw.excluded(fp32) == ["/model/encoder/layer_norm/MatMul"]
    assert bqw.excluded(tmp_path / "other" / "model.onnx") == []  # no list written: nothing to leave out
