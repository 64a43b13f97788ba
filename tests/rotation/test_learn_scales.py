"""Per-channel scales learned with the rotation (``rotate(model, "learned", scales=True)``): exact in float64 with
γ/β randomised, written into the norms and their readers as ``smooth`` writes its own, lowering the fake-quantized
error where the rotation alone cannot, and refused next to ``smooth`` (Python, ``patch`` option, CLI)."""

import copy

import pytest
import torch

import normswap
from normswap.errors import NormswapError
from normswap.inputs import hf_example_inputs
from normswap.rotation import learn
from normswap.rotation.rotate import rotate
from tests.rotation.test_rotate_learned import _outlier_gpt2
from tests.rotation.test_rotate_smooth import _dinov2_backbone, _patched_for_rotation, _relative, _run
from tests.zoo import EXACT, build

CASES = {  # name: (model builder, rotate's output=, online=, act_bits)
    "gpt2-w4g16": (lambda: build(EXACT, "gpt2"), None, False, None),
    "dinov2-backbone-restore-online-w4a8": (_dinov2_backbone, "restore", True, 8),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_learned_scales_are_exact_and_written_into_norms_and_readers(name):
    make, output, online, act_bits = CASES[name]
    model = make()
    probe, ref, calib = _patched_for_rotation(model)
    rot = rotate(model, "learned", output=output, online=online, calibration=calib, bits=4, act_bits=act_bits,
                 group_size=16, steps=12, lr=1e-2, scales=True)
    assert _relative(_run(model, probe), ref) <= 1e-9, str(rot)
    learned = rot.learned
    assert learned is not None and learned.settings.scales and "learned scales" in rot.headline()
    assert not learned.kept_start and learned.scales, str(rot)  # it learned (else this proves nothing)
    restored = {n for r in rot.rotated for n in r["restore"]}
    for norm, s in learned.scales.items():
        assert norm not in restored  # a norm turned back sees the unrotated stream: it takes no scale
        assert float(s.log().mean().abs()) <= 1e-12 and bool((s > 0).all())  # geometric mean 1
        weight = model.get_submodule(norm).weight.detach().double()
        assert torch.allclose(weight, 1 / s, rtol=1e-12), norm  # the norm's unit weight became 1/s
    assert max(float(s.max() / s.min()) for s in learned.scales.values()) > 1.01  # they moved
    smoothed = {n for r in rot.rotated for n in r.get("smoothed", [])}
    assert smoothed == set(learned.scales) and all(r.get("smooth") == "learned" for r in rot.rotated)
    assert all(r["learned"]["scales"] is True for r in normswap.plan_of(model).rotations)


def test_learned_scales_lower_the_block_quantized_error_beyond_the_rotation_alone():
    """Weight-only blocks of 16 on ONNX Runtime's grid, the outlier GPT-2: the same run with scales ends lower on
    its calibration batches than without (the scales only add freedom; both start at the same matrix), and the
    float model is unchanged."""
    base = _outlier_gpt2()
    normswap.patch(base, fold_gamma=True)
    calib = [hf_example_inputs(base, batch=8, seed=s) for s in range(10, 13)]
    probe = hf_example_inputs(base, seed=5)
    ref = _run(base, probe)
    ends = {}
    for scales in (False, True):
        m = copy.deepcopy(base)
        rot = rotate(m, "learned", seed=0, calibration=calib, bits=4, group_size=16, grid="full", steps=40,
                     lr=1e-2, scales=scales)
        assert _relative(_run(m, probe), ref) <= 1e-9
        ends[scales] = rot.learned.loss_end
        assert rot.learned.loss_end < rot.learned.loss_start, str(rot)
    assert ends[True] < 0.7 * ends[False], ends  # measured: 2.8e-5 against 7.3e-5


def test_learned_scales_are_refused_with_smooth_and_without_a_learned_rotation():
    model = build(EXACT, "gpt2")
    normswap.patch(model, fold_gamma=True)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    calib = [hf_example_inputs(model, batch=2, seed=7)]
    with pytest.raises(NormswapError, match="pass one of them"):
        rotate(model, "learned", calibration=calib, scales=True, smooth=0.5, steps=2)
    with pytest.raises(NormswapError, match="apply to a learned rotation"):
        rotate(model, "hadamard", calibration=calib, scales=True)
    with pytest.raises(NormswapError, match="scales must be True or False"):
        learn.LearnSettings(scales=1)
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    fresh = build(EXACT, "gpt2")
    with pytest.raises(NormswapError, match="pass one of them"):
        normswap.patch(fresh, rotate="learned", rotate_learn={"scales": True}, rotate_smooth=0.5)


def test_cli_learn_scales(tmp_path):
    from click.testing import CliRunner

    from normswap.cli import main

    runner = CliRunner()
    res = runner.invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "a"), "--rotate", "hadamard",
                               "--learn-scales"])
    assert res.exit_code == 2 and "--learn-scales applies to a learned rotation" in res.stderr
    res = runner.invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "a"), "--rotate", "learned",
                               "--learn-scales", "--smooth", "0.5"])
    assert res.exit_code == 2 and "pass one of them" in res.stderr
    assert not (tmp_path / "a").exists()
    res = runner.invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "b"), "--rotate", "learned",
                               "--learn-steps", "4", "--learn-group-size", "16", "--learn-scales", "--quiet"])
    assert res.exit_code == 0, res.stderr
    assert "learned scales" in res.stdout
    assert '"scales": true' in (tmp_path / "b" / "config.json").read_text()
