"""β through bias-less attention projections: dropped at keys, moved from values into the output bias,
and kept wherever the traced graph does not prove the shift harmless (normswap.analysis.attention).

Hand-written attention variants (tests/custom_models.ProjLM) for the cases that must fold and those that
must not, then the zoo families where it happens, each compared in float64 with the original. These tests
are about where β *can* go, so they convert with ``beta_placement="fold"``; where it *should* go (the
bf16 rounding rule, which may keep a foldable β in the norm) is tests/surgery/test_beta_placement.py."""

import copy

import pytest
import torch

import normswap
from normswap.analysis.attention import AttentionProofs, Route
from normswap.analysis.plan import Plan
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.surgery.verify import compare
from tests.custom_models import ProjLM, randomise
from tests.zoo import EXACT, MORE, build

IDS = (torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(0)),)

# attention variant -> (routes of layer 0's k and v projections, what the kept reason names)
FOLDS = {
    "sdpa, key without bias": (dict(k_bias=False), {"k": "dropped", "v": "bias"}),
    "eager, key without bias": (dict(k_bias=False, eager=True), {"k": "dropped", "v": "bias"}),
    "eager, key without bias, cache": (dict(k_bias=False, eager=True, use_cache=True),
                                       {"k": "dropped", "v": "bias"}),
    "sdpa, value without bias": (dict(v_bias=False), {"k": "bias", "v": "moved"}),
    "eager, value without bias": (dict(v_bias=False, eager=True), {"k": "bias", "v": "moved"}),
    "sdpa, grouped kv, neither bias": (dict(k_bias=False, v_bias=False, kv_heads=2),
                                       {"k": "dropped", "v": "moved"}),
    "eager, grouped kv, neither bias, cache": (dict(k_bias=False, v_bias=False, kv_heads=2, eager=True,
                                                    use_cache=True), {"k": "dropped", "v": "moved"}),
}
KEEPS = {
    # the walk stops at the first op it cannot account for: rotate_half's negation, then the cos/sin products
    "rotary keys": (dict(k_bias=False, rope=True), "`blocks.0.attn.k` has no bias slot and its output reaches `neg`"),
    "k-norm": (dict(k_bias=False, k_norm=True), "reaches `layer_norm` in `blocks.0.attn.k_norm`"),
    "sink logit (keys)": (dict(k_bias=False, sink=True), "the scores pass through `cat`"),
    "sink logit (values)": (dict(v_bias=False, sink=True), "come from `__getitem__`, not a softmax"),
    "soft-capped scores": (dict(k_bias=False, softcap=5.0), "the scores pass through `tanh`"),
    "output projection without bias": (dict(v_bias=False, o_bias=False),
                                       "`blocks.0.attn.o` reads the attention output but has no bias slot"),
    "query without bias": (dict(q_bias=False, eager=True), "its output is the first operand of `matmul`"),
    "query without bias (sdpa)": (dict(q_bias=False), "its output is the query of `scaled_dot_product_attention`"),
}


def _model(**kwargs) -> ProjLM:
    torch.manual_seed(0)
    return randomise(ProjLM(**kwargs))


def _patched_error(model, **options) -> tuple[float, normswap.pipeline.Report]:
    original = copy.deepcopy(model)
    report = normswap.patch(model, example_inputs=IDS, mode="exact", **{"beta_placement": "fold", **options})
    x = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(5))  # unseen inputs
    with torch.no_grad():
        ref, out = original(x), model(x)
    return float((out - ref).abs().max() / ref.abs().max()), report


def _routes(plan: Plan, site: str = "blocks.0.n1") -> dict[str, str]:
    return {f.reader.rsplit(".", 1)[-1]: f.beta_route for f in plan.folds if f.site == site}


