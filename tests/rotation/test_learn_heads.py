"""SpinQuant's R2 learned with the stream rotation (``rotate(model, "learned", heads=True)``): one orthogonal
head-size matrix per attention layer on its values and output projection. Exact in float64 with γ/β randomised
(≤ 1e-9), orthogonal to 1e-12, written into the value projection's rows and bias and the output projection's
columns head by head, on top of the per-head Hadamard with ``online=True``, with the learning lowering its loss;
refused without a learned rotation or as a non-bool (Python, ``patch`` option, CLI)."""

import copy

import pytest
import torch

import normswap
from normswap.errors import NormswapError
from normswap.rotation import learn
from normswap.rotation.heads import value_heads as _value_heads
from normswap.rotation.rotate import rotate
from tests.rotation.test_rotate_smooth import _dinov2_backbone, _patched_for_rotation, _relative, _run
from tests.zoo import EXACT, build


def test_turn_heads_turns_each_head_block_and_back():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    r = learn.cayley(torch.randn(4, 4, generator=gen, dtype=torch.float64), keep_mean=False)
    assert float((r.T @ r - torch.eye(4, dtype=torch.float64)).abs().max()) <= 1e-12
    turned = learn.turn_heads(w, 0, r)
    for h in range(3):  # head h's rows: its 4 features times r
        assert torch.allclose(turned[4 * h:4 * h + 4].T, w[4 * h:4 * h + 4].T @ r, rtol=0, atol=1e-12)
    assert float((learn.turn_heads(turned, 0, r.T) - w).abs().max()) <= 1e-12
    # keep_mean=False is a rotation the mean-keeping transform cannot make: it moves the all-ones direction
    ones = torch.ones(4, dtype=torch.float64)
    assert float((ones @ r - ones).abs().max()) > 1e-3


CASES = {  # name: (model builder, rotate's output=, online=)
    "dinov2-backbone-restore": (_dinov2_backbone, "restore", False),
    "dinov2-backbone-restore-online": (_dinov2_backbone, "restore", True),
    "whisper-decoder-only": (lambda: build(EXACT, "whisper"), None, False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_learned_head_rotations_are_exact_orthogonal_and_written_per_head(name):
    make, output, online = CASES[name]
    model = make()
    probe, ref, calib = _patched_for_rotation(model)
    start = copy.deepcopy(model)
    rot = rotate(model, "learned", seed=0, output=output, online=online, calibration=calib, bits=3, group_size=16,
                 grid="full", steps=12, lr=2e-2, heads=True)
    assert _relative(_run(model, probe), ref) <= 1e-9, str(rot)
    assert len(rot.rotated) == 1  # one stream turns: the same learned Q₀R1 without R2 is the weights R2 turned
    rotate(start, rot.rotated[0]["q"], output=output, online=online)
    learned = rot.learned
    assert not learned.kept_start and learned.loss_end < learned.loss_start, str(rot)
    pairs, hd = _value_heads(model)
    assert sorted(learned.heads) == sorted(path for path, _, _ in pairs) and len(pairs) >= 2
    assert "head rotation(s) learned" in rot.headline() and rot.rotated[0]["learned_heads"] == sorted(learned.heads)
    eye = torch.eye(hd, dtype=torch.float64)
    moved = 0.0
    for path, v, o in pairs:
        r2 = learned.heads[path]
        assert float((r2.T @ r2 - eye).abs().max()) <= 1e-12
        moved = max(moved, float((r2 - eye).abs().max()))
        # the value rows and the output columns of each head are the start's times R2 (R1's axes untouched)
        v0 = start.get_submodule(path)
        sv = dict(v0.named_modules())
        v_name = next(n for n, m in model.get_submodule(path).named_modules() if m is v)
        o_name = next(n for n, m in model.get_submodule(path).named_modules() if m is o)
        want_v = learn.turn_heads(sv[v_name].weight.detach().double(), 0, r2)
        want_o = learn.turn_heads(sv[o_name].weight.detach().double(), 1, r2)
        assert float((v.weight.detach().double() - want_v).abs().max()) <= 1e-12, path
        assert float((o.weight.detach().double() - want_o).abs().max()) <= 1e-12, path
        if v.bias is not None:
            want_b = learn.turn_heads(sv[v_name].bias.detach().double(), 0, r2)
            assert float((v.bias.detach().double() - want_b).abs().max()) <= 1e-12, path
    assert moved > 1e-3  # the head rotations moved (else this proves nothing)
    for r in rot.rotated:  # R1 as before: orthogonal and mean-keeping
        q = r["q"]
        assert float((q.T @ q - torch.eye(q.shape[0], dtype=torch.float64)).abs().max()) <= 1e-12
        assert float((q.sum(dim=1) - 1).abs().max()) <= 1e-12
    assert all(r["learned"]["heads"] is True for r in normswap.plan_of(model).rotations)


def test_learned_head_rotations_are_refused_without_a_learned_rotation():
    model = build(EXACT, "gpt2")
    normswap.patch(model, fold_gamma=True)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(NormswapError, match="apply to a learned rotation"):
        rotate(model, "hadamard", heads=True)
    with pytest.raises(NormswapError, match="heads must be True or False"):
        learn.LearnSettings(heads=1)
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    with pytest.raises(NormswapError, match="rotate_learn applies to a learned rotation"):
        normswap.patch(build(EXACT, "gpt2"), rotate="hadamard", rotate_learn={"heads": True})


def test_cli_learn_heads(tmp_path):
    from click.testing import CliRunner

    from normswap.cli import main

    runner = CliRunner()
    res = runner.invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "a"), "--rotate", "hadamard",
                               "--learn-heads"])
    assert res.exit_code == 2 and "--learn-heads applies to a learned rotation" in res.stderr
    assert not (tmp_path / "a").exists()
