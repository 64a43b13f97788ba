"""``normswap backends`` / ``normswap bench`` and the benchmark core they share."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from normswap.backends import bench
from normswap.cli import main


def test_backends_table_and_json():
    runner = CliRunner()
    res = runner.invoke(main, ["backends"])
    assert res.exit_code == 0, res.output
    for name in ("eager", "native", "cpu", "triton"):
        assert name in res.output
    assert "auto on cpu float32" in res.output
    res = runner.invoke(main, ["backends", "--json"])
    rows = json.loads(res.output)
    assert {r["name"] for r in rows} == {"eager", "native", "cpu", "triton", "auto"}


def test_backends_shows_auto_rules_only_for_devices_this_machine_has(monkeypatch):
    """No "auto on cuda" rules on a CPU-only machine: one line says CUDA is not here (--json keeps
    every rule, each with ``device_present``); on a machine with CUDA its rules are listed."""
    from normswap import backends

    rows = backends.describe()
    autos = [r for r in rows if r["name"] == "auto"]
    assert autos and all(r["device_present"] == (r["device"] == "cpu" or torch.cuda.is_available()) for r in autos)
    for cuda in (False, True):
        faked = [{**r, "device_present": r["device"] == "cpu" or cuda} if r["name"] == "auto" else r for r in rows]
        monkeypatch.setattr(backends, "describe", lambda faked=faked: faked)
        res = CliRunner().invoke(main, ["backends"])
        assert res.exit_code == 0, res.output
        cuda_lines = [line for line in res.output.splitlines() if line.startswith("auto on cuda")]
        if cuda:
            assert len(cuda_lines) == 3 and all(" -> " in line for line in cuda_lines), cuda_lines
        else:
            assert cuda_lines == ["auto on cuda: no CUDA device here (--json lists what auto would pick there)"]
        assert "auto on cpu float32" in res.output


@pytest.mark.parametrize("cmd", ["backends", "bench"])
def test_help_has_an_example(cmd):
    res = CliRunner().invoke(main, [cmd, "--help"])
    assert res.exit_code == 0 and "Example:" in res.output and f"$ normswap {cmd}" in res.output


def test_bench_command_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    args = ["bench", "--dtype", "bf16", "--shapes", "32x128", "--rounds", "2", "--pass", "fwd",
            "--pass", "fwd+bwd", "--json", str(out), "--plot", str(png)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["environment"]["threads"] == torch.get_num_threads()
    methods = {(r["pass"], r["method"]) for r in data["results"]}
    assert {("fwd", "copy"), ("fwd", "layer_norm"), ("fwd", "cpu"), ("fwd+bwd", "cpu")} <= methods
    ln = [r for r in data["results"] if r["method"] == "layer_norm"]
    assert all(r["vs_layer_norm"] == pytest.approx(1.0) for r in ln)
    assert png.exists() and png.stat().st_size > 0


def test_bench_command_rejects_bad_input():
    runner = CliRunner()
    assert runner.invoke(main, ["bench", "--dtype", "int7"]).exit_code != 0
    assert runner.invoke(main, ["bench", "--shapes", "12by5"]).exit_code != 0
    if not torch.cuda.is_available():
        res = runner.invoke(main, ["bench", "--device", "cuda"])
        assert res.exit_code != 0 and "no CUDA device" in res.output


def test_parsers():
    assert bench.parse_shapes("4096x768, 2x3") == [(4096, 768), (2, 3)]
    assert bench.parse_dtype("bf16") is torch.bfloat16 and bench.parse_dtype("float32") is torch.float32
    with pytest.raises(ValueError):
        bench.parse_dtype("float7")


def test_bench_records_are_consistent():
    recs = bench.bench_shape(16, 64, torch.float32, rounds=2, target_ms=1, include=("eager", "cpu"))
    by = {r.method: r for r in recs}
    assert {"copy", "layer_norm", "torch_rms_norm", "eager", "cpu", "auto"} <= set(by)
    for r in recs:
        assert r.median_us > 0 and r.min_us <= r.median_us and len(r.samples_us) == 2
        assert r.gbps == pytest.approx(2 * 16 * 64 * 4 / (r.median_us * 1e-6) / 1e9)
    assert "x layer_norm" in bench.table(recs)


def test_backward_alone_pass_times_only_the_backward():
    recs = bench.bench_shape(64, 128, torch.float32, pass_="bwd", rounds=2, target_ms=1, include=("cpu",))
    by = {r.method: r for r in recs}
    assert {"layer_norm", "cpu", "auto"} <= set(by) and "copy" not in by
    assert by["cpu"].gbps == pytest.approx(3 * 64 * 128 * 4 / by["cpu"].median_us / 1e3)
