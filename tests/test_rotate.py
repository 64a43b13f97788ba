"""Rotation-readiness: after patch(fold_gamma=True), an orthogonal Q on every ready residual stream
(writers' outputs × Q, readers' inputs × Qᵀ, embeddings × Q) leaves the outputs unchanged in fp64.
Where a stream cannot be rotated, the plan says why."""

import pytest
import torch

import normswap
from normswap.api import default_dtype
from normswap.inputs import hf_example_inputs
from normswap.plan import Plan
from normswap.rotate import random_orthogonal, rotate, rotation_matrix, streams
from normswap.verify import compare
from tests.custom_models import TinyGPT, TinyViT
from tests.custom_models import randomise as randomise_custom
from tests.zoo import EXACT, MORE, build, randomise

EXACT_MORE = {k: v[0] for k, v in MORE.items() if v[1] == "exact"}
# exact architectures with a stream that cannot be rotated, and the reason the plan gives
NOT_READY = {
    "bloom": "centering op",  # embedding LayerNorm starts the stream: centered at run time
    "clip-vision": "centering op",  # pre_layrnorm
    "xglm": "centering op",  # regenerated sinusoidal positions
    "mbart": "centering op",  # layernorm_embedding
    "m2m100": "centering op",  # sinusoidal positions
    "whisper": "centering op",  # the encoder's conv+GELU stem (the decoder stream does rotate)
    "clip-text": "last_hidden_state",  # the final norm's output is a model output, not a Linear input
    "clip": "last_hidden_state",
    "pegasus": "encoder_last_hidden_state",
    "wav2vec2-stable": "not a Linear",  # feature-extractor norms feed a conv stack
    "dinov2": "`cat`",  # the classifier reads [cls, mean of patches] concatenated
    "dinov3-vit": "last_hidden_state",  # the final norm's output is a model output
    "dinov3-vit-no-value-bias": "last_hidden_state",
}
FULLY_BLOCKED = {"bloom", "clip-vision", "xglm", "mbart", "m2m100", "clip-text", "clip", "pegasus", "wav2vec2-stable",
                 "dinov2", "dinov3-vit", "dinov3-vit-no-value-bias"}


def _build(name):
    if name in EXACT:
        return build(EXACT, name)
    torch.manual_seed(0)
    cls, config = EXACT_MORE[name]()
    return randomise(cls(config))


@pytest.mark.parametrize("name", sorted(EXACT) + sorted(EXACT_MORE))
def test_orthogonal_rotation_of_every_ready_stream_preserves_outputs(name):
    model = _build(name)
    report = normswap.patch(model, fold_gamma=True, mode="exact")
    probe = hf_example_inputs(model, seed=5)
    with torch.no_grad(), default_dtype(torch.float64):
        ref = model(**probe)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rot = rotate(model, 3)
    with torch.no_grad(), default_dtype(torch.float64):
        out = model(**probe)
    figs = compare(ref, out)
    assert figs["compared"]
    assert figs["worst_rel_error_any_output"] <= 1e-9, (figs, str(rot))

    rotated = {n for r in rot.rotated for n in r["norms"]}
    for sp in report.plan.sites:  # every converted norm is either rotated or has a stated reason
        if sp.convert and sp.name not in rotated:
            assert any(sp.name in s["norms"] for s in rot.skipped)
    for s in rot.skipped:
        assert s["reason"]
    if name in FULLY_BLOCKED:
        assert not rot.rotated
    else:
        assert rot.rotated, str(rot)
        # the rotation really happened: every rotated (non-zero) writer tensor changed
        for r in rot.rotated:
            for t in r["writers"]:
                if before[t].abs().max() > 0:
                    assert not torch.allclose(before[t], model.get_parameter(t)), t
    if name in NOT_READY:
        assert any(NOT_READY[name] in s["reason"] for s in rot.skipped), str(rot)
        assert any(NOT_READY[name] in sp.rotation_reason for sp in report.plan.sites)


def test_rotation_needs_folded_gamma_and_the_plan_says_so():
    model = build(EXACT, "gpt2")
    report = normswap.patch(model)  # fold_gamma=False: γ stays in the norms
    assert all("fold_gamma=True" in sp.rotation_reason for sp in report.plan.sites)
    rot = rotate(model, 0)
    assert not rot.rotated and all("fold_gamma" in s["reason"] for s in rot.skipped)


def test_explicit_q_wrong_sizes_and_non_orthogonal_q():
    model = build(EXACT, "opt")
    normswap.patch(model, fold_gamma=True)
    with pytest.raises(normswap.NormswapError, match="not orthogonal"):
        rotate(model, torch.randn(32, 32, dtype=torch.float64))
    rot = rotate(model, random_orthogonal(16))
    assert not rot.rotated and "width 32" in rot.skipped[0]["reason"]
    probe = hf_example_inputs(model, seed=2)
    with torch.no_grad(), default_dtype(torch.float64):
        ref = model(**probe).logits
        rotate(model, random_orthogonal(32, seed=9))
        out = model(**probe).logits
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-9