@pytest.mark.parametrize("case", sorted(FOLDS))
@pytest.mark.parametrize("fold_gamma", [False, True])
def test_beta_leaves_the_norm_through_bias_less_keys_and_values_exactly(case, fold_gamma):
    kwargs, expected = FOLDS[case]
    model = _model(**kwargs)
    plan = normswap.plan(model, IDS, fold_gamma=fold_gamma, beta_placement="fold")
    for site in ("blocks.0.n1", "blocks.1.n1"):
        sp = plan.site(site)
        assert sp.fold_beta, sp.beta_detail
        routes = _routes(plan, site)
        assert {k: routes[k] for k in expected} == expected and routes["q"] == "bias"
        if "dropped" in routes.values():
            assert "dropped at `" + site.replace("n1", "attn.k") + "` (keys: softmax" in sp.beta_detail
    moves = {m.reader: m for m in plan.beta_moves}
    if expected["v"] == "moved":
        m = moves["blocks.0.attn.v"]
        assert (m.site, m.into, m.kind) == ("blocks.0.n1", "blocks.0.attn.o", "linear")
        # grouped kv: output heads 0,1 carry kv head 0 and heads 2,3 kv head 1 (head dim 8); runs merge
        # where both sides continue (o 8..23 <- v 0..15)
        assert m.runs == ([(0, 0, 8), (8, 0, 16), (24, 8, 8)] if kwargs.get("kv_heads") else [(0, 0, 32)])
        assert "moved from `blocks.0.attn.v` into the bias of `blocks.0.attn.o`" in plan.site("blocks.0.n1").beta_detail
    else:
        assert not plan.beta_moves
    err, report = _patched_error(model, fold_gamma=fold_gamma)
    assert err <= 1e-9, (err, report.plan.table(width=None))
    for site in ("blocks.0.n1", "blocks.1.n1"):
        norm = model.get_submodule(site)
        assert isinstance(norm, normswap.RMSNorm) and norm.bias is None  # no bias add left in the norm
        assert not fold_gamma or bool((norm.weight == 1).all())


@pytest.mark.parametrize("case", sorted(KEEPS))
def test_beta_stays_in_the_norm_where_the_graph_does_not_prove_the_shift_harmless(case):
    kwargs, why = KEEPS[case]
    model = _model(**kwargs)
    plan = normswap.plan(model, IDS, beta_placement="fold")
    sp = plan.site("blocks.0.n1")
    assert not sp.fold_beta and sp.beta_detail.startswith("kept in the RMSNorm: "), sp.beta_detail
    assert why in sp.beta_detail, sp.beta_detail
    assert not plan.beta_moves and not any(f.beta_route in ("dropped", "moved") for f in plan.folds)
    err, _ = _patched_error(model)
    assert err <= 1e-9
    assert model.get_submodule("blocks.0.n1").bias is not None


@pytest.mark.parametrize("case, route", [("rotary keys", "dropped"), ("sink logit (keys)", "dropped"),
                                         ("soft-capped scores", "dropped"), ("sink logit (values)", "moved")])
def test_forcing_the_fold_where_the_proof_refuses_breaks_the_model(case, route, monkeypatch):
    """The refusals above matter: dropping or moving β there anyway changes the outputs, and the
    verification gate refuses the conversion (the model is left untouched)."""
    kwargs, _ = KEEPS[case]
    model = _model(**kwargs)
    real = AttentionProofs.route

    def forced(self, path):
        r = real(self, path)
        if r.how != "kept" or not path.endswith((".k", ".v")):
            return r
        if route == "dropped":
            return Route("dropped", "forced")
        return Route("moved", "forced", path[:-1] + "o", "linear", [(0, 0, 32)])

    monkeypatch.setattr(AttentionProofs, "route", forced)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(normswap.NormswapError, match="verification failed"):
        normswap.patch(model, example_inputs=IDS, mode="exact", beta_placement="fold")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# zoo families (test expectations, not the mechanism): layer norms whose β leaves through a bias-less
