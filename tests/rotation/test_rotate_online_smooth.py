"""``rotate(model, "none", online=True, smooth=α)``: SmoothQuant's scale between each converted norm (γ and β
kept) and its Linear readers, put in before the online Hadamards. Exact in float64 (≤ 1e-9) on a DINOv2 replica
with γ/β/λ randomised, full and block-diagonal ops; the scale sits in the norm's own basis (its γ and β are the
kept ones ÷ s, its readers' columns × s before the op's turn); a tied head is left unsmoothed; a failure while
adding the ops puts every smoothed tensor back; the option goes through ``patch`` and the CLI and survives the
native checkpoint."""

import pytest
import torch

import normswap
from normswap.errors import NormswapError
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.rotation.rotate import rotate
from tests.benchmark_modules import tiny_dinov2
from tests.zoo import EXACT, build


def _run(model, probe):
    with torch.no_grad(), default_dtype(torch.float64):
        out = model(**probe)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _relative(out, ref):
    return float((out - ref).abs().max() / ref.abs().max())


def _massive(model):
    """A few channels much larger than the rest in every norm's output (DINOv2's massive channels), so the
    smoothing scales spread far from 1."""
    with torch.no_grad():
        for name, m in model.named_modules():
            if name.endswith(("norm1", "norm2")):
                m.weight[[3, 17]] *= 25
    return model


@pytest.mark.parametrize("block", [None, 8])
def test_online_hadamards_with_smoothing_keep_dinov2_exact(block):
    model = _massive(tiny_dinov2(seed=3))
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    normswap.patch(model, beta_placement="keep")
    kept = {n: (m.weight.detach().clone(), m.bias.detach().clone()) for n, m in model.named_modules()
            if isinstance(m, normswap.RMSNorm) and m.bias is not None}
    rot = rotate(model, "none", online=True, seed=4, smooth=0.5, online_block=block,
                 calibration=hf_example_inputs(model, batch=4, seed=7))
    assert _relative(_run(model, probe), ref) <= 1e-9, str(rot)
    done = rot.smoothing
    norms = sorted(f"encoder.layer.{i}.{n}" for i in range(2) for n in ("norm1", "norm2"))
    assert sorted(done.scales) == norms and rot.rotated[0]["smoothed"] == norms and rot.rotated[0]["smooth"] == 0.5
    assert "layernorm" in done.skipped  # the final norm's output is the model's output
    assert all(spread > 3 for spread in done.spread.values())  # the massive channels took a scale
    for name in norms:  # the scale is in the norm's own basis: its kept γ and β ÷ s
        m, s = model.get_submodule(name), done.scales[name]
        gamma, beta = kept[name]
        assert torch.allclose(m.weight.double(), gamma.double() / s, rtol=1e-12, atol=0)
        assert torch.allclose(m.bias.double(), beta.double() / s, rtol=1e-12, atol=0)
    assert "smoothed 4 norm(s)" in rot.headline()


def test_without_smoothing_the_same_call_leaves_the_norms_as_converted():
    model = _massive(tiny_dinov2(seed=3))
    normswap.patch(model, beta_placement="keep")
    gammas = {n: p.clone() for n, p in model.named_parameters() if "norm" in n}
    rot = rotate(model, "none", online=True, seed=4)
    assert rot.smoothing is None and "smooth" not in rot.rotated[0]
    assert all(torch.equal(p, gammas[n]) for n, p in model.named_parameters() if n in gammas)


def test_a_head_tied_to_the_embedding_takes_no_scale():
    model = build(EXACT, "gpt2")
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    normswap.patch(model, beta_placement="keep", untie=False)
    assert model.lm_head.weight is model.transformer.wte.weight
    wte = model.transformer.wte.weight.detach().clone()
    rot = rotate(model, "none", online=True, smooth=0.5, calibration=hf_example_inputs(model, batch=4, seed=7))
    assert _relative(_run(model, probe), ref) <= 1e-9
    assert "transformer.ln_f" not in rot.smoothing.scales and "transformer.ln_f" in rot.smoothing.skipped
    assert rot.smoothing.scales  # the blocks' norms did take one
    assert model.lm_head.weight is model.transformer.wte.weight and torch.equal(model.transformer.wte.weight, wte)


def test_a_failure_adding_the_ops_puts_the_smoothed_tensors_back():
    model = _massive(tiny_dinov2(seed=3))
    normswap.patch(model, beta_placement="keep")
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(NormswapError, match="online_block=4096"):  # no op width takes it: refused after smoothing
        rotate(model, "none", online=True, smooth=0.5, online_block=4096,
               calibration=hf_example_inputs(model, batch=4, seed=7))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_patch_option_cli_and_native_checkpoint(tmp_path):
    from click.testing import CliRunner

    from normswap.cli import main

    model = _massive(tiny_dinov2(seed=3))
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    report = normswap.patch(model, rotate="none", online_hadamard=True, rotate_smooth=0.5,
                            calibration=hf_example_inputs(model, batch=4, seed=7))
    assert report.rotation.smoothing.scales and "smoothed" in str(report.message)
    assert _relative(_run(model, probe), ref) <= 1e-9
    normswap.save(model, tmp_path / "ckpt")
    loaded = normswap.load(tmp_path / "ckpt").double().eval()
    (entry,) = normswap.plan_of(loaded).rotations
    assert entry["kind"] == "none" and entry["smooth"] == 0.5 and len(entry["smoothed"]) == 4
    assert _relative(_run(loaded, probe), ref) <= 1e-9
    res = CliRunner().invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "b"), "--rotate", "none",
                                    "--online-hadamard", "--smooth", "0.5", "--quiet"])
    assert res.exit_code == 0, res.stderr
    assert "no stream turned; online Hadamards before" in res.stdout and "smoothed" in res.stdout
    (entry,) = normswap.plan_of(normswap.load(tmp_path / "b")).rotations
    assert entry["kind"] == "none" and entry["smooth"] == 0.5
