"""Rotation-readiness: after patch(fold_gamma=True), an orthogonal Q on every ready residual stream
(writers' outputs × Q, readers' inputs × Qᵀ, embeddings × Q) leaves the outputs unchanged in fp64.
Where a stream cannot be rotated, the plan says why."""

import pytest
import torch

import normswap
from normswap.analysis.plan import Plan
from normswap.cli.common import cli_words
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.rotation.rotate import random_orthogonal, rotate, rotation_matrix, streams
from normswap.surgery.verify import compare
from tests.custom_models import TinyGPT, TinyViT
from tests.custom_models import randomise as randomise_custom
from tests.zoo import EXACT, MORE, RMS, build, randomise

EXACT_MORE = {k: v[0] for k, v in MORE.items() if v[1] == "exact"}
# exact architectures with a stream that cannot be rotated, and the reason the plan gives
NOT_READY = {
    "m2m100": "encoder_last_hidden_state",  # one stream (shared embedding) ending in an encoder output
    "mbart": "encoder_last_hidden_state",  # the encoder's final norm output is a model output
    "whisper": "encoder_last_hidden_state",  # its encoder stream (centered after the conv stem); the decoder rotates
    "clip-text": "last_hidden_state",  # the final norm's output is a model output, not a Linear input
    "clip": "last_hidden_state",  # the text stream (the vision stream rotates)
    "pegasus": "encoder_last_hidden_state",
    "wav2vec2-stable": "not a Linear",  # feature-extractor norms feed a conv stack
    "dinov2": "`cat`",  # the classifier reads [cls, mean of patches] concatenated
    "dinov3-vit": "last_hidden_state",  # the final norm's output is a model output
    "dinov3-vit-no-value-bias": "last_hidden_state",
}
FULLY_BLOCKED = {"m2m100", "clip-text", "pegasus", "dinov2", "dinov3-vit",
                 "dinov3-vit-no-value-bias"}
# streams centered at run time (a mean subtraction where the stream starts): rotated through one op there
CENTERED_START = {"bloom": "transformer.word_embeddings_layernorm", "clip-vision": "vision_model.pre_layrnorm",
                  "clip": "vision_model.pre_layrnorm", "wav2vec2-stable": "wav2vec2.encoder.dropout",
                  "xglm": "model.embed_positions", "mbart": "model.decoder.layernorm_embedding"}


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
    figs = compare(ref, out, set(report.plan.changed_outputs))  # raw residual-stream outputs turn, by design
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
    ops = [op["module"] for r in rot.rotated for op in r["ops"]]
    if name in CENTERED_START:
        assert CENTERED_START[name] in ops, str(rot)
    else:
        assert not ops


def test_rotation_needs_folded_gamma_and_the_plan_says_so():
    model = build(EXACT, "gpt2")
    report = normswap.patch(model)  # fold_gamma=False: γ stays in the norms
    assert all("fold_gamma=True" in sp.rotation_reason for sp in report.plan.sites)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(normswap.NormswapError, match=r"without fold_gamma.*patch\(model, fold_gamma=True\)") as exc:
        rotate(model, 0)  # refused, not "0 streams rotated"
    assert "0 other stream" not in str(exc.value)  # one stream (GPT-2's): its norm alone is named
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # and nothing turned
    assert not report.plan.rotations


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


# ----------------------------------------------------------------- streams that were RMS from the start
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_models_that_are_rms_already_rotate_every_stream(name):
    model = build(RMS, name)
    report = normswap.patch(model, fold_gamma=True)
    assert not report.plan.sites and report.plan.rms_folds  # nothing converted, γ folded
    probe = hf_example_inputs(model, seed=5)
    with torch.no_grad(), default_dtype(torch.float64):
        ref = model(**probe).logits
        rot = rotate(model, "hadamard")
        out = model(**probe).logits
    (stream,) = rot.rotated
    assert len(stream["norms"]) == len(report.plan.rms_sites) == 5  # 2 layers × 2 + the final norm
    assert any("embed_tokens" in w for w in stream["writers"]) and any("lm_head" == r for r in stream["readers"])
    # the model's own RMSNorm computes in float32 whatever the input dtype: float32 rounding, not float64
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-5


def test_rms_rotation_needs_folded_gamma_and_the_check_can_fail():
    model = build(RMS, "llama")
    normswap.patch(model)  # fold_gamma=False: no LayerNorm, nothing folded, nothing to rotate
    with pytest.raises(normswap.NormswapError, match="fold_gamma=True"):
        rotate(model, "hadamard")
    model = build(RMS, "llama")
    report = normswap.patch(model, fold_gamma=True)
    probe = hf_example_inputs(model, seed=5)
    with torch.no_grad():
        ref = model(**probe).logits
        report.plan.rms_sites[0].linear_readers = []  # forget one norm's readers: the rotation breaks the model
        rotate(model, "hadamard")
        out = model(**probe).logits
    assert float((out - ref).abs().max() / ref.abs().max()) > 1e-2


