"""Exactness of normswap.patch on tiny random Hugging Face models, against a float64 reference."""

import copy
import warnings

import pytest
import torch
import transformers as tf
from torch import nn

import normswap
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.surgery.verify import compare
from tests.zoo import APPROXIMATE, EXACT, LLM, MORE, RMS, build, float64_reference, randomise


def _layernorms(model: nn.Module) -> list[str]:
    """nn.LayerNorms and leaf modules named like one (containers such as per-head wrappers excluded)."""
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.LayerNorm)
            or ("LayerNorm" in type(m).__name__ and "RMS" not in type(m).__name__ and not list(m.children()))]


@pytest.mark.parametrize("name", sorted(EXACT))
def test_pre_ln_models_convert_exactly(name):
    model = build(EXACT, name)
    original = float64_reference(model)
    probe = hf_example_inputs(model, seed=123)  # not the inputs the analysis ran on
    with torch.no_grad(), default_dtype(torch.float64):
        ref = original(**probe)
    report = normswap.patch(model)
    assert {s.verdict for s in report.sites} <= {"exact", "exact-with-centering"}, normswap.plan(original).table()
    assert _layernorms(model) == []
    assert any(isinstance(m, normswap.RMSNorm) for m in model.modules())
    with torch.no_grad(), default_dtype(torch.float64):
        out = model(**probe)
    figs = compare(ref, out, set(report.plan.changed_outputs))
    assert figs["compared"], "nothing compared"
    assert figs["worst_rel_error_any_output"] <= 1e-9, figs
    # patch's own figure compares with the model as it runs (some HF norms round to fp32 inside)
    assert report.verification["max_rel_error"] <= 1e-6


@pytest.mark.parametrize("name", sorted(APPROXIMATE))
def test_post_ln_models_are_flagged_and_exact_mode_keeps_them(name):
    model = build(APPROXIMATE, name)
    original = copy.deepcopy(model)
    plan = normswap.plan(model)
    approx = [s for s in plan.sites if s.verdict == "approximate"]
    assert approx, plan.table()
    assert all("Post-LN" in s.reason or "no centering point" in s.reason for s in approx)
    probe = hf_example_inputs(model, seed=7)
    with torch.no_grad(), default_dtype(torch.float64):
        ref = original(**probe)
    report = normswap.patch(model, mode="exact")
    kept = {s.name for s in approx}
    assert kept <= set(_layernorms(model))
    with torch.no_grad(), default_dtype(torch.float64):
        out = model(**probe)
    assert compare(ref, out)["worst_rel_error_any_output"] <= 1e-9
    assert report.verification.get("max_rel_error", 0.0) <= 1e-9


def test_auto_mode_converts_approximate_norms_with_a_warning_and_a_measured_error():
    model = build(APPROXIMATE, "bert")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = normswap.patch(model)
    approx = [s for s in report.sites if s.verdict == "approximate"]
    assert approx and all(s.error is not None and s.error > 0 for s in approx)
    assert any("approximately" in str(w.message) for w in caught)
    assert _layernorms(model) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_models_stay_as_close_to_float64_as_the_original(dtype):
    """The fp64 surgery is cast back once: the converted model's error vs the float64 original must be
    of the same order as the original model's own error in that dtype."""
    model64 = build(EXACT, "opt")
    probe = hf_example_inputs(model64, batch=4, seq=16, seed=11)
    with torch.no_grad():
        ref = model64(**probe).logits
    model = copy.deepcopy(model64).to(dtype)
    with torch.no_grad():
        before = float((model(**probe).logits.double() - ref).abs().max() / ref.abs().max())
    report = normswap.patch(model)
    with torch.no_grad():
        after = float((model(**probe).logits.double() - ref).abs().max() / ref.abs().max())
    assert after <= 2.0 * before + 1e-6, (before, after)
    assert report.verification["in_model_dtype"] <= 2.0 * report.verification["original_in_model_dtype"] + 1e-6


