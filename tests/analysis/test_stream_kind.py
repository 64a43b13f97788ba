"""``SitePlan.stream_kind``: what each norm's input stream carries besides writers (``writers``, ``norm-start``,
``post-ln``), found from the traced stream's terms, the same whatever the options and the verdict, and what
``quantizer=`` reads a model's kind from (:func:`normswap.quantizers.model_kind`), never a reason's words.

Tiny random models (γ/β randomised by the zoo); a BERT planned three ways (mean carry, approximate, per-norm ops);
a constructed Post-LN model whose reasons never say "(Post-LN)"; the manifest, with a checkpoint whose manifest has
no ``stream_kind`` (as every checkpoint before round 61) loaded back.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

import normswap
from normswap import quantizers
from normswap.analysis.plan import STREAM_KINDS, Plan
from tests.zoo import APPROXIMATE, EXACT, MORE, build

BERT_BLOCK_NORMS = ("attention.output.LayerNorm", "output.LayerNorm")


def _plan(model: nn.Module, *args: object, **options: object) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return normswap.plan(model, *args, **options)


def _kinds(plan: Plan) -> dict[str, str]:
    return {sp.name: sp.stream_kind for sp in plan.sites}


@pytest.fixture(scope="module")
def bert() -> nn.Module:
    return build(APPROXIMATE, "bert")


@pytest.fixture(scope="module")
def bert_plans(bert: nn.Module) -> dict[str, Plan]:
    """BERT's FFN-output norms exact by a mean carry (the defaults), every block norm approximate
    (``mean_carry=False``), every block norm exact by an op before it (``per_norm_centering=True``)."""
    return {"carry": _plan(bert), "approximate": _plan(bert, mean_carry=False),
            "per-norm": _plan(bert, per_norm_centering=True, mean_carry=False)}


def test_a_post_ln_norm_is_post_ln_whatever_its_verdict(bert_plans):
    carry, approximate, per_norm = bert_plans["carry"], bert_plans["approximate"], bert_plans["per-norm"]
    block = [sp.name for sp in carry.sites if sp.name.endswith(BERT_BLOCK_NORMS)]
    assert len(block) == 4, carry.table()
    # three verdicts for the same norms ...
    assert carry.mean_carries and {carry.site(n).verdict for n in block} == {"exact", "approximate"}, carry.table()
    assert not approximate.mean_carries and {approximate.site(n).verdict for n in block} == {"approximate"}
    assert {per_norm.site(n).verdict for n in block} == {"exact-with-per-norm-centering"}, per_norm.table()
    # ... one stream kind: every block norm reads the last norm's output; the embedding norm reads writers
    assert _kinds(carry) == _kinds(approximate) == _kinds(per_norm)
    assert {n: k for n, k in _kinds(carry).items() if k == "post-ln"} == dict.fromkeys(block, "post-ln")
    assert _kinds(carry)["bert.embeddings.LayerNorm"] == "writers"
    assert {quantizers.model_kind(p) for p in bert_plans.values()} == {"post-ln"}


def test_a_real_post_ln_norm_keeps_its_kind_when_its_reason_stops_saying_post_ln():
    """DeBERTa-v2's first attention-output norm reads the embedding norm's output through the padding mask's
    ``mul``: with ``untie=True`` and its tables centered its reason reads "stream starts at ... output; no
    centering point feeds only norms" (the words a Pre-LN stream start gets), with the defaults "(Post-LN)". Same
    stream, same kind. (Since round 63 the defaults keep the tables behind an op on the embeddings' norm's input,
    which makes that reason "(Post-LN)" too; with γ folded they keep their edit, as round 62's defaults had it, and
    the second plan folds γ to keep a reason that does not say so.)"""
    model = build(APPROXIMATE, "deberta-v2")
    name = "deberta.encoder.layer.0.attention.output.LayerNorm"
    plans = [_plan(model)]
    assert "(Post-LN)" in _plan(model, untie=True, mean_carry=False).site(name).reason
    plans.append(_plan(model, untie=True, mean_carry=False, fold_gamma=True))
    assert "(Post-LN)" in plans[0].site(name).reason
    assert plans[1].site(name).reason.startswith("stream starts at `deberta.embeddings.LayerNorm` output; no centering")
    assert {p.site(name).verdict for p in plans} == {"approximate"}
    assert _kinds(plans[0]) == _kinds(plans[1]) and plans[0].site(name).stream_kind == "post-ln"


def test_pre_ln_and_layer_scale_streams_carry_writers_and_a_norm_started_stream_is_pre_ln():
    gpt2 = _plan(build(EXACT, "gpt2"))
    assert set(_kinds(gpt2).values()) == {"writers"} and quantizers.model_kind(gpt2) == "pre-ln"
    dinov2 = _plan(build({"dinov2": MORE["dinov2"][0]}, "dinov2"))
    assert set(_kinds(dinov2).values()) == {"writers"} and quantizers.model_kind(dinov2) == "layer-scale"
    # BLOOM's embedding LayerNorm starts the stream every other norm reads: one op there, Pre-LN
    bloom_model = build(EXACT, "bloom")
    bloom = _plan(bloom_model)
    kinds = _kinds(bloom)
    assert kinds.pop("transformer.word_embeddings_layernorm") == "writers"
    assert set(kinds.values()) == {"norm-start"} and quantizers.model_kind(bloom) == "pre-ln"
    assert _kinds(_plan(bloom_model, per_norm_centering=True, mean_carry=False)) == _kinds(bloom)
    assert set(STREAM_KINDS) == {"writers", "norm-start", "post-ln"}


class _TanhBlock(nn.Module):
    """A Post-LN block whose branches end in a ``tanh`` (no Linear writer, no MLP to carry a mean): the stream
    each norm reads is the last norm's output plus a branch computed from it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.n1, self.b, self.n2 = nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.n1(torch.tanh(self.a(x)) + x)
        return self.n2(torch.tanh(self.b(x)) + x)