def test_gemma_tied_head_keeps_gamma_and_says_why():
    model = build(RMS, "gemma")
    normswap.patch(model, fold_gamma=True)
    rot = rotate(model, "hadamard")
    assert not rot.rotated and "γ cannot fold" in rot.skipped[0]["reason"]


# ----------------------------------------------------------------- the last norm's output is the model output
def _outputs(model, probe):
    with torch.no_grad(), default_dtype(torch.float64):
        out = model(**probe)
    return {k: v for k, v in out.items() if torch.is_tensor(v) and k != "hidden_states"}


def test_backbone_output_left_alone_by_default_turned_back_with_restore_and_saved_natively(tmp_path):
    torch.manual_seed(0)
    cls, config = EXACT_MORE["dinov3-vit"]()
    model = randomise(cls(config))
    normswap.patch(model, fold_gamma=True, mode="exact")
    probe = hf_example_inputs(model, seed=5)
    ref = _outputs(model, probe)
    rot = rotate(model, "hadamard")
    assert not rot.rotated and "output='rotated' | 'restore'" in rot.skipped[0]["reason"]
    rot = rotate(model, "hadamard", output="rotated")  # the last norm keeps γ: only restore can do it
    assert not rot.rotated and "output='restore'" in rot.skipped[0]["reason"]
    rot = rotate(model, "hadamard", output="restore")
    (stream,) = rot.rotated
    assert stream["restore"] == ["norm"] and stream["outputs"] == ["last_hidden_state", "pooler_output"]
    out = _outputs(model, probe)
    for k in ref:
        assert float((out[k] - ref[k]).abs().max() / ref[k].abs().max()) <= 1e-9, k
    normswap.checkpoint.save(model, tmp_path / "ckpt")
    loaded = normswap.load(tmp_path / "ckpt").double()
    assert normswap.plan_of(loaded).rotations[0]["restore"] == ["norm"]
    again = _outputs(loaded, probe)
    for k in ref:
        assert float((again[k] - ref[k]).abs().max() / ref[k].abs().max()) <= 1e-6, k


def test_rotated_output_keeps_inner_products_and_equals_the_original_times_q():
    model = build(RMS, "llama").model  # the base model: the final norm's output is last_hidden_state
    normswap.patch(model, fold_gamma=True)
    probe = hf_example_inputs(model, seed=5)
    ref = _outputs(model, probe)["last_hidden_state"]
    rot = rotate(model, "hadamard", output="rotated")  # no reader to take the final γ: refused
    assert not rot.rotated and "keeps γ" in rot.skipped[0]["reason"]
    model = build(RMS, "llama").model
    normswap.patch(model, fold_gamma=True)
    with torch.no_grad():
        model.norm.weight.fill_(1.0)  # a unit final γ: the output can come out rotated
    ref = _outputs(model, probe)["last_hidden_state"]
    rot = rotate(model, "random", seed=2, output="rotated")
    (stream,) = rot.rotated
    assert stream["output"] == "rotated" and stream["outputs"] == ["last_hidden_state"]
    out = _outputs(model, probe)["last_hidden_state"]
    q = rot.matrices["model.layers.0.input_layernorm" if "model.layers.0.input_layernorm" in rot.matrices
                     else stream["norms"][0]]
    assert float((out - ref @ q).abs().max() / ref.abs().max()) < 1e-5
    gram = lambda t: t.flatten(0, 1) @ t.flatten(0, 1).T  # noqa: E731
    assert torch.allclose(gram(out), gram(ref), rtol=1e-5, atol=1e-5)


def test_stream_centered_at_run_time_rotates_through_one_op_that_saves_and_loads(tmp_path):
    model = build(EXACT, "bloom")
    normswap.patch(model, fold_gamma=True)
    probe = hf_example_inputs(model, seed=5)
    with torch.no_grad():
        ref = model(**probe).logits
    user = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))[0]
    rot = rotate(model, user)  # not mean-preserving: does not commute with the centering op
    assert not rot.rotated and any("mean-preserving" in s["reason"] for s in rot.skipped)
    rot = rotate(model, "hadamard")
    (stream,) = rot.rotated
    assert stream["ops"] == [{"module": "transformer.word_embeddings_layernorm", "where": "output", "arg": None}]
    with torch.no_grad():
        out = model(**probe).logits
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-9
    normswap.checkpoint.save(model, tmp_path / "ckpt")
    loaded = normswap.load(tmp_path / "ckpt").double()
    with torch.no_grad():
        again = loaded(**probe).logits
    assert float((again - ref).abs().max() / ref.abs().max()) <= 1e-9
    with pytest.raises(normswap.NormswapError, match="compat format cannot hold the rotation op") as exc:
        normswap.checkpoint.save(model, tmp_path / "compat", format="compat")
    assert not (tmp_path / "compat").exists()
    # the way out is one the caller has (no API or option rotates "without that stream"), and the
    # command line names it as its option
    assert str(exc.value).endswith("write it with format='native'")
    assert cli_words(str(exc.value)).endswith("write it with --format native")
