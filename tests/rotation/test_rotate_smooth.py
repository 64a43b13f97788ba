"""Scale migration in the rotated basis (``rotate(..., smooth=α)``): exact in float64 on GPT-2, a ViT and a
DINOv2 backbone with randomised γ/β (and LayerScale), the ranges it promises, saved and reloaded, and bad
requests refused before anything turns."""

import pytest
import torch
import transformers as tf

import normswap
from normswap.errors import NormswapError
from normswap.inputs import hf_example_inputs
from normswap.nn.rmsnorm import RMSNorm
from normswap.pipeline import default_dtype
from normswap.rotation import smooth as smoothing
from normswap.rotation.rotate import rotate
from tests.custom_models import TinyGPT
from tests.custom_models import randomise as randomise_custom
from tests.zoo import EXACT, build, randomise


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


def _dinov2_backbone() -> torch.nn.Module:
    """A 2-layer DINOv2 backbone (the output is the final norm's, restored) with γ/β randomised and LayerScale
    λ log-uniform over 2e-4 … 11 (DINOv2-small's range)."""
    torch.manual_seed(0)
    model = tf.Dinov2Model(tf.Dinov2Config(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, mlp_ratio=2))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambda" in name:
                p.copy_(torch.exp(torch.empty(p.shape).uniform_(-8.5, 2.4, generator=gen)))
    return randomise(model)


def _patched_for_rotation(model: torch.nn.Module) -> tuple[dict, torch.Tensor, list[dict]]:
    """The rotation tests' set-up: a probe and the model's output on it (the reference), then the model patched
    rotation-ready (γ folded) in place, and two calibration batches of other seeds."""
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    normswap.patch(model, fold_gamma=True)
    return probe, ref, [hf_example_inputs(model, batch=4, seed=s) for s in (7, 8)]


def _run(model, probe):
    with torch.no_grad(), default_dtype(torch.float64):
        out = model(**probe)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


