"""The learned rotation (``rotate(model, "learned")``, :mod:`normswap.rotation.learn`): exact in float64 on GPT-2
and a DINOv2 backbone with γ/β randomised, orthogonal and mean-preserving to 1e-12, better than the Hadamard it
starts from on held-out inputs of a model with planted outlier channels, and bad requests refused before
anything turns."""

import copy

import pytest
import torch
import transformers as tf

import normswap
from normswap.errors import NormswapError
from normswap.inputs import hf_example_inputs
from normswap.rotation import learn
from normswap.rotation.rotate import rotate
from tests.rotation.test_rotate_smooth import _dinov2_backbone, _patched_for_rotation, _relative, _run
from tests.zoo import EXACT, build, randomise

CASES = {  # name: (model builder, rotate's output=, online=)
    "gpt2": (lambda: build(EXACT, "gpt2"), None, False),
    "gpt2-online": (lambda: build(EXACT, "gpt2"), None, True),
    "dinov2-backbone": (_dinov2_backbone, "restore", True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_learned_rotation_is_exact_orthogonal_and_mean_preserving(name):
    make, output, online = CASES[name]
    model = make()
    probe, ref, calib = _patched_for_rotation(model)
    rot = rotate(model, "learned", output=output, online=online, calibration=calib, bits=4, act_bits=4, steps=20)
    assert _relative(_run(model, probe), ref) <= 1e-9, str(rot)
    assert rot.rotated and rot.learned is not None, str(rot)
    for r in rot.rotated:
        q = r["q"]
        eye = torch.eye(q.shape[0], dtype=torch.float64)
        assert float((q.T @ q - eye).abs().max()) <= 1e-12
        assert float((q.sum(dim=1) - 1).abs().max()) <= 1e-12  # Q·1 = 1: zero-mean streams stay zero-mean
        assert r["kind"] == "learned" and r["learned"]["act_bits"] == 4
        # it moved away from the Hadamard it started at (else the test proves nothing about learning)
        start, _ = normswap.rotation.rotate.rotation_matrix(q.shape[0], "hadamard", r["seed"])
        assert rot.learned.kept_start or float((q - start).abs().max()) > 1e-6
    # the manifest can recognise the matrix (it cannot be rebuilt from a seed)
    entry = normswap.rotation.rotate.manifest_entry(rot.rotated[0])
    assert len(entry["sha256"]) == 64 and "q" not in entry
    assert "learned rotation" in rot.headline()


def test_cayley_is_orthogonal_keeps_ones_and_starts_at_identity():
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(24, 24, generator=gen, dtype=torch.float64)
    r = learn.cayley(s)
    eye = torch.eye(24, dtype=torch.float64)
    assert float((r.T @ r - eye).abs().max()) <= 1e-12
    assert float((r @ torch.ones(24, dtype=torch.float64) - 1).abs().max()) <= 1e-12
    assert float((r - eye).abs().max()) > 0.1
    assert torch.equal(learn.cayley(torch.zeros(24, 24, dtype=torch.float64)), eye)


def test_fake_quant_grids():
    """``symmetric``: levels ±7 at 4 bits, step max/7; ``full``: ONNX Runtime MatMulNBits' symmetric grid, step
    max/8 with the block's largest magnitude on −8 (so +max and −max land on the grid's far end)."""
    w = torch.tensor([[0.8, -0.13, 0.33, -0.41], [-0.8, 0.13, -0.33, 0.41]], dtype=torch.float64)
    sym = learn.fake_quant(w, 4, 1)
    assert torch.allclose(sym / (0.8 / 7), (w / (0.8 / 7)).round())
    full = learn.fake_quant(w, 4, 1, grid="full")
    assert torch.allclose(full / (0.8 / 8), (w / (0.8 / 8)).round())
    grouped = learn.fake_quant(torch.cat([w, 10 * w], dim=1), 4, 1, group_size=4)
    assert torch.allclose(grouped[:, :4], sym) and torch.allclose(grouped[:, 4:], 10 * sym)  # one scale per group


def _outlier_gpt2() -> torch.nn.Module:
    """A 2-layer width-64 GPT-2 (γ/β randomised) whose stream has three planted outlier channels: the embedding
    tables' and every MLP output projection's features 3, 17 and 40 scaled up."""
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=99, n_positions=64,
                                             tie_word_embeddings=False, bos_token_id=0, eos_token_id=0))
    randomise(model, 0)
    with torch.no_grad():
        for p in (model.transformer.wte.weight, model.transformer.wpe.weight):
            p[:, [3, 17, 40]] *= 30
        for block in model.transformer.h:
            block.mlp.c_proj.weight[:, [3, 17, 40]] *= 10
    return model


@torch.no_grad()
def _quantized_error(model: torch.nn.Module, batches: list, bits: int, act_bits: int) -> float:
    """Relative squared logit error of ``model`` with every Linear/Conv1D weight rounded in place per output
    channel and its input per token (a copy; written independently of ``learn``'s functional path)."""
    q = copy.deepcopy(model)
    for module in q.modules():
        axis = 1 if isinstance(module, torch.nn.Linear) else 0 if type(module).__name__ == "Conv1D" else None
        if axis is None:
            continue
        w = module.weight.detach()
        scale = w.abs().amax(dim=axis, keepdim=True) / (2 ** (bits - 1) - 1)
        module.weight = torch.nn.Parameter((w / scale).round() * scale, requires_grad=False)

        def per_token(m, args, b=act_bits):
            x = args[0]
            s = x.abs().amax(dim=-1, keepdim=True) / (2 ** (b - 1) - 1)
            return ((x / s).round() * s, *args[1:])

        module.register_forward_pre_hook(per_token)
    errs = []
    for b in batches:
        ref, out = model(**b).logits, q(**b).logits
        errs.append(float((out - ref).pow(2).mean() / ref.pow(2).mean()))
    return sum(errs) / len(errs)