# key or value projection, and families where rotary keys keep it
ZOO_ROUTES = {
    "whisper": ("self_attn_layer_norm", "dropped", 4),  # k_proj has no bias; no rotary
    "beit-layerscale": ("layernorm_before", "dropped", 2),  # relative position bias is added to the scores
    "data2vec-vision": ("layernorm_before", "dropped", 2),
    "dinov3-vit-no-value-bias": ("norm1", "moved", 2),  # value_bias=False, key_bias=True
}
ZOO_KEEPS = {
    "dinov3-vit": "reaches `mul`",  # key_bias=False but RoPE on the patch keys
    "gptj": "reaches `mul`",
    "nemotron": "reaches `mul`",
    "gpt_neo": "its output is the first operand of `matmul`",  # q_proj has no bias either
}


def _zoo(name):
    if name in EXACT:
        return build(EXACT, name)
    return build({name: MORE[name][0]}, name)


@pytest.mark.parametrize("name", sorted(ZOO_ROUTES))
def test_zoo_families_lose_the_norm_bias_through_keys_or_values(name):
    suffix, route, count = ZOO_ROUTES[name]
    model = _zoo(name)
    original = copy.deepcopy(model)
    report = normswap.patch(model, beta_placement="fold")
    sites = [s for s in report.plan.sites if s.name.endswith(suffix)]
    assert len(sites) == count and all(s.fold_beta and not s.rms_bias for s in sites), report.plan.table(width=None)
    routed = [f for f in report.plan.folds if f.beta_route == route]
    assert len(routed) == count and {f.site for f in routed} == {s.name for s in sites}
    assert len(report.plan.beta_moves) == (count if route == "moved" else 0)
    probe = hf_example_inputs(model, seed=31)
    with torch.no_grad(), default_dtype(torch.float64):
        figs = compare(original(**probe), model(**probe), set(report.plan.changed_outputs))
    assert figs["compared"] and figs["worst_rel_error_any_output"] <= 1e-9


@pytest.mark.parametrize("name", sorted(ZOO_KEEPS))
def test_zoo_families_with_rotary_keys_keep_the_norm_bias(name):
    plan = normswap.plan(_zoo(name), beta_placement="fold")
    kept = [s for s in plan.sites if s.beta_detail.startswith("kept in the RMSNorm: `")
            and ("k_proj" in s.beta_detail or "q_proj" in s.beta_detail)]
    assert kept and all(ZOO_KEEPS[name] in s.beta_detail for s in kept), plan.table(width=None)
    assert not any(f.beta_route in ("dropped", "moved") for f in plan.folds if f.site in {s.name for s in kept})


def test_a_norm_whose_beta_leaves_becomes_rotation_ready_even_with_a_near_zero_gamma():
    """With β kept in the norm, fold_gamma must keep β/γ there, which a near-zero γ entry forbids; once β
    leaves through the keys and values, γ folds and the stream rotates."""
    from normswap.rotation.rotate import rotate

    for kwargs, slots, ready in ((dict(k_bias=False, v_bias=False, kv_heads=2), True, True),
                                 (dict(k_bias=False, v_bias=False, kv_heads=2, rope=True), False, False),
                                 # the rotary key projection gets a bias slot of its own (plan.BiasSlot)
                                 (dict(k_bias=False, v_bias=False, kv_heads=2, rope=True), True, True)):
        model = _model(**kwargs)
        with torch.no_grad():
            for block in model.blocks:
                block.n1.weight[3] = 1e-6
        report = normswap.patch(model, example_inputs=IDS, fold_gamma=True, bias_slots=slots)
        sp = report.plan.site("blocks.0.n1")
        assert sp.rotation_ready is ready, sp.rotation_reason
        assert bool(report.plan.bias_slots) is ("rope" in kwargs and slots)
        if not ready:
            assert "β cannot fold" in sp.rotation_reason and "some γ is near 0" in sp.rotation_reason
            continue
        x = IDS[0]
        with torch.no_grad(), default_dtype(torch.float64):
            ref = model(x)
            rot = rotate(model, 7)
            out = model(x)
        assert rot.rotated and not rot.skipped, str(rot)
        assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-9
