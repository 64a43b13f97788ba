"""PEFT adapters on the Linears the conversion edited act as the same adapter on the original model (round 54).

The conversion folds a norm's β into its readers' biases (and γ into their weights where asked), and centers a
writer's output rows, with a LayerScale λ folded in and rows balanced back into λ. A LoRA on such a Linear read
the input without β (and γ) and wrote an output the writer's rows no longer match: on a tiny GPT-2 the logits of
the same random LoRA differed by 0.40 (c_attn) to 0.07 (mlp.c_proj) against an adapter effect of 0.6-1.0. Since
round 54 the Linear carries an :class:`normswap.rotation.carry.AdapterBasis` from the plan's ``adapter_bases``
(so also after ``normswap.save`` / ``normswap.load``): LoRA's ``lora_A`` reads ``x·γ + β``, its ``lora_B`` output
is mapped by ``T = diag(1/s)·C·diag(λ)``, merges add ``T·ΔW·diag(γ)`` and ``T·ΔW·β`` to the bias.

Float64 replicas built from configs, LayerNorm γ/β randomised; adapters with random (non-zero) ``B``."""

from __future__ import annotations

import copy

import pytest
import torch

import normswap
from normswap.analysis.plan import plan_of
from normswap.errors import NormswapError
from normswap.inputs import hf_example_inputs
from normswap.rotation import carry
from normswap.rotation.rotate import rotate
from tests.benchmark_modules import tiny_dinov2
from tests.integrations.test_peft_online_ops import _out, _relative
from tests.zoo import APPROXIMATE, EXACT, build

peft = pytest.importorskip("peft")


def assert_acts_as(lora: torch.nn.Module, probe: dict, ref: torch.Tensor) -> None:
    """The PEFT model ``lora`` gives ``ref`` (the same adapter on the original) unmerged, merged, unmerged again
    and merged and unloaded."""
    assert _relative(_out(lora, probe), ref) <= 1e-9
    lora.merge_adapter()
    assert _relative(_out(lora, probe), ref) <= 1e-9
    lora.unmerge_adapter()
    assert _relative(_out(lora, probe), ref) <= 1e-9
    assert _relative(_out(lora.merge_and_unload(), probe), ref) <= 1e-9


def _lora(model, targets, seed=1, **kw):
    torch.manual_seed(seed)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False, **kw))


def _pair(name, table=EXACT, **patch):
    original = build(table, name)
    probe = hf_example_inputs(original, seed=5)
    converted = copy.deepcopy(original)
    normswap.patch(converted, **patch)
    return original, converted, probe


def _dinov2(**patch):
    original = tiny_dinov2(seed=3)
    probe = hf_example_inputs(original, seed=5)
    converted = copy.deepcopy(original)
    normswap.patch(converted, **patch)
    return original, converted, probe


CASES = [
    ("gpt2", ["c_attn"], {"fan_in_fan_out": True}),  # Conv1D reader of ln_1 (β folded into its bias)
    ("gpt2", ["c_proj"], {"fan_in_fan_out": True}),  # Conv1D writers, rows centered
    ("gpt2", ["c_fc", "c_attn", "c_proj"], {"fan_in_fan_out": True}),
    ("opt", ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], {}),  # nn.Linear readers and writers
]


@pytest.mark.parametrize("name,targets,kw", CASES, ids=[f"{c[0]}-{'+'.join(c[1])}" for c in CASES])
def test_lora_on_edited_linears_acts_as_on_the_original(name, targets, kw):
    original, converted, probe = _pair(name)
    assert _relative(_out(converted, probe), _out(original, probe)) <= 1e-12
    ref_model = _lora(copy.deepcopy(original), targets, **kw)
    ref = _out(ref_model, probe)
    assert _relative(ref, _out(original, probe)) > 1e-3  # the adapter does something
    lora = _lora(converted, targets, **kw)
    assert_acts_as(lora, probe, ref)


@pytest.mark.parametrize("layer_scale", ["fold", "keep"])
def test_lora_on_a_layerscale_writer_acts_as_on_the_original(layer_scale):
    original, converted, probe = _dinov2(layer_scale=layer_scale)
    bases = plan_of(converted).adapter_bases
    assert any(b.get("scale") for b in bases.values())
    assert (layer_scale == "keep") == any(b.get("balance") for b in bases.values())
    targets = ["query", "value", "attention.output.dense", "fc1", "fc2"]
    ref = _out(_lora(copy.deepcopy(original), targets), probe)
    lora = _lora(converted, targets)
    assert _relative(_out(lora, probe), ref) <= 1e-9
    lora.merge_adapter()
    assert _relative(_out(lora, probe), ref) <= 1e-9
    lora.unmerge_adapter()
    assert _relative(_out(lora.merge_and_unload(), probe), ref) <= 1e-9


def test_adapter_bases_survive_save_and_load(tmp_path):
    original, converted, probe = _pair("gpt2")
    normswap.save(converted, tmp_path / "ckpt")
    loaded = normswap.load(tmp_path / "ckpt", dtype=torch.float64)
    targets, kw = ["c_attn", "c_proj", "c_fc"], {"fan_in_fan_out": True}
    ref = _out(_lora(copy.deepcopy(original), targets, **kw), probe)
    lora = _lora(loaded, targets, **kw)
    assert _relative(_out(lora, probe), ref) <= 1e-9
    assert _relative(_out(lora.merge_and_unload(), probe), ref) <= 1e-9