def test_learned_rotation_beats_its_hadamard_start_on_held_out_inputs():
    """Planted outlier channels, W4A4: the Hadamard spreads them, and the learned R lowers the held-out error
    of the same fake quantizer further (measured by a quantizer written here, not ``learn``'s)."""
    base = _outlier_gpt2()
    normswap.patch(base, fold_gamma=True)
    calib = [hf_example_inputs(base, batch=8, seed=s) for s in range(10, 14)]
    held_out = [hf_example_inputs(base, batch=8, seed=s) for s in range(100, 104)]
    hadamard = copy.deepcopy(base)
    rotate(hadamard, "hadamard", seed=0)
    learned = copy.deepcopy(base)
    rot = rotate(learned, "learned", seed=0, calibration=calib, bits=4, act_bits=4, steps=100)
    assert not rot.learned.kept_start and rot.learned.loss_end < rot.learned.loss_start
    e_converted = _quantized_error(base, held_out, 4, 4)
    e_hadamard = _quantized_error(hadamard, held_out, 4, 4)
    e_learned = _quantized_error(learned, held_out, 4, 4)
    assert e_hadamard < e_converted
    assert e_learned < 0.85 * e_hadamard, (e_converted, e_hadamard, e_learned)


@pytest.mark.parametrize("kwargs, message", [
    ({"q": "hadamard", "steps": 5}, "apply to a learned rotation"),
    ({"q": "learned", "bits": 1}, "bits must be an int in [2, 8]"),
    ({"q": "learned", "act_bits": 0}, "act_bits must be an int in [2, 16] or None"),
    ({"q": "learned", "group_size": 1}, "group_size must be an int ≥ 2"),
    ({"q": "learned", "steps": -1}, "steps must be an int"),
    ({"q": "learned", "lr": 0}, "lr must be a number"),
    ({"q": "learned", "grid": "nf4"}, "grid must be one of symmetric, full, asymmetric"),
    ({"q": "learned", "grid": "full+full"}, "grid must be one of symmetric, full, asymmetric"),
])
def test_bad_requests_are_refused_and_leave_the_model_as_it_was(kwargs, message):
    model = build(EXACT, "gpt2")
    normswap.patch(model, fold_gamma=True)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    calib = [hf_example_inputs(model, batch=2, seed=7)]
    with pytest.raises(NormswapError, match=message.replace("[", r"\[").replace("]", r"\]")):
        rotate(model, calibration=calib, **kwargs)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_a_custom_model_without_calibration_is_refused():
    from tests.custom_models import TinyGPT
    from tests.custom_models import randomise as randomise_custom

    model = randomise_custom(TinyGPT())
    ids = torch.randint(0, 50, (2, 8))
    normswap.patch(model, (ids,), fold_gamma=True)
    with pytest.raises(NormswapError, match="pass calibration="):
        rotate(model, "learned", steps=2)


def test_custom_model_with_a_tied_head_learns_and_stays_exact():
    """A custom model (tied head, qk-norms, a raw position Parameter) with calibration passed as tensors: the
    head tied to the embedding turns once, as the writer, and the float outputs are unchanged."""
    from tests.custom_models import TinyGPT
    from tests.custom_models import randomise as randomise_custom

    model = randomise_custom(TinyGPT())
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids)
    normswap.patch(model, (torch.randint(0, 50, (2, 8)),), fold_gamma=True)
    calib = [torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(s)) for s in (4, 5)]
    rot = rotate(model, "learned", calibration=calib, bits=4, act_bits=8, steps=10)
    assert rot.rotated, str(rot)
    with torch.no_grad():
        out = model(ids)
    assert _relative(out, ref) <= 1e-9, str(rot)


def test_patch_option_rotate_learned_is_exact_and_checked_before_converting():
    model = build(EXACT, "gpt2")
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    with pytest.raises(NormswapError, match="rotate_learn applies to a learned rotation"):
        normswap.patch(copy.deepcopy(model), rotate="hadamard", rotate_learn={"steps": 3})
    with pytest.raises(NormswapError, match="keys among"):
        normswap.patch(copy.deepcopy(model), rotate="learned", rotate_learn={"step": 3})
    report = normswap.patch(model, rotate="learned", rotate_learn={"bits": 4, "group_size": 16, "steps": 5},
                            calibration=hf_example_inputs(model, batch=4, seed=7))
    assert report.rotation.learned is not None and "learned rotation" in str(report)
    assert report.rotation.learned.settings.group_size == 16
    assert _relative(_run(model, probe), ref) <= 1e-9
    assert all(r["kind"] == "learned" for r in normswap.plan_of(model).rotations)


def test_cli_learned_rotation_needs_rotate_learned_and_writes_a_stock_checkpoint(tmp_path):
    from click.testing import CliRunner

    from normswap.cli import main

    runner = CliRunner()
    res = runner.invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "a"), "--rotate", "hadamard",
                               "--learn-steps", "5"])
    assert res.exit_code == 2 and "--learn-steps applies to a learned rotation" in res.stderr
    assert not (tmp_path / "a").exists()
    res = runner.invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "b"), "--rotate", "learned",
                               "--learn-steps", "5", "--learn-act-bits", "8", "--format", "compat", "--quiet"])
    assert res.exit_code == 0, res.stderr
    assert "learned rotation (W4A8, 5 steps" in res.stdout
    config = (tmp_path / "b" / "config.json").read_text()
    assert '"model_type": "gpt2"' in config and '"kind": "learned"' in config
