"""Readers of approximate norms made blind to the mean an RMSNorm leaks (plan.CenteredReader).

An RMSNorm standing in for a LayerNorm whose input has mean ``m`` outputs ``(σ/rms)·u + (m/rms)·1``
where the LayerNorm gives ``u``: to first order the error is one direction. The edit
``W' = W·diag(γ)·P·diag(1/γ)``, ``c' = c + (W − W')β`` changes nothing on a LayerNorm output (exact
in float64 on the original model) and removes that direction from what the reader sees.
"""

import copy
import warnings

import pytest
import torch

import normswap
from normswap.analysis import planner
from normswap.analysis.plan import Plan
from normswap.inputs import hf_example_inputs
from normswap.surgery import edits
from normswap.surgery.verify import compare
from tests.custom_models import PostLNEncoder, randomise
from tests.zoo import APPROXIMATE, build


def _convert(model, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return normswap.patch(model, mode="all", allow_unusable=True, **options)


@pytest.mark.parametrize("name", sorted(APPROXIMATE))
def test_the_edit_is_exact_on_the_layernorm_model(name):
    model = build(APPROXIMATE, name)
    plan = normswap.plan(model, mode="all")
    assert plan.centered_readers, "every Post-LN zoo model has an approximate norm with a Linear reader"
    probe = hf_example_inputs(model, batch=4, seq=16, seed=5)
    with torch.no_grad():
        ref = model(**probe)
    edited = copy.deepcopy(model)  # LayerNorms kept: only the reader edits (and the unties they rely on)
    for u in plan.unties:
        edits.untie(edited, u)
    for r in plan.centered_readers:
        norm = edited.get_submodule(r.site)
        edits.center_reader(edited, r, norm.weight.detach().double(), norm.bias.detach().double())
    with torch.no_grad():
        out = edited(**probe)
    assert compare(ref, out)["max_rel_error"] < 1e-9


@pytest.mark.parametrize(("name", "reader"), [("bert", "bert.encoder.layer.0.intermediate.dense"),
                                              ("distilbert", "distilbert.transformer.layer.0.ffn.lin1"),
                                              ("opt-post-ln", "model.decoder.layers.0.fc1")])
def test_the_reader_no_longer_sees_the_leaked_mean(name, reader, monkeypatch):
    """The first reader after an approximate norm (γ/β copied, no calibration): its output error
    against the original drops by an order of magnitude with the edit."""
    model = build(APPROXIMATE, name)
    probe = hf_example_inputs(model, batch=4, seq=16, seed=5)

    def reader_output(m):
        got = {}
        width = model.get_submodule(reader).out_features  # the MLP may be wider after a mean carry
        hook = m.get_submodule(reader).register_forward_hook(lambda mod, a, o: got.update(o=o[..., :width].clone()))
        with torch.no_grad():
            m(**probe)
        hook.remove()
        return got["o"]

    ref = reader_output(model)
    with_edit = copy.deepcopy(model)
    report = _convert(with_edit, calibration=False)
    assert reader in {r.reader for r in report.plan.centered_readers}
    monkeypatch.setattr(planner, "_centered_readers", lambda *a, **k: [])
    without = copy.deepcopy(model)
    assert not _convert(without, calibration=False).plan.centered_readers

    def err(m):
        out = reader_output(m)
        return float((out - ref).norm() / ref.norm())

    assert err(with_edit) < err(without) / 10, (err(with_edit), err(without))


def test_only_converted_approximate_norms_get_the_edit():
    model = build(APPROXIMATE, "bert")
    assert not normswap.plan(model, mode="exact").centered_readers
    sites = {r.site for r in normswap.plan(model, mode="all").centered_readers}
    verdicts = {s.name: s.verdict for s in normswap.plan(model, mode="all").sites}
    assert sites and all(verdicts[s] == "approximate" for s in sites)


def test_a_tied_or_bias_less_reader_is_left_alone():
    """A head tied to the embedding reads an approximate norm: with untie=False the edit would change the
    embedding too, so it is left alone; a reader without a bias slot cannot take the β correction.
    (RoBERTa's MLM decoder was the tied case until its head norm, after a GELU written as a function,
    became exact-with-centering: tests/test_third_party_patterns.py.)"""
    model = PostLNEncoder()
    model.head.weight = model.tok.weight
    model, ids = randomise(model), (torch.randint(0, 40, (2, 9)),)
    untied = {r.reader for r in normswap.plan(model, ids, mode="all", mean_carry=False).centered_readers}
    tied = {r.reader for r in normswap.plan(model, ids, mode="all", mean_carry=False, untie=False).centered_readers}
    assert "head" in untied and "head" not in tied
    model = build(APPROXIMATE, "bert")
    reader = model.bert.encoder.layer[0].intermediate.dense
    reader.bias = None
    readers = {r.reader for r in normswap.plan(model, mode="all").centered_readers}
    assert "bert.encoder.layer.0.intermediate.dense" not in readers
    assert "bert.encoder.layer.1.intermediate.dense" in readers


def test_patched_model_records_the_edit_and_commits_it():
    model = build(APPROXIMATE, "bert")
    original = copy.deepcopy(model)
    report = _convert(model)
    assert report.plan.centered_readers
    for r in report.plan.centered_readers:  # the user's model holds the edited reader, not the original
        assert not torch.equal(model.get_submodule(r.reader).weight[: original.get_submodule(r.reader).out_features],
                               original.get_submodule(r.reader).weight)
    assert "blind to the leaked mean" in report.plan.summary()
    again = Plan.from_dict(report.plan.to_dict())
    assert again.centered_readers == report.plan.centered_readers
