"""A learned rotation reports as it goes (``rotate(..., "learned", progress=fn)``): the start and every check hand
over each stream's best matrix so far, orthogonal and mean-preserving, and a matrix saved so turns a fresh copy of
the converted model exactly (float64 ≤ 1e-9 on a DINOv2 replica with γ/β and LayerScale λ randomised)."""

import copy

import pytest
import torch

import normswap
from normswap.errors import NormswapError
from normswap.inputs import hf_example_inputs
from normswap.rotation import learn
from normswap.rotation.rotate import rotate
from tests.benchmark_modules import tiny_dinov2
from tests.rotation.test_rotate_smooth import _relative, _run


def _converted() -> tuple[torch.nn.Module, dict, torch.Tensor, list[dict]]:
    model = tiny_dinov2(seed=3)
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    normswap.patch(model, fold_gamma=True)
    return model, probe, ref, [hf_example_inputs(model, batch=4, seed=s) for s in (7, 8)]


def test_progress_reports_the_best_matrix_at_the_start_and_every_check():
    model, probe, ref, calib = _converted()
    fresh = copy.deepcopy(model)
    seen: list[learn.Progress] = []
    rot = rotate(model, "learned", output="restore", calibration=calib, bits=3, group_size=8, grid="full",
                 steps=20, lr=2e-2, progress=seen.append)
    assert _relative(_run(model, probe), ref) <= 1e-9
    # the starts scored (step 0), then a check every tenth of the run
    assert [p.step for p in seen] == [0, *range(2, 21, 2)]
    assert all(p.steps == 20 and p.start == rot.learned.start for p in seen)
    assert [len(p.history) for p in seen] == [p.step for p in seen]
    bests = [p.best_loss for p in seen]
    assert bests == sorted(bests, reverse=True) and bests[0] == pytest.approx(rot.learned.loss_start)
    assert bests[-1] == pytest.approx(rot.learned.loss_end)
    eye = torch.eye(32, dtype=torch.float64)
    for p in seen:
        (key, q), = p.best.items()
        assert key == rot.rotated[0]["norms"][0]
        assert float((q.T @ q - eye).abs().max()) <= 1e-12
        assert float((q.sum(dim=1) - 1).abs().max()) <= 1e-12  # Q·1 = 1, as every matrix rotate builds
    # the last report holds the matrix rotate applied: saved, it turns a fresh copy into the same model
    q_last = next(iter(seen[-1].best.values()))
    assert torch.equal(q_last, rot.rotated[0]["q"])
    rotate(fresh, q_last, output="restore")
    assert _relative(_run(fresh, probe), ref) <= 1e-9
    assert _relative(_run(fresh, probe), _run(model, probe)) <= 1e-12


def test_progress_needs_a_learned_rotation_and_leaves_the_model_as_it_was():
    model, _, _, calib = _converted()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(NormswapError, match="progress apply to a learned rotation"):
        rotate(model, "hadamard", output="restore", progress=print)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