@pytest.mark.parametrize("name", sorted(MORE))
def test_more_families_reach_honest_verdicts_and_exact_mode_preserves_outputs(name):
    """Families beyond the headline list: exact ones convert fully; the others (layer scale, depthwise
    convs, feature concatenation, Post-LN) keep their approximate norms in mode='exact', outputs unchanged."""
    factory, expected = MORE[name]
    torch.manual_seed(0)
    cls, config = factory()
    model = randomise(cls(config))
    original = float64_reference(model)
    report = normswap.patch(model, mode="exact")
    verdicts = {s.verdict for s in report.sites}
    if expected == "exact":
        assert verdicts <= {"exact", "exact-with-centering"}, report.plan.table()
    elif expected == "skipped":
        assert not report.sites and report.plan.skipped
        assert all("GroupNorm" in s["reason"] or "already RMS-style" in s["reason"] for s in report.plan.skipped)
    else:
        assert "approximate" in verdicts, report.plan.table()
    probe = hf_example_inputs(model, seed=99)
    with torch.no_grad(), default_dtype(torch.float64):
        ref, out = original(**probe), model(**probe)
    assert compare(ref, out, set(report.plan.changed_outputs if report.plan else ()))["worst_rel_error_any_output"] \
        <= 1e-9


def test_verdict_policy_bert_post_ln_is_approximate_unless_per_norm_centering_is_asked():
    """The same policy as x-transformers' post-norm decoder (tests/test_patch_custom.py): a stream written
    by a norm's output needs one mean subtraction before each norm, which is counted apart and opt-in."""
    model = build(APPROXIMATE, "bert")
    original = copy.deepcopy(model)
    default = normswap.plan(model)
    post = [s for s in default.sites if "attention.output.LayerNorm" in s.name]
    assert len(post) == 2 and all(s.verdict == "approximate" and "Post-LN" in s.reason
                                  and "per_norm_centering=True" in s.reason for s in post)
    # the FFN-output norms read h + MLP(h): two added neurons cancel mean(h), so they are exact RMSNorms
    carried = [s for s in default.sites if s.name.endswith("output.LayerNorm") and "attention" not in s.name]
    assert len(carried) == 2 and all(s.verdict == "exact" and "cancelled" in s.reason for s in carried)
    assert {c.site for c in default.mean_carries} == {s.name for s in carried}
    # the word embedding is tied to the MLM decoder: the tie is kept (the default); since round 63 the tables (the
    # tied word table too) keep their rows and the embeddings' norm centers its own input, untied or not
    assert default.site("bert.embeddings.LayerNorm").verdict == "exact-with-per-norm-centering" and not default.unties
    untied = normswap.plan(model, untie=True)
    assert untied.site("bert.embeddings.LayerNorm").verdict == "exact-with-per-norm-centering" and not untied.unties
    # the MLM head's norm reads gelu(dense(x)): a stream start, one op, exact
    assert default.site("cls.predictions.transform.LayerNorm").verdict == "exact-with-centering"
    assert len(default.hooks) == 2 and [h.module for h in default.hooks if h.per_norm] == ["bert.embeddings.LayerNorm"]
    report = normswap.patch(model, per_norm_centering=True, mode="exact")
    counts = report.plan.counts()
    # the embeddings' norm alone reads the tables' stream: with the option it takes its own op and the tables (the
    # tied word table too) keep their rows (round 62); the MLM head's op stays a stream-start op
    assert counts == {**counts, "exact": 2, "exact-with-centering": 1, "exact-with-per-norm-centering": 3,
                      "approximate": 0}
    assert sum(h.per_norm for h in report.plan.hooks) == 3 and len(report.plan.hooks) == 4
    assert not report.plan.unties and not any("embeddings" in e.target for e in report.plan.writer_edits)
    probe = hf_example_inputs(model, seed=21)
    with torch.no_grad(), default_dtype(torch.float64):
        ref, out = original(**probe), model(**probe)
    assert compare(ref, out)["worst_rel_error_any_output"] <= 1e-9


