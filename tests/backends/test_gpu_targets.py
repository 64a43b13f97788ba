"""The GPU targets as code (``benchmarks/gpu_targets.py``), judged on synthetic measurements.

The script itself needs a CUDA device; its checks are plain functions, tested here on CPU so that a
wrong comparison or a target silently left unmeasured fails in CI rather than on the GPU machine.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from normswap.backends import bench

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_targets.py"
_spec = importlib.util.spec_from_file_location("gpu_targets", _PATH)
gpu_targets = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("gpu_targets", gpu_targets)  # dataclasses look their module up there
_spec.loader.exec_module(gpu_targets)


def _record(pass_, rows, n, method, samples):
    return bench.Record(device="cuda", dtype="bfloat16", rows=rows, n=n, pass_=pass_, method=method,
                        median_us=samples[1], min_us=min(samples), gbps=1.0, vs_layer_norm=None, vs_copy=None,
                        samples_us=list(samples))


def test_eager_check_compares_auto_with_the_faster_rival_per_round():
    recs = [
        _record("fwd", 512, 4096, "native", [10, 10, 10]),
        _record("fwd", 512, 4096, "triton", [20, 8, 20]),  # faster in round 2 only
        _record("fwd", 512, 4096, "auto", [10.2, 10.2, 10.2]),  # per round: 1.02, 1.275, 1.02 -> 1.02
        _record("bwd", 512, 4096, "native", [10, 10, 10]),
        _record("bwd", 512, 4096, "triton", [30, 30, 30]),
        _record("bwd", 512, 4096, "auto", [30, 30, 30]),  # picked triton: 3x the best
    ]
    checks = {c.where: c for c in gpu_targets.eager_checks(recs)}
    assert checks["fwd bfloat16 512x4096"].ok and checks["fwd bfloat16 512x4096"].value == pytest.approx(1.02)
    assert not checks["bwd bfloat16 512x4096"].ok


def test_graph_checks_bandwidth_copy_and_liger():
    m, n = 32768, 4096
    tb = 5 * m * n * 2 / 2.7e12 * 1e6  # µs at 2.7 TB/s
    rows = [
        {"pass": "fwd", "dtype": "bfloat16", "rows": m, "n": n, "method": "copy", "us": 178.0},
        {"pass": "fwd", "dtype": "bfloat16", "rows": m, "n": n, "method": "auto", "us": 180.0},
        {"pass": "fwd", "dtype": "bfloat16", "rows": m, "n": n, "method": "liger", "us": 179.0},
        {"pass": "fwd+bwd", "dtype": "bfloat16", "rows": m, "n": n, "method": "auto", "us": tb},
        {"pass": "fwd+bwd", "dtype": "bfloat16", "rows": m, "n": n, "method": "liger", "us": tb * 0.9},
        {"pass": "fwd", "dtype": "bfloat16", "rows": 8192, "n": 768, "method": "auto", "us": 9.2},
        {"pass": "fwd", "dtype": "bfloat16", "rows": 8192, "n": 768, "method": "liger", "us": 7.2},
    ]
    checks = {(c.target, c.where): c for c in gpu_targets.graph_checks(rows)}
    copy = checks[("graph: forward / copy bandwidth", "fwd bfloat16 32768x4096")]
    assert copy.ok and copy.value == pytest.approx(178 / 180)
    tbps = checks[("graph: forward+backward TB/s", "fwd+bwd bfloat16 32768x4096")]
    assert tbps.ok and tbps.value == pytest.approx(2.7)
    assert checks[("graph: auto / liger", "fwd bfloat16 32768x4096")].ok  # 0.6% behind: within noise
    assert not checks[("graph: auto / liger", "fwd+bwd bfloat16 32768x4096")].ok
    assert not checks[("graph: auto / liger", "fwd bfloat16 8192x768")].ok


def test_host_and_model_checks_and_missing_targets():
    host = [{"pass": "fwd", "dtype": "bfloat16", "bias": False, "ratio": 0.9},
            {"pass": "fwd+bwd", "dtype": "bfloat16", "bias": True, "ratio": 1.2}]
    model = [{"model": "gpt2-small", "phase": "decode", "ratio": 1.01},
             {"model": "gpt2-small", "phase": "train", "ratio": 0.985},
             {"model": "gpt2-small", "phase": "compile", "ratio": 1.0}]
    checks = gpu_targets.host_checks(host) + gpu_targets.model_checks(model)
    assert [c.ok for c in checks] == [True, False, False, True, True]
    assert gpu_targets.missing(checks, ["host", "model"]) == []
    assert gpu_targets.missing(checks, ["host", "model", "graph"]) == gpu_targets.EXPECTED["graph"]
    assert gpu_targets.missing([], ["eager"]) != []  # nothing measured is not "all passed"
    assert "FAIL" in gpu_targets.targets_table(checks)


def test_nan_never_passes():
    assert not gpu_targets._check("t", "w", float("nan"), 1.0).ok
    assert not gpu_targets._check("t", "w", float("nan"), 1.0, ">=").ok


def test_clocks_table_lines_up_the_three_clocks():
    payload = {"eager": [{"pass": "fwd", "rows": 8192, "n": 4096, "method": "auto", "median_us": 60.0}],
               "graph": [{"pass": "fwd", "rows": 8192, "n": 4096, "method": "auto", "us": 48.3}],
               "host_ops_us": {"normswap.rms_norm": 14.0}}
    table = gpu_targets.clocks_table(payload)
    assert "60.0" in table and "48.3" in table and "14.0" in table