def test_adapter_bases_survive_automodel_load(tmp_path):
    import transformers as tf

    original, converted, probe = _pair("gpt2")
    normswap.save(converted, tmp_path / "ckpt")
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float64).eval()
    targets, kw = ["c_attn", "c_proj"], {"fan_in_fan_out": True}
    ref = _out(_lora(copy.deepcopy(original), targets, **kw), probe)
    assert _relative(_out(_lora(loaded, targets, **kw), probe), ref) <= 1e-9


def test_adapter_added_later_and_a_deep_copy_act_as_on_the_original():
    original, converted, probe = _pair("gpt2")
    kw = {"fan_in_fan_out": True, "init_lora_weights": False}
    targets = ["c_attn", "c_proj"]
    ref = _lora(copy.deepcopy(original), targets, **{"fan_in_fan_out": True})
    ref.add_adapter("two", peft.LoraConfig(r=2, target_modules=targets, **kw))
    lora = _lora(converted, targets, **{"fan_in_fan_out": True})
    lora.add_adapter("two", peft.LoraConfig(r=2, target_modules=targets, **kw))
    lora.load_state_dict({k: v for k, v in ref.state_dict().items() if "lora_" in k}, strict=False)  # same weights
    for model in (lora, copy.deepcopy(lora)):
        model.set_adapter("two")
        ref.set_adapter("two")
        assert _relative(_out(model, probe), _out(ref, probe)) <= 1e-9


def test_lora_with_online_ops_acts_as_on_the_original():
    """The conversion's folds compose with guard54's per-head turn and the online ops of rotate("none")."""
    original, converted, probe = _dinov2(beta_placement="keep")
    rotate(converted, "none", online=True, seed=4)
    targets = ["query", "value", "attention.output.dense", "fc1", "fc2"]
    ref = _out(_lora(copy.deepcopy(original), targets), probe)
    lora = _lora(converted, targets)
    assert _relative(_out(lora, probe), ref) <= 1e-9
    merged = lora.merge_and_unload()
    assert _relative(_out(merged, probe), ref) <= 1e-9
    assert carry.missing_online_ops(merged) == []


def test_post_ln_bert_adapters_still_run_and_merge():
    """Approximate norms (Post-LN BERT): LoRA on the Linears the conversion left as they were runs and merges; on
    the centered reader of an approximate norm (the FFN's first dense) it is refused (round 56;
    tests/integrations/test_peft_adapter_refusals.py)."""
    original, converted, probe = _pair("bert", table=APPROXIMATE)
    lora = _lora(converted, ["query", "value", "attention.output.dense"])
    out = _out(lora, probe)
    assert torch.isfinite(out).all()
    assert _relative(_out(lora.merge_and_unload(), probe), out) <= 1e-9


@pytest.mark.parametrize("config,target", [
    (lambda t: peft.LoraConfig(r=4, target_modules=t, use_dora=True), "q_proj"),
    (lambda t: peft.LoHaConfig(r=4, target_modules=t), "q_proj"),
    (lambda t: peft.IA3Config(target_modules=t, feedforward_modules=[]), "fc2"),
    (lambda t: peft.IA3Config(target_modules=t, feedforward_modules=t), "q_proj"),
    (lambda t: peft.VeraConfig(r=4, target_modules=t), "fc2"),
], ids=["dora", "loha-on-beta-reader", "ia3-on-writer", "ia3-feedforward-on-beta-reader", "vera"])
def test_adapters_that_cannot_act_as_on_the_original_are_refused_at_attach(config, target):
    _, converted, probe = _pair("opt")
    assert target in " ".join(plan_of(converted).adapter_bases)
    before = _out(converted, probe)
    with pytest.raises(NormswapError, match="is refused: the conversion folded"):
        peft.get_peft_model(converted, config([target]))
    assert _relative(_out(converted, probe), before) == 0.0  # the refused Linear is left as it was


@pytest.mark.parametrize("config", [
    lambda: peft.LoHaConfig(r=4, target_modules=["fc2", "out_proj"], init_weights=False),
    lambda: peft.LoKrConfig(r=4, target_modules=["fc2", "out_proj"], init_weights=False),
    lambda: peft.IA3Config(target_modules=["q_proj", "fc1"], feedforward_modules=[], init_ia3_weights=False),
    lambda: peft.IA3Config(target_modules=["fc2", "out_proj"], feedforward_modules=["fc2", "out_proj"],
                           init_ia3_weights=False),
], ids=["loha-on-writers", "lokr-on-writers", "ia3-on-reader-outputs", "ia3-feedforward-on-writers"])
def test_other_adapters_where_they_can_act_as_on_the_original(config):
    original, converted, probe = _pair("opt")
    torch.manual_seed(2)
    ref = _out(peft.get_peft_model(copy.deepcopy(original), config()), probe)
    assert _relative(ref, _out(original, probe)) > 1e-4
    torch.manual_seed(2)
    model = peft.get_peft_model(converted, config())
    assert _relative(_out(model, probe), ref) <= 1e-9
    assert _relative(_out(model.merge_and_unload(), probe), ref) <= 1e-9