def _rms_in_float64(model):
    """Already-RMS norms compute in float32 inside HF modules; the exactness claim is about the math."""
    for module in model.modules():
        name = type(module).__name__
        if "RMSNorm" in name or name == "T5LayerNorm":
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
            offset = 1.0 if "Gemma" in name else 0.0
            module.forward = lambda x, _m=module, _e=eps, _o=offset: (_o + _m.weight) * (
                x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + _e))
    return model


@pytest.mark.parametrize("name", sorted(RMS))
def test_fold_gamma_on_already_rms_models_folds_into_readers_exactly(name):
    model = build(RMS, name)
    original = copy.deepcopy(model)
    report = normswap.patch(model, fold_gamma=True)
    folds = report.plan.rms_folds
    assert folds, report.plan.table()
    assert len(folds) >= len(report.plan.skipped) - 2  # T5/Gemma: a final norm read through a scale op stays
    for rf in folds:  # effective γ is 1, and the readers changed
        assert torch.all(model.get_parameter(rf.weight) + rf.offset == 1)
        assert not torch.equal(model.get_parameter(f"{rf.readers[0]}.weight"),
                               original.get_parameter(f"{rf.readers[0]}.weight"))
    assert not normswap.patch(copy.deepcopy(original)).plan.rms_folds  # only when asked
    _rms_in_float64(model), _rms_in_float64(original)
    probe = hf_example_inputs(model, seed=8)
    with torch.no_grad(), default_dtype(torch.float64):
        figs = compare(original(**probe), model(**probe))
    assert figs["compared"] and figs["worst_rel_error_any_output"] <= 1e-9


def test_verification_reports_the_figure_each_family_compares():
    """Encoders: pooled-embedding cosine and last-hidden-state error (not only KL on pooler_output);
    classifiers: class agreement; seq2seq: encoder-state error; LMs: KL and top-1."""
    import transformers as tf

    from tests.zoo import LLM

    torch.manual_seed(0)
    encoder = randomise(tf.BertModel(tf.BertConfig(**LLM)))
    v = normswap.patch(encoder, mode="all").verification
    assert 0.9 < v["embedding_cosine"] < 1.0 and v["last_hidden_state_rel_error"] > 1e-6  # approximate, measured
    v = normswap.patch(build(EXACT, "whisper")).verification
    assert v["encoder_state_rel_error"] <= 1e-12 and v["top1_agreement"] == 1.0
    v = normswap.patch(build(EXACT, "vit")).verification
    assert v["class_agreement"] == 1.0
    v = normswap.patch(build(EXACT, "gpt2")).verification
    assert abs(v["kl"]) <= 1e-12 and v["top1_agreement"] == 1.0


@pytest.mark.parametrize("name", ["bert-decoder", "gpt2-cross-attention"])
def test_decoders_with_cross_attention_convert_their_cross_attention_norms(name):
    """Cross-attention blocks run only when given encoder states: the analysis inputs now carry them, so
    their norms are converted and checked too (before, they did not run, stayed LayerNorm and were not
    reported), and the converted decoder is exact with and without encoder states."""
    torch.manual_seed(0)
    cls, config = {
        "bert-decoder": (tf.BertLMHeadModel, tf.BertConfig(**LLM, is_decoder=True, add_cross_attention=True)),
        "gpt2-cross-attention": (tf.GPT2LMHeadModel, tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=99,
                                                                   n_positions=64, add_cross_attention=True)),
    }[name]
    model = randomise(cls(config))
    original = copy.deepcopy(model)
    report = normswap.patch(model, mode="exact")
    norms = sum(isinstance(m, nn.LayerNorm) for m in original.modules())
    assert len(report.plan.sites) == norms and not report.plan.skipped  # every norm ran and has a verdict
    assert any("cross" in s.name for s in report.plan.sites)
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    states = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for kwargs in ({"encoder_hidden_states": states}, {}):
            torch.testing.assert_close(model(input_ids=ids, **kwargs).logits,
                                       original(input_ids=ids, **kwargs).logits, rtol=1e-12, atol=1e-12)


