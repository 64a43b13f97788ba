"""``benchmarks/bench_load_quantized.py``'s pieces, without an engine: which modules should hold an online
Hadamard and whether they do (read without normswap.rotation.carry, as an earlier normswap's run needs), and the
tables of a run joined with a run of another normswap that lacks some engine."""

from __future__ import annotations

import json

import torch

from tests import benchmark_modules

bench = benchmark_modules.load("bench_load_quantized")


def test_op_paths_and_op_present_see_a_swap() -> None:
    import normswap
    from normswap.rotation.rotate import rotate
    from tests.benchmark_modules import tiny_dinov2

    model = tiny_dinov2(seed=3)
    normswap.patch(model, beta_placement="keep")
    rotate(model, "none", online=True)
    paths = bench.op_paths(model)
    assert paths == sorted([f"encoder.layer.{i}.mlp.{fc}" for i in range(2) for fc in ("fc1", "fc2")]
                           + [f"encoder.layer.{i}.norm1" for i in range(2)])
    assert all(bench.op_present(model.get_submodule(p)) for p in paths)
    fc2 = model.encoder.layer[0].mlp.fc2
    model.encoder.layer[0].mlp.fc2 = torch.nn.Linear(fc2.in_features, fc2.out_features)
    assert [p for p in paths if not bench.op_present(model.get_submodule(p))] == ["encoder.layer.0.mlp.fc2"]


def _row(errors: dict[str, list[float]]) -> dict:
    return {"note": "", "errors": {}, "loads": {},
            "per_image": {h: {"tok": e, "cls": e} for h, e in errors.items()}}


def test_tables_join_a_before_run_on_the_engines_both_ran(tmp_path, capsys) -> None:
    after = {"rows": {"original": _row({"a": [1.0, 2.0, 3.0], "b": [1.0, 1.0, 1.0]}),
                      "online": _row({"a": [0.5, 1.0, 1.5], "b": [2.0, 2.0, 2.0]})}}
    before = {"rows": {"original": _row({"a": [1.0, 2.0, 3.0]}), "online": _row({"a": [9.0, 9.0, 9.0]})}}
    (tmp_path / "before.json").write_text(json.dumps(before))
    bench.tables(after, tmp_path / "before.json")
    out = capsys.readouterr().out
    assert "| variant | a |" in out and "| b |" not in out  # b: the before run lacks it
    assert "| online | 0.500 (" in out and "| online (before) | 4.500 (" in out
