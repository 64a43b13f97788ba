"""Round 64's benchmark helpers: ``bench_openvino.add_ratios`` (the ratio cells of the NNCF tables, now also for
DINOv2's two metrics per image) and ``bench_quant_encoders.dynamic_settings`` (which ``quantize_dynamic`` settings
each ONNX Runtime dynamic quantizer name means).

What can be wrong without anything crashing: a ratio taken against another quantizer's original, or one metric's
ratio computed from the other's errors (a table that ranks the wrong numbers); a ``-u8`` quantizer that still
writes signed weights, or ``-rr`` that does not reduce the range (the docs would say a setting was judged that was
not). No engine is needed: pure functions.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import benchmark_modules

openvino_bench = benchmark_modules.load("bench_openvino")
encoders = benchmark_modules.load("bench_quant_encoders")


def test_ratios_pair_each_cell_with_the_original_in_the_same_quantizer():
    result = {"cells": {"original/fp32": {}, "original/static": {}, "original/w8": {},
                        "conv/fp32": {}, "conv/static": {}, "conv/w8": {}, "other/w4s128": {}},
              "per_text": {"original/fp32": [0.0, 0.0], "original/static": [1.0, 3.0], "original/w8": [2.0, 2.0],
                           "conv/fp32": [0.1, 0.1], "conv/static": [2.0, 2.0], "conv/w8": [1.0, 1.0],
                           "other/w4s128": [5.0, 5.0]}}
    openvino_bench.add_ratios(result)
    assert result["cells"]["conv/static"]["ratio"] == pytest.approx(1.0)   # 2 / mean(1, 3)
    assert result["cells"]["conv/w8"]["ratio"] == pytest.approx(0.5)
    lo, hi = result["cells"]["conv/static"]["ci95"]
    assert 0.5 <= lo <= 1.0 <= hi <= 2.0
    # no ratio for the original itself, for fp32 (no quantizer), or without the original in that quantizer
    for key in ("original/static", "conv/fp32", "other/w4s128"):
        assert "ratio" not in result["cells"][key]


def test_ratios_of_two_metrics_are_each_against_the_same_metric():
    rng = np.random.default_rng(0)
    base_cls, base_tok = rng.uniform(1, 2, 64), rng.uniform(10, 20, 64)
    result = {"cells": {"original/static": {}, "conv/static": {}},
              "per_image": {"original/static": {"cls": base_cls.tolist(), "tok": base_tok.tolist()},
                            "conv/static": {"cls": (1.5 * base_cls).tolist(), "tok": (0.8 * base_tok).tolist()}}}
    openvino_bench.add_ratios(result, per="per_image")
    cell = result["cells"]["conv/static"]
    assert cell["ratio_cls"] == pytest.approx(1.5) and cell["ratio_tok"] == pytest.approx(0.8)
    assert cell["ratio"] == cell["ratio_cls"] and cell["ci95"] == cell["ci95_cls"]
    # an exact multiple of the original's errors on every image: every resample gives the same ratio
    assert cell["ci95_cls"] == pytest.approx((1.5, 1.5)) and cell["ci95_tok"] == pytest.approx((0.8, 0.8))


@pytest.mark.parametrize(("how", "per_channel", "reduce_range", "weight_type"), [
    ("dyn-pt", False, False, "QInt8"), ("dyn-pc", True, False, "QInt8"),
    ("dyn-pt-rr", False, True, "QInt8"), ("dyn-pc-rr", True, True, "QInt8"),
    ("dyn-pt-u8", False, False, "QUInt8"), ("dyn-pc-u8", True, False, "QUInt8"),
    ("dyn-pt-u8rr", False, True, "QUInt8"), ("dyn-pc-u8rr", True, True, "QUInt8")])
def test_dynamic_quantizer_names_mean_their_settings(how, per_channel, reduce_range, weight_type):
    assert encoders.dynamic_settings(how) == {"per_channel": per_channel, "reduce_range": reduce_range,
                                              "weight_type": weight_type}
    assert how in encoders.QUANTIZERS


def test_a_non_dynamic_quantizer_has_no_dynamic_settings():
    with pytest.raises(ValueError, match="not a dynamic quantizer"):
        encoders.dynamic_settings("qdq")


def test_a_baseline_gives_its_originals_per_input_errors_only_for_the_same_inputs(tmp_path):
    """``reuse_baseline`` for the image and clip runs (``per_image``, ``per_clip``): the original's cells and errors
    come from the earlier run, and a run over other crops, or one without the original in a mode, is refused."""
    earlier = {"images": 4, "image_px": 112, "calib": 2, "cells": {"original/fp32": {"cls": 0.0},
                                                                   "original/static": {"cls": 1.0}},
               "per_image": {"original/fp32": {"cls": [0.0] * 4}, "original/static": {"cls": [1.0] * 4}}}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    result = {"images": 4, "image_px": 112, "calib": 2, "cells": {}, "per_image": {}}
    inputs = ("images", "image_px", "calib")
    encoders.reuse_baseline(result, path, ["fp32", "static"], per="per_image", inputs=inputs)
    assert result["per_image"]["original/static"] == {"cls": [1.0] * 4}
    assert result["cells"]["original/static"] == {"cls": 1.0}
    with pytest.raises(AssertionError, match="other inputs"):
        encoders.reuse_baseline({**result, "image_px": 224}, path, ["fp32"], per="per_image", inputs=inputs)
    with pytest.raises(AssertionError, match="no original"):
        encoders.reuse_baseline(result, path, ["w8"], per="per_image", inputs=inputs)