CASES = {  # name: (model builder, rotate's output=)
    "gpt2": (lambda: build(EXACT, "gpt2"), None),
    "vit": (lambda: build(EXACT, "vit"), None),
    "dinov2-backbone": (_dinov2_backbone, "restore"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_smoothed_rotation_is_exact_in_float64(name):
    make, output = CASES[name]
    model = make()
    probe, ref, calib = _patched_for_rotation(model)
    rot = rotate(model, "hadamard", output=output, smooth=0.5, calibration=calib)
    assert _relative(_run(model, probe), ref) <= 1e-9, str(rot)
    done = rot.smoothing
    assert done is not None and done.scales, str(rot)
    # the scale really moved: norms no longer have unit weight, and the scales are not flat
    for norm, s in done.scales.items():
        assert isinstance(model.get_submodule(norm), RMSNorm)
        assert torch.allclose(model.get_submodule(norm).weight.double(), 1 / s)
        assert done.spread[norm] > 1.05, (norm, done.spread[norm])
    assert all(r["smooth"] == 0.5 for r in rot.rotated)
    assert sorted(n for r in rot.rotated for n in r["smoothed"]) == sorted(done.scales)
    if output == "restore":  # the final norm sees the unrotated stream: it keeps its own weight, and says why
        assert "layernorm" in done.skipped and "turned back" in done.skipped["layernorm"]
    assert "smoothed" in rot.headline()


def test_alpha_one_half_meets_activation_and_weight_ranges_in_the_middle():
    """With α = 0.5 each channel's activation maximum and its readers' column maximum come out equal up to
    one factor for the whole norm: ``a_j / s_j = c · w_j s_j``. Measured on the calibration data itself."""
    model = build(EXACT, "gpt2")
    normswap.patch(model, fold_gamma=True)
    calib = [hf_example_inputs(model, batch=4, seed=s) for s in (7, 8)]
    rot = rotate(model, "hadamard", smooth=0.5, calibration=calib)
    plan = normswap.plan_of(model)
    found, _ = smoothing.targets(model, plan, rot.rotated)
    act = smoothing.activation_maxima(model, found, smoothing.calibration_batches(model, calib))
    for norm, readers in found.items():
        ratio = act[norm] / smoothing.weight_maxima(model, readers)
        assert float(ratio.max() / ratio.min()) < 1 + 1e-6, norm


def test_alpha_zero_flattens_the_readers_columns():
    """α = 0 uses the weights alone: every reader column maximum (over the norm's readers) becomes equal."""
    model = build(EXACT, "gpt2")
    normswap.patch(model, fold_gamma=True)
    calib = hf_example_inputs(model, batch=4, seed=7)
    rot = rotate(model, "hadamard", smooth=0.0, calibration=calib)
    found, _ = smoothing.targets(model, normswap.plan_of(model), rot.rotated)
    for readers in found.values():
        w = smoothing.weight_maxima(model, readers)
        assert float(w.max() / w.min()) < 1 + 1e-6


def test_a_smoothed_rotation_survives_native_and_compat_checkpoints(tmp_path):
    model = build(EXACT, "gpt2")
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    normswap.patch(model, fold_gamma=True)
    rotate(model, "hadamard", smooth=0.5, calibration=hf_example_inputs(model, batch=4, seed=7))
    normswap.save(model, tmp_path / "native")
    loaded = normswap.load(tmp_path / "native").double().eval()
    assert normswap.plan_of(loaded).rotations[0]["smooth"] == 0.5
    assert _relative(_run(loaded, probe), ref) <= 1e-9
    normswap.save(model, tmp_path / "compat", format="compat")
    stock = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "compat").double().eval()
    assert _relative(_run(stock, probe), ref) <= 1e-9


def test_smoothing_without_calibration_uses_built_in_batches_for_transformers_models():
    model = build(EXACT, "gpt2")
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    normswap.patch(model, fold_gamma=True)
    rot = rotate(model, "hadamard", smooth=0.5)
    assert rot.smoothing.scales
    assert _relative(_run(model, probe), ref) <= 1e-9


@pytest.mark.parametrize("alpha", [1.5, -0.1, "half", True])
def test_a_bad_alpha_is_refused_and_nothing_turns(alpha):
    model = build(EXACT, "gpt2")
    normswap.patch(model, fold_gamma=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(NormswapError, match="smooth must be a number in"):
        rotate(model, "hadamard", smooth=alpha, calibration=hf_example_inputs(model, seed=7))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert not normswap.plan_of(model).rotations


def test_a_custom_model_must_bring_calibration_and_is_left_as_it_was():
    torch.manual_seed(0)
    model = randomise_custom(TinyGPT())
    ids = torch.randint(0, 50, (2, 8))
    normswap.patch(model, (ids,), fold_gamma=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(NormswapError, match="pass calibration="):
        rotate(model, "hadamard", smooth=0.5)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    # with calibration it is exact
    with torch.no_grad():
        ref = model(ids)
    rot = rotate(model, "hadamard", smooth=0.5, calibration=torch.randint(0, 50, (4, 8)))
    assert rot.smoothing.scales
    with torch.no_grad():
        assert _relative(model(ids), ref) <= 1e-9


def test_patch_rotate_smooth_option_and_its_refusals():
    from normswap.options import ConvertOptions

    with pytest.raises(NormswapError, match="rotate_smooth applies to a rotation"):
        ConvertOptions(rotate_smooth=0.5)
    with pytest.raises(NormswapError, match=r"rotate_smooth must be a number in \[0, 1\]"):
        ConvertOptions(rotate="hadamard", rotate_smooth=2)
    model = build(EXACT, "gpt2")
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    report = normswap.patch(model, rotate="hadamard", rotate_smooth=0.5,
                            calibration=hf_example_inputs(model, batch=4, seed=7))
    assert report.rotation.smoothing.scales and "smoothed" in str(report)
    assert _relative(_run(model, probe), ref) <= 1e-9


def test_cli_smooth_needs_rotate_and_writes_a_stock_checkpoint(tmp_path):
    from click.testing import CliRunner

    from normswap.cli import main

    runner = CliRunner()
    res = runner.invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "a"), "--smooth", "0.5"])
    assert res.exit_code == 2 and "--smooth applies to a rotation" in res.stderr
    assert not (tmp_path / "a").exists()
    res = runner.invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "b"), "--rotate", "hadamard",
                               "--smooth", "0.5", "--format", "compat", "--quiet"])
    assert res.exit_code == 0, res.stderr
    assert "smoothed" in res.stdout
    config = (tmp_path / "b" / "config.json").read_text()
    assert '"model_type": "gpt2"' in config


class _SharedMLP(torch.nn.Module):
    """Two Pre-LN blocks that share one MLP (weight-shared layers): each norm's reader is the same Linear."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(30, d)
        self.n1, self.n2, self.nf = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.up, self.down = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        self.head = torch.nn.Linear(d, 30)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = x + self.down(torch.relu(self.up(self.n1(x))))
        x = x + self.down(torch.relu(self.up(self.n2(x))))
        return self.head(self.nf(x))


def test_norms_whose_readers_share_a_weight_never_take_a_scale():
    """Shared layers: one Linear reads two norms, so its columns cannot take two scales. (normswap.rotate
    already leaves such a stream unrotated, since γ cannot fold into a shared reader; the guard holds on
    its own too.)"""
    torch.manual_seed(0)
    model = randomise_custom(_SharedMLP())
    ids = torch.randint(0, 30, (2, 6))
    normswap.patch(model, (ids,), fold_gamma=True)
    plan = normswap.plan_of(model)
    found, skipped = smoothing.targets(model, plan, [{"norms": ["n1", "n2", "nf"], "writers": [], "restore": []}])
    assert set(found) == {"nf"}, (found, skipped)
    assert "shared" in skipped["n1"] and "shared" in skipped["n2"]
    rot = rotate(model, "hadamard", smooth=0.5, calibration=torch.randint(0, 30, (4, 6)))
    assert not rot.rotated and rot.smoothing is None  # nothing turned, nothing smoothed