def test_rotating_writers_without_readers_breaks_the_model():
    """The check above can fail: the same Q on the writers alone changes the logits."""
    model = build(EXACT, "gpt2-untied")
    report = normswap.patch(model, fold_gamma=True)
    probe = hf_example_inputs(model, seed=2)
    with torch.no_grad(), default_dtype(torch.float64):
        ref = model(**probe).logits
    (group,) = streams(report.plan, model)
    q = random_orthogonal(32, seed=1)
    edits = {e.target: e for e in report.plan.writer_edits}
    with torch.no_grad():
        for t in {t for sp in group for t in sp.writer_targets}:
            p = model.get_parameter(t)
            p.copy_((p.movedim(edits[t].axis, -1) @ q).movedim(-1, edits[t].axis))
        out = model(**probe).logits
    assert float((out - ref).abs().max() / ref.abs().max()) > 1e-3


def test_custom_models_with_tied_head_per_head_norms_and_conv_patches_rotate():
    torch.manual_seed(0)
    for model, make in ((randomise_custom(TinyGPT()), lambda: torch.randint(0, 50, (2, 9))),
                        (randomise_custom(TinyViT()), lambda: torch.randn(2, 3, 32, 32, dtype=torch.float64))):
        normswap.patch(model, example_inputs=(make(),), fold_gamma=True)
        x = make()
        with torch.no_grad():
            ref = model(x)
            rot = rotate(model, 4)
            out = model(x)
        assert rot.rotated, str(rot)
        assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-9


def _logits_rotated(model, *args, **kw):
    probe = hf_example_inputs(model, seed=2)
    with torch.no_grad(), default_dtype(torch.float64):
        ref = model(**probe).logits
        rot = rotate(model, *args, **kw)
        out = model(**probe).logits
    return rot, float((out - ref).abs().max() / ref.abs().max())


def test_hadamard_rotation_is_the_default_exact_and_recorded_in_the_plan():
    model = build(EXACT, "gpt2")
    report = normswap.patch(model, fold_gamma=True)
    rot, err = _logits_rotated(model)  # q="hadamard"
    assert err <= 1e-9
    (stream,) = rot.rotated
    assert stream["kind"] == "hadamard" and stream["construction"] == "randomized Hadamard, Sylvester 32"
    assert not stream["fallback"] and stream["mean_preserving"] and not rot.fallbacks
    q = rot.matrices[stream["norms"][0]]
    assert torch.allclose(q @ q.T, torch.eye(32, dtype=torch.float64), atol=1e-12)
    assert float(q.abs().max()) * 32**0.5 < 3  # flat: a Hadamard, not a Haar matrix
    (entry,) = report.plan.rotations
    assert entry["kind"] == "hadamard" and entry["seed"] == 0 and entry["width"] == 32 and "q" not in entry
    assert Plan.from_dict(report.plan.to_dict()).rotations == report.plan.rotations
    # the manifest entry rebuilds Q
    assert torch.equal(rotation_matrix(entry["width"], entry["kind"], entry["seed"])[0], q)
    assert "rotated (hadamard)" in report.plan.summary()


def test_seed_and_random_kind_and_int_seed_agree():
    a, b = build(EXACT, "opt"), build(EXACT, "opt")
    for m in (a, b):
        normswap.patch(m, fold_gamma=True)
    ra, err = _logits_rotated(a, "random", seed=7)
    rb, _ = _logits_rotated(b, 7)
    assert err <= 1e-9
    assert torch.equal(next(iter(ra.matrices.values())), next(iter(rb.matrices.values())))
    assert ra.rotated[0]["kind"] == "random" and ra.rotated[0]["seed"] == 7


def test_hadamard_falls_back_to_random_orthogonal_and_says_so():
    import transformers as tf

    torch.manual_seed(0)
    model = randomise(tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=18, n_head=3, vocab_size=50,
                                                       n_positions=32)))
    normswap.patch(model, fold_gamma=True)
    rot, err = _logits_rotated(model, "hadamard", seed=1)
    assert err <= 1e-9
    (stream,) = rot.rotated
    assert "no Hadamard matrix of order 18" in stream["fallback"] and rot.fallbacks
    assert "random orthogonal" in str(rot)


def test_bad_rotation_arguments_are_one_line_errors():
    model = build(EXACT, "opt")
    normswap.patch(model, fold_gamma=True)
    with pytest.raises(normswap.NormswapError, match="did you mean 'hadamard'"):
        rotate(model, "hadamrd")
    with pytest.raises(normswap.NormswapError, match="seed must be an int"):
        rotate(model, "random", seed=1.5)
    with pytest.raises(normswap.NormswapError, match="q must be"):
        rotate(model, 1.5)
