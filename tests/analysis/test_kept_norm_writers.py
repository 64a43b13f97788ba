"""A writer whose streams only norms kept as LayerNorm read keeps the original's weights (round 65).

``mode="exact"`` leaves a Post-LN encoder's approximate norms as the original's ``nn.LayerNorm``, and
``LayerNorm(x − mean x) = LayerNorm(x)``: centering the writers of their streams buys nothing, yet it moved every
row's range of 50 writer tensors on all-mpnet-base-v2 (NNCF int8 weights 1.056× the original's error,
docs/results/quantization.md). On tiny BERT / MPNet / RoBERTa replicas (LayerNorm γ/β and biases randomised,
float64): those writers stay bit for bit the original's, with and without the mean carry (whose ``down`` is still
centered: the exact norm it serves reads its stream), the model equals the original (every output), and the
in-memory, compat and streamed (``low_memory``) conversions write the same tensors. A Pre-LN model (GPT-2)
and ``mode="all"`` plan the writer edits they did before.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

import normswap
from normswap import presets
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.surgery.verify import compare
from tests.streaming_models import written_tensors
from tests.zoo import APPROXIMATE, EXACT, build

FAMILIES = ["bert", "mpnet", "roberta"]


def _encoder_writers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The encoder's Linear weights and biases but the norms' (the writers and readers of its streams)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if ".encoder." in n and "LayerNorm" not in n and "layer_norm" not in n}


def _fp64_error(original: torch.nn.Module, model: torch.nn.Module) -> float:
    probe = hf_example_inputs(model, seed=5)
    with torch.no_grad(), default_dtype(torch.float64):
        out_a = original(**probe, output_hidden_states=True)
        out_b = model(**probe, output_hidden_states=True)
        return compare(out_a, out_b)["worst_rel_error_any_output"]


@pytest.mark.parametrize("name", FAMILIES)
def test_no_carry_keeps_every_encoder_writer(name):
    """``mode="exact", mean_carry=False``: only the embedding norm (and the head's) convert; no encoder writer
    is edited, and every output, the hidden states included, equals the original's in float64."""
    model = build(APPROXIMATE, name).double()
    original = copy.deepcopy(model)
    before = _encoder_writers(model)
    report = normswap.patch(model, options=normswap.ConvertOptions(mode="exact", mean_carry=False))
    plan = report.plan
    kept = [sp for sp in plan.sites if not sp.convert]
    assert len(kept) == 4 and all(sp.verdict == "approximate" for sp in kept), plan.table()
    assert not [e.target for e in plan.writer_edits if ".encoder." in e.target], plan.writer_edits
    assert all(not sp.writer_targets for sp in kept)
    after = _encoder_writers(model)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(before) >= 16 and not changed, changed
    assert _fp64_error(original, model) <= 1e-9


@pytest.mark.parametrize("name", FAMILIES)
def test_carry_keeps_the_attention_writers_and_centers_its_down(name):
    """With the carry the FFN-output norms are exact and convert: their stream's writer (the carry's ``down``)
    stays centered; the attention output projection, read only by the kept attention-output norm, does not."""
    model = build(APPROXIMATE, name).double()
    original = copy.deepcopy(model)
    before = _encoder_writers(model)
    report = normswap.patch(model, options=normswap.ConvertOptions(mode="exact"))
    plan = report.plan
    carries = plan.mean_carries
    assert len(carries) == 2, plan.table()
    after = dict(model.named_parameters())
    widened = tuple(f"{m}." for c in carries for m in (c.up, c.down))
    unwidened = [n for n in before if not n.startswith(widened)]
    assert len(unwidened) >= 8
    changed = [n for n in unwidened if not torch.equal(before[n], after[n])]
    assert not changed, changed
    targets = {e.target for e in plan.writer_edits}
    for c in carries:
        down = f"{c.down}.weight"
        assert down in targets
        w = after[down].detach()[:, :before[down].shape[1]]  # the original columns (the carry's own come after)
        assert not torch.equal(w, before[down])
        assert float(w.mean(0).abs().max()) <= 1e-12 * float(w.abs().max())  # centered: zero-mean columns
    assert _fp64_error(original, model) <= 1e-9


def test_pre_ln_plans_the_same_writer_edits_in_every_mode():
    """GPT-2: every norm is exact, so ``mode="exact"`` converts them all and keeps every writer edit: the same
    edits, ops and changed outputs as ``mode="all"`` (every c_proj centered)."""
    plans = {mode: normswap.plan(build(EXACT, "gpt2"), mode=mode) for mode in ("exact", "all")}
    edits = {mode: [(e.target, e.axis, e.blocks) for e in p.writer_edits] for mode, p in plans.items()}
    assert edits["exact"] == edits["all"]
    assert len(edits["exact"]) >= 2 * 2 * 2  # attn/mlp c_proj weight + bias per layer
    assert plans["exact"].changed_outputs == plans["all"].changed_outputs
    assert [h.place() for h in plans["exact"].hooks] == [h.place() for h in plans["all"].hooks]


def test_mode_all_still_centers_the_approximate_norms_writers():
    """``mode="all"`` converts the approximate norms too: their writers stay centered, as before."""
    plan = normswap.plan(build(APPROXIMATE, "bert"), mode="all", mean_carry=False)
    targets = {e.target for e in plan.writer_edits}
    for layer in (0, 1):
        for w in ("attention.output.dense", "output.dense"):
            assert f"bert.encoder.layer.{layer}.{w}.weight" in targets
    assert all(sp.convert for sp in plan.sites)


def test_deferred_approximate_norms_keep_their_writers_centered():
    """``defer_approximate`` (the fine-tune recipe's progressive schedule: ``mode="exact"`` now, the approximate
    norms swapped later): the writers are planned as under ``mode="all"`` while only the exact norms convert, and
    the model still equals the original in float64 (a LayerNorm ignores its input's mean)."""
    model = build(APPROXIMATE, "bert").double()
    original = copy.deepcopy(model)
    report = normswap.patch(model, options=normswap.ConvertOptions(mode="exact", defer_approximate=True))
    every = normswap.plan(build(APPROXIMATE, "bert"), mode="all")
    assert sorted(e.target for e in report.plan.writer_edits) == sorted(e.target for e in every.writer_edits)
    assert [sp.name for sp in report.plan.sites if not sp.convert]  # the approximate ones wait for their swap
    assert _fp64_error(original, model) < 1e-9
    with pytest.raises(normswap.NormswapError, match="defer_approximate applies to mode='exact'"):
        normswap.ConvertOptions(mode="all", defer_approximate=True)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    cls, config = tf.BertForMaskedLM, tf.BertConfig(hidden_size=32, num_hidden_layers=5, num_attention_heads=4,
                                                    intermediate_size=64, vocab_size=99, max_position_embeddings=64,
                                                    pad_token_id=0)
    torch.manual_seed(0)
    model = presets.randomise_norms(cls(config)).eval()
    out = tmp_path_factory.mktemp("kept") / "bert"
    model.save_pretrained(out, max_shard_size="40KB")
    return out, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fmt,low_memory", [("native", False), ("native", True), ("compat", False)])
def test_checkpoints_keep_the_encoder_writers(bert_dir, tmp_path, fmt, low_memory):
    """The in-memory, streamed and compat conversions with ``mode="exact", mean_carry=False`` write every encoder
    writer as the original's (the streamed plan, made on a shallower proxy, plans identically)."""
    src, original = bert_dir
    out = tmp_path / "o"
    normswap.convert(src, out, format=fmt, low_memory=low_memory, mode="exact", mean_carry=False)
    written = {k.split(":", 1)[1]: t for k, t in written_tensors(out).items() if k.startswith(":")}
    encoder = [n for n in original if ".encoder." in n and "LayerNorm" not in n]
    assert len(encoder) >= 40
    changed = [n for n in encoder if not torch.equal(written[n], original[n])]
    assert not changed, changed
