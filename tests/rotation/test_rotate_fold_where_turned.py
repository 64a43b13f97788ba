"""A rotation folds γ only where it turns the stream.

``patch(model, rotate=...)`` (CLI ``--rotate``) needs γ folded into the readers of every stream it turns; a
stream it leaves alone (Whisper's encoder: its last norm's output is the model output
``encoder_last_hidden_state``) keeps its norms exactly as a conversion without ``rotate`` leaves them, γ and β
included: folded there, γ only widened the readers' input columns, which cost ONNX Runtime's 4-bit
``MatMulNBits`` 1.55× the original's error (docs/results/quantization.md). ``fold_gamma=True`` still folds γ
everywhere, and ``rotate`` after ``patch(fold_gamma=True)`` turns what it can of that.
"""

import copy
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file

import normswap
from normswap.analysis.plan import GAMMA_KEPT
from normswap.inputs import hf_example_inputs
from normswap.nn.rmsnorm import RMSNorm
from normswap.rotation.rotate import rotate
from normswap.surgery.verify import compare
from tests.zoo import EXACT, RMS, build

ENCODER_LAYER_NORMS = [f"model.encoder.layers.{i}.{n}" for i in range(2)
                       for n in ("self_attn_layer_norm", "final_layer_norm")]


def _whisper() -> torch.nn.Module:
    """Tiny Whisper (2+2 layers, width 32), LayerNorm γ/β and biases randomised, float64, eval."""
    return build(EXACT, "whisper").double().eval()


def _exact(model: torch.nn.Module, original: torch.nn.Module, report: normswap.Report, seed: int = 11) -> float:
    """Worst relative error of ``model`` against ``original`` on unseen random inputs (float64)."""
    probe = hf_example_inputs(original, seed=seed)
    with torch.no_grad():
        figs = compare(original(**probe), model(**probe), set(report.plan.changed_outputs))
    assert figs["compared"]
    return figs["worst_rel_error_any_output"]


def _gammas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}


def test_the_unrotated_encoder_keeps_gamma_and_beta_as_without_a_rotation():
    original = _whisper()
    gammas = _gammas(original)
    plain = copy.deepcopy(original)
    normswap.patch(plain)  # the same conversion without a rotation
    model = copy.deepcopy(original)
    report = normswap.patch(model, rotate="hadamard")

    assert _exact(model, original, report) <= 1e-9
    rot = report.rotation
    assert len(rot.rotated) == 1 and rot.rotated[0]["norms"][0].startswith("model.decoder.")
    (skipped,) = rot.skipped
    assert "encoder_last_hidden_state" in skipped["reason"] and "keep γ" in skipped["reason"]
    assert sorted(skipped["gamma_kept"]) == sorted(ENCODER_LAYER_NORMS)
    assert "keep γ" in report.message  # the headline says it too

    for name, module in model.named_modules():
        if name.startswith("model.encoder.") and name in gammas:  # γ kept, the original's, bit for bit
            assert isinstance(module, RMSNorm) and torch.equal(module.weight, gammas[name]), name
            assert not bool((module.weight == 1).all())
        elif name.startswith("model.decoder.") and name in gammas:  # the turned stream: unit weight
            assert torch.equal(module.weight, torch.ones_like(module.weight)), name
    # every encoder tensor (norms, their β, readers, writers) is the unrotated conversion's, bit for bit
    mine, theirs = dict(model.named_parameters()), dict(plain.named_parameters())
    encoder = [k for k in mine if k.startswith("model.encoder.")]
    assert len(encoder) > 20 and all(torch.equal(mine[k], theirs[k]) for k in encoder)
    assert [k for k in theirs if k.startswith("model.encoder.")] == encoder  # no bias slot, nothing extra

    sites = {sp.name: sp for sp in report.plan.sites}
    for name in ENCODER_LAYER_NORMS:
        assert not sites[name].fold_gamma and sites[name].rotation_reason.startswith(GAMMA_KEPT)
    assert set(report.plan.options["gamma_kept"]) == set(ENCODER_LAYER_NORMS)
    assert all(sp.fold_gamma for n, sp in sites.items() if n.startswith("model.decoder."))


def test_the_plan_says_the_same_before_anything_is_edited():
    original = _whisper()
    plan = normswap.plan(original, rotate="hadamard")
    assert set(plan.options["gamma_kept"]) == set(ENCODER_LAYER_NORMS)
    assert torch.equal(original.model.encoder.layers[0].self_attn_layer_norm.weight,
                       _gammas(_whisper())["model.encoder.layers.0.self_attn_layer_norm"])