def test_a_model_whose_only_output_is_its_raw_stream_is_verified_on_it():
    """VideoMAE's base model (mean pooling: no final norm) outputs the raw residual stream, which the
    conversion changes by design, so no output was compared and verification passed on nothing. The
    stream may differ from the original only by a per-token constant (what centering a writer
    subtracts); that is now checked (``raw_stream_rel_error``). Also: video ``pixel_values`` are
    (batch, frames, channels, H, W)."""
    torch.manual_seed(0)
    config = tf.VideoMAEConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                               image_size=32, patch_size=16, num_frames=2, tubelet_size=2)
    model = randomise(tf.VideoMAEModel(config))
    original = copy.deepcopy(model)
    report = normswap.patch(model)
    assert report.plan.changed_outputs == ["last_hidden_state"] and report.verification["compared"] == []
    assert report.verification["raw_stream_rel_error"] < 1e-12
    video = torch.randn(2, 2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = model(pixel_values=video).last_hidden_state - original(pixel_values=video).last_hidden_state
    assert float(diff.abs().max()) > 1e-3  # changed by design...
    assert float((diff - diff.mean(-1, keepdim=True)).abs().max()) < 1e-12  # ...by a per-token constant only


def test_raw_stream_error_sees_any_change_that_is_not_a_per_token_constant():
    from normswap.surgery.verify import raw_stream_error

    ref = torch.randn(2, 5, 16, dtype=torch.float64)
    shift = torch.randn(2, 5, 1, dtype=torch.float64)

    def err(out):
        return raw_stream_error({"h": ref}, {"h": out}, {"h"}, lambda t: t)["raw_stream_rel_error"]

    assert err(ref - ref.mean(-1, keepdim=True)) < 1e-15 and err(ref + shift) < 1e-15 and err(ref) == 0
    bumped = ref.clone()
    bumped[1, 2, 3] += 1e-3 * float(ref.abs().max())
    assert 0.9e-3 < err(bumped) < 1.1e-3
    assert raw_stream_error({"h": ref}, {"h": ref}, set(), lambda t: t) == {}
    from types import SimpleNamespace

    from normswap.errors import VerificationFailed
    from normswap.surgery.verify import gate

    exact = [SimpleNamespace(name="n", verdict="exact", error=0.0)]
    gate(exact, {"raw_stream_rel_error": 1e-14}, torch.float64)
    with pytest.raises(VerificationFailed, match="more than a per-token constant"):
        gate(exact, {"raw_stream_rel_error": 1e-3}, torch.float64)
    gate([SimpleNamespace(name="n", verdict="approximate", error=None)], {"raw_stream_rel_error": 1e-3},
         torch.float64)  # an approximate conversion changes the stream anyway: a figure, not a gate


def test_encoder_decoder_wrappers_take_their_inputs_from_the_sub_configs():
    """``EncoderDecoderModel`` keeps vocab sizes in ``config.encoder``/``config.decoder``: token ids drawn
    over a guessed vocabulary of 100 overflowed this one of 99 (an IndexError out of calibration)."""
    def bert(**extra):
        return tf.BertConfig(**{**LLM, "vocab_size": 40}, **extra)

    config = tf.EncoderDecoderConfig.from_encoder_decoder_configs(bert(), bert(is_decoder=True,
                                                                              add_cross_attention=True))
    config.decoder_start_token_id, config.pad_token_id = 2, 0
    torch.manual_seed(0)
    model = randomise(tf.EncoderDecoderModel(config))
    ids = hf_example_inputs(model, batch=16, seq=64)
    assert int(ids["input_ids"].max()) < 40 and int(ids["decoder_input_ids"].max()) < 40
    original = copy.deepcopy(model)
    report = normswap.patch(model)
    assert len(report.plan.sites) == 13 and not report.plan.skipped  # 5 + 8 (cross-attention included)
    exact = copy.deepcopy(original)
    normswap.patch(exact, mode="exact")
    probe = {"input_ids": ids["input_ids"][:2, :9], "decoder_input_ids": ids["decoder_input_ids"][:2, :7]}
    with torch.no_grad():
        torch.testing.assert_close(exact(**probe).logits, original(**probe).logits, rtol=1e-12, atol=1e-12)
