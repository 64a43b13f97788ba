"""The learned rotation's asymmetric grid and its mixed grids (``rotate(model, "learned", grid="full+asymmetric")``):
the asymmetric fake quantizer lands on ``2^b`` levels from each block's minimum to its maximum; a mixed grid is
scored on the mean of its grids and trained on each of them in turn; the rotation it learns is exact in float64 with
γ/β randomised and orthogonal to 1e-12; a bad grid is refused (Python: nothing turned; CLI: exit 2 before any
model loads)."""

import copy

import pytest
import torch
from click.testing import CliRunner

import normswap
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.inputs import hf_example_inputs
from normswap.rotation import learn
from normswap.rotation.rotate import rotate
from tests.rotation.test_rotate_smooth import _dinov2_backbone, _patched_for_rotation, _relative, _run
from tests.zoo import EXACT, build


def test_asymmetric_grid_spans_min_to_max_with_an_integer_zero_point():
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(6, 64, generator=gen, dtype=torch.float64) * 3 - 0.5  # mostly positive: off-centre blocks
    q = learn.fake_quant(w, 4, 1, group_size=16, grid="asymmetric")
    for row, qrow in zip(w.reshape(-1, 16), q.reshape(-1, 16), strict=True):
        lo, hi = float(row.min()), float(row.max())
        scale = (hi - lo) / 15
        zero = round(-lo / scale)
        levels = qrow / scale + zero
        assert float((levels - levels.round()).abs().max()) <= 1e-9  # on the grid
        assert float(levels.min()) >= -1e-9 and float(levels.max()) <= 15 + 1e-9  # 16 levels, 0 … 15
        assert float((qrow - row).abs().max()) <= scale  # the zero point's rounding moves the grid by < scale/2
    # an off-centre block wastes half of a symmetric grid: the asymmetric one rounds it finer
    err = {g: float((learn.fake_quant(w, 4, 1, group_size=16, grid=g) - w).pow(2).mean())
           for g in ("symmetric", "full", "asymmetric")}
    assert err["asymmetric"] < 0.5 * err["symmetric"] and err["asymmetric"] < 0.5 * err["full"], err
    # the straight-through estimator: the gradient passes as if nothing were rounded
    x = w.clone().requires_grad_(True)
    learn.fake_quant(x, 4, 1, group_size=16, grid="asymmetric").sum().backward()
    assert torch.equal(x.grad, torch.ones_like(w))


def test_a_mixed_grid_is_scored_on_the_mean_of_its_grids():
    """At ``steps=0`` the starts are only scored: the mixed grid's score of the Hadamard start is the mean of each
    grid's own (``loss_start`` is the better of two starts, which each grid may choose differently)."""
    model = build(EXACT, "gpt2")
    normswap.patch(model, fold_gamma=True)
    calib = [hf_example_inputs(model, batch=2, seed=s) for s in (7, 8)]
    start = {}
    for grid in ("full", "asymmetric", "full+asymmetric"):
        rot = rotate(copy.deepcopy(model), "learned", seed=0, calibration=calib, bits=3, group_size=16, grid=grid,
                     steps=0)
        start[grid] = rot.learned.loss_hadamard
    assert start["full"] != pytest.approx(start["asymmetric"], rel=1e-3)  # else the mean proves nothing
    assert start["full+asymmetric"] == pytest.approx((start["full"] + start["asymmetric"]) / 2, rel=1e-12)


def test_a_mixed_grid_trains_every_batch_on_every_grid(monkeypatch):
    seen: list[tuple[int, str]] = []
    real = learn.fake_quant

    def spy(x, bits, dim, group_size=None, grid="symmetric"):
        if torch.is_grad_enabled() and x.requires_grad:  # a training step's weight (scoring runs without grad)
            seen.append((id_of[0], grid))
        return real(x, bits, dim, group_size, grid)

    id_of = [0]
    real_loss = learn.output_error

    def count(*args, **kwargs):
        id_of[0] += 1
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(learn, "fake_quant", spy)
    monkeypatch.setattr(learn, "output_error", count)
    model = build(EXACT, "gpt2")
    normswap.patch(model, fold_gamma=True)
    calib = [hf_example_inputs(model, batch=2, seed=s) for s in (7, 8)]
    rotate(model, "learned", seed=0, calibration=calib, bits=4, group_size=16, grid="full+asymmetric", steps=4)
    grids_by_call: dict[int, set[str]] = {}
    for call, grid in seen:
        grids_by_call.setdefault(call, set()).add(grid)
    assert all(len(g) == 1 for g in grids_by_call.values())  # one grid per step
    per_step = [next(iter(g)) for _, g in sorted(grids_by_call.items())]
    # 2 batches: steps 0-3 meet batches 0,1,0,1 on grids full, asymmetric, asymmetric, full
    assert per_step == ["full", "asymmetric", "asymmetric", "full"], per_step


def test_learned_on_mixed_grids_is_exact_and_orthogonal():
    model = _dinov2_backbone()
    probe, ref, calib = _patched_for_rotation(model)
    rot = rotate(model, "learned", output="restore", calibration=calib, bits=4, group_size=16,
                 grid="full+asymmetric", steps=12, lr=1e-2, scales=True)
    assert _relative(_run(model, probe), ref) <= 1e-9, str(rot)
    assert not rot.learned.kept_start and rot.learned.loss_end < rot.learned.loss_start, str(rot)
    assert "full+asymmetric grid" in rot.headline() and rot.learned.record()["grid"] == "full+asymmetric"
    for r in rot.rotated:
        q = r["q"]
        eye = torch.eye(q.shape[0], dtype=torch.float64)
        assert float((q.T @ q - eye).abs().max()) <= 1e-12
        assert float((q.sum(dim=1) - 1).abs().max()) <= 1e-12


@pytest.mark.parametrize("grid", ["nf4", "full+full", "full+", ""])
def test_a_bad_grid_is_refused_before_anything_turns(grid):
    model = build(EXACT, "gpt2")
    normswap.patch(model, fold_gamma=True)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(NormswapError, match="grid must be one of symmetric, full, asymmetric"):
        rotate(model, "learned", calibration=[hf_example_inputs(model, batch=2, seed=7)], grid=grid, steps=1)
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_cli_refuses_a_bad_grid_in_one_line(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", "no-such-model-dir", "--out", str(out), "--rotate", "learned",
                                       "--learn-grid", "full+nf4"])
    assert result.exit_code == 2, result.output
    assert "--learn-grid 'full+nf4'" in result.output and "full+asymmetric" in result.output
    assert "Traceback" not in result.output and not out.exists()