class _TanhPostLN(nn.Module):
    def __init__(self, d: int = 8, vocab: int = 20, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_TanhBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_post_ln_model_whose_reasons_never_say_post_ln_is_found_post_ln():
    """Each norm's reason speaks of its first problem term, the ``tanh`` branch, so no reason says "(Post-LN)" and
    no MLP carries a mean: the round-60 test (a mean carry, or an approximate norm whose reason says "(Post-LN)")
    read this Post-LN model as Pre-LN, and ``quantizer=`` gave it the Pre-LN options. The field reads the stream."""
    torch.manual_seed(0)
    model = _TanhPostLN()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("n1.weight", "n2.weight")):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("n1.bias", "n2.bias")):
                p.normal_(0, 0.3)
    model = model.double().eval()
    ids = (torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(1)),)
    plan = _plan(model, ids)
    assert {sp.verdict for sp in plan.sites} == {"approximate"}, plan.table()
    assert not plan.mean_carries and not any("(Post-LN)" in sp.reason for sp in plan.sites), plan.table()
    assert _kinds(plan) == {"blocks.0.n1": "writers", "blocks.0.n2": "post-ln", "blocks.1.n1": "post-ln",
                            "blocks.1.n2": "post-ln"}
    assert quantizers.model_kind(plan) == "post-ln"
    # the engine then plans it with the Post-LN options, which make every norm exact
    ops = _plan(model, ids, quantizer="onnxruntime-dynamic")
    assert ops.options["quantizer"]["model"] == "post-ln" and _kinds(ops) == _kinds(plan)
    assert all(sp.verdict.startswith("exact") for sp in ops.sites if sp.stream_kind == "post-ln"), ops.table()
    # and the kind shows in inspect's verbose table
    verbose = plan.table(None, verbose=True)
    assert "blocks.1.n1 (approximate, eps=1e-05, shape=[8], standard, stream: post-ln)" in verbose


def test_the_manifest_records_the_field_and_a_checkpoint_without_it_still_loads(bert, bert_plans, tmp_path):
    """``Plan.to_dict`` writes ``stream_kind`` per norm; a manifest without it (every checkpoint written before round
    61) loads as before, its norms' kind unknown (``""``), which ``model_kind`` refuses rather than reads as Pre-LN."""
    plan = bert_plans["per-norm"]
    data = json.loads(json.dumps(plan.to_dict()))
    assert {s["name"]: s["stream_kind"] for s in data["sites"]} == _kinds(plan)
    assert _kinds(Plan.from_dict(data)) == _kinds(plan)

    model = copy.deepcopy(bert)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(model, per_norm_centering=True, mean_carry=False)  # exact: no calibration
        normswap.save(model, tmp_path / "ckpt")
    config = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(config.read_text())
    sites = cfg["normswap"]["plan"]["sites"]
    assert {s["name"]: s["stream_kind"] for s in sites} == _kinds(plan)
    for s in sites:  # the manifest as round 60 wrote it
        del s["stream_kind"]
    config.write_text(json.dumps(cfg, indent=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = normswap.load(tmp_path / "ckpt", torch_dtype=torch.float64)
    old = normswap.plan_of(loaded)
    assert {sp.stream_kind for sp in old.sites} == {""} and [sp.verdict for sp in old.sites] == \
        [sp.verdict for sp in plan.sites]
    with pytest.raises(ValueError, match="before round 61"):
        quantizers.model_kind(old)
    ids = torch.randint(1, 99, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, loaded(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-9 * want.abs().max()


def test_inspect_says_the_kind_found_and_each_norms_stream_kind():
    from click.testing import CliRunner

    from normswap.cli import main

    res = CliRunner().invoke(main, ["inspect", "tiny-bert", "--quantizer", "openvino-int8", "-v"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.stderr
    out = " ".join(res.stdout.split())
    assert "quantizer: openvino-int8 on a Post-LN encoder model: set --per-norm-centering --no-mean-carry" in out
    assert "bert.encoder.layer.0.attention.output.LayerNorm (exact-with-per-norm-centering, eps=1e-12, " \
           "shape=[64], standard, stream: post-ln)" in out
    # the embeddings' norm reads the tables' stream alone: its own op, the tables (the tied word table too) kept
    assert "bert.embeddings.LayerNorm (exact-with-per-norm-centering, eps=1e-12, shape=[64], standard, " \
           "stream: writers)" in out
