"""State-space, recurrent and hybrid language models (tests/zoo.SSM): every norm gets a verdict and a
reason (gated and grouped RMS norms, xLSTM's multi-head LayerNorm), fold_gamma folds what it can
exactly in float64, RWKV's LayerNorms convert as far as one centering op allows, and a model that
rescales its own weights during forward is refused."""

import copy
import inspect

import pytest
import torch
import transformers as tf

import normswap
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.surgery.verify import compare
from tests.zoo import SSM, build, float64_casts, float64_reference


def _mamba2_formula() -> str:
    """Mamba-2's gated norm as the installed transformers computes it: 5.24 normalises each of the
    config's ``n_groups`` groups apart (its class takes ``group_size``); 5.17 normalises all features
    together whatever ``n_groups`` says."""
    grouped = "group_size" in inspect.signature(tf.models.mamba2.modeling_mamba2.MambaRMSNormGated).parameters
    return "RMSNorm of x·silu(gate)" + (" over 2 groups of 32 features" if grouped else "")


GATED = {  # entry -> (the classes its gated norm may have, formula in its skipped reason)
    "mamba2": (("MambaRMSNormGated",), _mamba2_formula()),
    "zamba2": (("Zamba2RMSNormGated",), "RMSNorm of x·silu(gate)"),
    "bamba": (("BambaRMSNormGated",), "RMSNorm of x·silu(gate)"),
    "granitemoehybrid": (("GraniteMoeHybridRMSNormGated",), "RMSNorm of x·silu(gate)"),
    # transformers 5.17 builds Nemotron-H's mixer norm from Zamba-2's class, 5.24 from its own
    "nemotron_h": (("NemotronHRMSNormGated", "Zamba2RMSNormGated"), "RMSNorm of x·silu(gate)"),
    "falcon_h1": (("FalconH1RMSNormGated",), "RMSNorm of x, times silu(gate)"),
    "qwen3_next": (("Qwen3NextRMSNormGated",), "RMSNorm of x, times silu(gate)"),
}
PER_HEAD_GATED = {"qwen3_next"}  # normalises each head's rows (γ over head_dim): its reader sees heads merged


def _build(name):
    return build({name: SSM[name][0]}, name)


def _called_norm_modules(model) -> set[str]:
    """Modules whose class is named like a norm and that ran on the example inputs."""
    ran = set()
    hooks = [m.register_forward_hook(lambda mod, a, o, _n=n: ran.add(_n)) for n, m in model.named_modules()
             if "norm" in type(m).__name__.lower()]
    with torch.no_grad(), default_dtype(torch.float64):
        model(**hf_example_inputs(model))
    for h in hooks:
        h.remove()
    return ran


@pytest.mark.parametrize("name", sorted(n for n, (_, claim) in SSM.items() if claim == "skipped"))
def test_every_norm_is_reported_and_fold_gamma_is_exact(name):
    model = _build(name)
    original = copy.deepcopy(model)
    plan = normswap.plan(model)
    assert not plan.sites, plan.table()
    reported = {s["name"]: s for s in plan.skipped}
    missing = _called_norm_modules(model) - set(reported)
    assert not missing, f"norm modules with no verdict: {sorted(missing)}"
    assert all(s["reason"] for s in reported.values())
    if name in GATED:
        classes, formula = GATED[name]
        gated = [s for s in reported.values() if s["class"] in classes]
        assert gated and all(f"already RMS-style, gated ({formula})" in s["reason"] for s in gated), gated
    if name == "xlstm":
        heads = [s for s in reported.values() if s["class"] == "xLSTMMultiHeadLayerNorm"]
        assert len(heads) == 2 and all(s["reason"].startswith("LayerNorm per head (4 heads of 8) whose output "
                                                              "flattens the heads before γ/β") for s in heads)
    report = normswap.patch(model, fold_gamma=True)
    folded = {f.norm for f in report.plan.rms_folds}
    assert folded, report.plan.table()
    if name in GATED and name not in PER_HEAD_GATED:  # γ scales the gated output per feature: it folds
        assert any(reported[n]["class"] in GATED[name][0] for n in folded)
    probe = hf_example_inputs(model, seed=17)
    with torch.no_grad(), default_dtype(torch.float64), float64_casts():
        figs = compare(original(**probe), model(**probe))
    assert figs["compared"] and figs["worst_rel_error_any_output"] <= 1e-9, figs


def test_rwkv_converts_up_to_its_one_centering_op_and_keeps_the_chain_approximate():
    model = _build("rwkv")
    original = float64_reference(model)
    plan = normswap.plan(model)
    verdicts = {s.name: s.verdict for s in plan.sites}
    assert verdicts == {"rwkv.blocks.0.pre_ln": "exact", "rwkv.blocks.0.ln1": "exact-with-centering",
                        "rwkv.blocks.0.ln2": "exact-with-centering", "rwkv.blocks.1.ln1": "approximate",
                        "rwkv.blocks.1.ln2": "approximate", "rwkv.ln_out": "approximate"}
    assert [(h.module, h.where) for h in plan.hooks] == [("rwkv.blocks.0.pre_ln", "output")]
    assert plan.site("rwkv.blocks.1.ln1").reason.startswith(
        "stream written by `mul` in `rwkv.blocks.0.feed_forward`, computed after the centering op at "
        "`rwkv.blocks.0.pre_ln` (a second op on one stream)")
    report = normswap.patch(model, mode="exact")
    probe = hf_example_inputs(model, seed=4)
    with torch.no_grad(), default_dtype(torch.float64):
        figs = compare(original(**probe), model(**probe), set(report.plan.changed_outputs))
    assert figs["worst_rel_error_any_output"] <= 1e-9
    # opting in to one op per norm makes every norm exact (LayerNorm by another name, counted apart); the
    # ops sit on the feed-forward outputs, which RWKV returns as (tensor, state) tuples
    model = _build("rwkv")
    report = normswap.patch(model, per_norm_centering=True)
    counts = report.plan.counts()
    assert counts["approximate"] == 0 and counts["exact-with-per-norm-centering"] == 3
    assert {(h.module, h.per_norm) for h in report.plan.hooks} >= {("rwkv.blocks.0.feed_forward", True)}
    with torch.no_grad(), default_dtype(torch.float64):
        figs = compare(original(**probe), model(**probe), set(report.plan.changed_outputs))
    assert figs["worst_rel_error_any_output"] <= 1e-9


def test_a_model_that_rescales_its_own_weights_during_forward_is_refused():
    """RWKV (default rescale_every=6) divides its output weights in place on its first eval forward:
    weights edited once by normswap would be divided again in the user's model."""
    torch.manual_seed(0)
    model = tf.RwkvForCausalLM(tf.RwkvConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                             attention_hidden_size=32, intermediate_size=64, context_length=64))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(normswap.NormswapError, match=r"changes parameter `.*attention\.output\.weight` in place "
                                                       r"during its forward pass \(`div_`\).*rescale_every = 0"):
        normswap.patch(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