@pytest.mark.parametrize("how", ["explicit", "then-rotate"])
def test_fold_gamma_asked_for_still_folds_every_norm(how):
    original = _whisper()
    model = copy.deepcopy(original)
    if how == "explicit":
        report = normswap.patch(model, rotate="hadamard", fold_gamma=True)
        rot = report.rotation
    else:
        report = normswap.patch(model, fold_gamma=True)
        rot = rotate(model, "hadamard")
    assert _exact(model, original, report) <= 1e-9
    assert "gamma_kept" not in report.plan.options
    (skipped,) = rot.skipped
    assert skipped["gamma_kept"] == [] and "keep γ" not in skipped["reason"]
    for name in ENCODER_LAYER_NORMS:  # folded, although the stream did not turn: the user asked
        w = model.get_submodule(name).weight
        assert w is None or bool((w == 1).all()), name


@pytest.mark.parametrize("q, options", [
    ("random", {}),
    ("hadamard", {"online_hadamard": True}),
    ("learned", {"rotate_learn": {"steps": 2}}),
])
def test_every_rotation_kind_keeps_gamma_where_it_does_not_turn(q, options):
    original = _whisper()
    gammas = _gammas(original)
    model = copy.deepcopy(original)
    extra = {"calibration": [hf_example_inputs(original, seed=3)]} if q == "learned" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(model, rotate=q, **options, **extra)
    assert _exact(model, original, report) <= 1e-9
    assert [sorted(s["gamma_kept"]) for s in report.rotation.skipped] == [sorted(ENCODER_LAYER_NORMS)]
    for name in ENCODER_LAYER_NORMS:
        assert torch.equal(model.get_submodule(name).weight, gammas[name])


def test_restore_turns_the_encoder_too_and_keeps_no_gamma():
    original = _whisper()
    model = copy.deepcopy(original)
    report = normswap.patch(model, rotate="hadamard", rotate_output="restore")
    assert _exact(model, original, report) <= 1e-9
    assert len(report.rotation.rotated) == 2 and not report.rotation.skipped
    assert "gamma_kept" not in report.plan.options
    for name in ENCODER_LAYER_NORMS:
        assert bool((model.get_submodule(name).weight == 1).all())


def test_a_model_with_no_stream_to_turn_keeps_its_rms_norms_as_they_were():
    """T5's streams share the embedding, and the encoder's ends in a model output: nothing turns, so its RMS
    norms keep γ (before, ``rotate`` folded every γ and then turned nothing), and the report says why."""
    model = build(RMS, "t5").double().eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = normswap.patch(model, rotate="hadamard")
    assert "nothing to rotate either, so every RMS norm keeps γ" in report.message
    assert "encoder_last_hidden_state" in report.message
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_rotated_whisper_checkpoints_load_and_match(tmp_path):
    """Compat: stock transformers loads it (stock LayerNorms, the encoder's holding γ and β); native:
    ``normswap.load`` rebuilds it, the manifest carrying ``gamma_kept``."""
    original = _whisper().float()
    original.save_pretrained(tmp_path / "src")
    with warnings.catch_warnings():  # in memory, whatever RAM the machine has free (a rotation needs it)
        warnings.simplefilter("ignore")
        normswap.convert(tmp_path / "src", tmp_path / "rot", format="compat", rotate="hadamard", low_memory=False)
        normswap.convert(tmp_path / "src", tmp_path / "plain", format="compat", low_memory=False)
        normswap.convert(tmp_path / "src", tmp_path / "native", rotate="hadamard", low_memory=False)
        native = normswap.load(tmp_path / "native").eval()
    loaded = transformers.WhisperForConditionalGeneration.from_pretrained(tmp_path / "rot").eval()
    assert all(type(m) is not RMSNorm for m in loaded.modules())  # the stock architecture
    probe = hf_example_inputs(original, seed=7)
    with torch.no_grad():
        ref, out, nat = original(**probe).logits, loaded(**probe).logits, native(**probe).logits
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-4
    assert float((nat - ref).abs().max() / ref.abs().max()) < 1e-4
    assert set(normswap.plan_of(native).options["gamma_kept"]) == set(ENCODER_LAYER_NORMS)
    assert torch.equal(native.model.encoder.layers[0].self_attn_layer_norm.weight,
                       original.model.encoder.layers[0].self_attn_layer_norm.weight)

    rot, plain = load_file(tmp_path / "rot" / "model.safetensors"), load_file(tmp_path / "plain" / "model.safetensors")
    gammas = _gammas(original)
    for name in ENCODER_LAYER_NORMS:  # stock LayerNorms holding the original's γ, and β kept (compat's default)
        assert torch.equal(rot[f"{name}.weight"], gammas[name])
        assert torch.equal(rot[f"{name}.bias"], original.get_submodule(name).bias)
    decoder_norms = [k for k in rot if k.startswith("model.decoder.") and "layer_norm.weight" in k]
    assert decoder_norms and all(torch.equal(rot[k], torch.ones_like(rot[k])) for k in decoder_norms)
    encoder = [k for k in rot if k.startswith("model.encoder.")]
    assert sorted(encoder) == sorted(k for k in plain if k.startswith("model.encoder."))
    assert all(torch.equal(rot[k], plain[k]) for k in encoder)
