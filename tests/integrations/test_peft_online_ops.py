"""PEFT adapters on Linears that run an online Hadamard (:mod:`normswap.rotation.carry`, round 51).

The op is a pre-hook on the Linear and its weight holds ``W·M`` (the op takes ``x`` to ``x·M``). PEFT's LoRA
layer calls that Linear as its ``base_layer``, so the op keeps running and the adapter reads the input before
it, as the Linear's caller sees it: the unmerged model is right. PEFT's merge adds the adapter's update ``ΔW``
to the weight, which is in the op's basis: without a turn the merged model computes ``x·M·ΔWᵀ`` where it
computed ``x·ΔWᵀ`` (relative error 0.77 on this replica before round 51). Since round 51 the adapter layer that
wraps such a Linear merges ``ΔW·M``: ``merge_and_unload`` and ``merge_adapter`` / ``unmerge_adapter`` are
exact, with and without a call between wrapping and merging, for ``nn.Linear`` and GPT-2's ``Conv1D``.

Float64 replicas, LayerNorm γ/β randomised; adapters with random (non-zero) ``B``."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import normswap
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.rotation import carry
from normswap.rotation.rotate import rotate
from tests.benchmark_modules import tiny_dinov2
from tests.zoo import EXACT, build

peft = pytest.importorskip("peft")


def _out(model, probe):
    with torch.no_grad(), default_dtype(torch.float64):
        out = model(**probe)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _relative(out, ref):
    return float((out - ref).abs().max() / ref.abs().max())


def _online_dinov2():
    model = tiny_dinov2(seed=3)
    probe = hf_example_inputs(model, seed=5)
    normswap.patch(model, beta_placement="keep")
    rotate(model, "none", online=True, seed=4)
    return model, probe


def _lora(model, targets, **kw):
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False, **kw))


def test_merge_and_unload_of_a_lora_on_linears_with_ops_is_exact():
    model, probe = _online_dinov2()
    lora = _lora(model, ["fc1", "fc2", "q_proj"])  # fc1/fc2 run an op; q_proj reads norm1's shared op
    ref = _out(lora, probe)
    merged = lora.merge_and_unload()
    fc1 = merged.encoder.layer[0].mlp.fc1
    assert type(fc1) is torch.nn.Linear and carry.holds_op(fc1)  # the merged Linear keeps its op
    assert _relative(_out(merged, probe), ref) <= 1e-9
    assert carry.missing_online_ops(merged) == []


def test_an_adapter_loaded_and_merged_without_a_call_between_is_exact(tmp_path):
    """``PeftModel.from_pretrained(base, dir).merge_and_unload()``: no forward call while the adapter is in."""
    model, probe = _online_dinov2()
    lora = _lora(model, ["fc1", "fc2"])
    ref = _out(lora, probe)
    lora.save_pretrained(tmp_path / "adapter")
    base, _ = _online_dinov2()
    merged = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload()
    assert _relative(_out(merged, probe), ref) <= 1e-9


def test_merge_adapter_and_unmerge_adapter_round_trip():
    model, probe = _online_dinov2()
    weight = model.encoder.layer[1].mlp.fc2.weight.detach().clone()
    lora = _lora(model, ["fc2"])
    ref = _out(lora, probe)
    lora.merge_adapter()
    assert _relative(_out(lora, probe), ref) <= 1e-9
    lora.unmerge_adapter()
    assert torch.allclose(lora.get_base_model().encoder.layer[1].mlp.fc2.weight, weight, rtol=0, atol=1e-12)
    assert _relative(_out(lora, probe), ref) <= 1e-9


def test_a_lora_on_gpt2_conv1d_with_ops_merges_exactly():
    """GPT-2's ``Conv1D`` stores its weight ``[in, out]`` (PEFT's ``fan_in_fan_out``): the update is turned along
    its input axis."""
    model = build(EXACT, "gpt2")
    normswap.patch(model, beta_placement="keep")
    rotate(model, "none", online=True, seed=1)
    assert carry.holds_op(model.transformer.h[0].mlp.c_proj)
    probe = {"input_ids": torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])}
    lora = _lora(model, ["c_proj", "c_fc"], fan_in_fan_out=True)
    ref = _out(lora, probe)
    merged = lora.merge_and_unload()
    assert _relative(_out(merged, probe), ref) <= 1e-9


def test_a_dora_adapter_on_a_linear_with_an_op_is_refused_at_merge_before_that_layer_changes():
    """DoRA merges ``m/‖W + ΔW‖ · (W + ΔW)`` with the norm taken in the op's basis in its forward (mixed: the
    base weight turned, the update not), which no turn of the update reproduces: refused, one line."""
    from normswap.errors import NormswapError

    model, probe = _online_dinov2()
    lora = _lora(model, ["fc1"], use_dora=True)
    fc1 = lora.get_base_model().encoder.layer[0].mlp.fc1.base_layer
    weight = fc1.weight.detach().clone()
    with pytest.raises(NormswapError, match=r"^adapter `default` is a DoraLinearVariant on a Linear that runs an "
                                            r"online Hadamard: it cannot be merged exactly"):
        lora.merge_and_unload()
    assert torch.equal(fc1.weight, weight)  # the first layer to merge refused before its weight changed


def test_torch_compile_fullgraph_runs_a_lora_model_and_its_merge():
    """The guard is told when PEFT wraps the op's Linear (and unwraps it at merge), as the assignment happens:
    the next call finds nothing changed, so ``fullgraph=True`` traces without running the full check."""
    import copy

    torch._dynamo.reset()
    model, probe = _online_dinov2()
    torch.manual_seed(0)
    ref = _out(_lora(copy.deepcopy(model), ["fc1", "fc2"]), probe)
    torch.manual_seed(0)  # the same adapter again, on a deep copy (whose guard is told too); no eager call
    lora = _lora(copy.deepcopy(model), ["fc1", "fc2"])
    assert _relative(_out(torch.compile(lora, fullgraph=True, backend="eager"), probe), ref) <= 1e-9
    merged = lora.merge_and_unload()
    assert _relative(_out(torch.compile(merged, fullgraph=True, backend="eager"), probe), ref) <= 1e-9
    torch._dynamo.reset()


# ------------------------------------------------------------------ round 52: IA3, LoHa, LoKr, other families
@functools.cache
def _converted_without_ops():
    model = tiny_dinov2(seed=3)
    normswap.patch(model, beta_placement="keep")
    return model


def _without_ops():
    """The same replica converted without online ops: what an adapter on the original model computes. A deep copy
    of one conversion made once per process (PEFT wraps the model it is given in place; the reference is only
    ever computed from it, so a copy of the same float64 tensors gives the same reference bit for bit)."""
    return copy.deepcopy(_converted_without_ops())


def _adapter(model, config):
    torch.manual_seed(11)  # the same adapter values on the model with and without ops (same shapes, same order)
    return peft.get_peft_model(model, config)


def _configs():
    return {
        "loha": lambda: peft.LoHaConfig(r=4, target_modules=["fc1", "fc2"], init_weights=False),
        "lokr": lambda: peft.LoKrConfig(r=4, target_modules=["fc1", "fc2"], init_weights=False),
        # feedforward: IA3 scales fc1's and fc2's *inputs* (the op's side); k_proj: its outputs
        "ia3": lambda: peft.IA3Config(target_modules=["fc1", "fc2", "k_proj"], feedforward_modules=["fc1", "fc2"],
                                      init_ia3_weights=False),
    }


@pytest.mark.parametrize("kind", ["loha", "lokr", "ia3"])
def test_an_adapter_on_linears_with_ops_computes_the_original_models_adapter_and_merges_exactly(kind):
    """LoHa and LoKr add ``ΔW`` (their forward computes ``x·ΔWᵀ`` from the update itself, which must stay in the
    caller's basis: before round 52 it got the turned update and failed, ``TypeError``), IA3 scales the Linear's
    input (its merge multiplies the weight's columns, which are in the op's basis: before round 52 a wrong model,
    no error). Unmerged, each equals the same adapter on the model without ops; merged, unmerged again and merged
    for good, each equals its unmerged model to float64 rounding, and the merged Linears keep their ops."""
    import warnings

    model, probe = _online_dinov2()
    ref = _out(_adapter(_without_ops(), _configs()[kind]()), probe)
    ada = _adapter(model, _configs()[kind]())
    assert _relative(_out(ada, probe), ref) <= 1e-9
    fc1 = ada.get_base_model().encoder.layer[0].mlp.fc1.base_layer
    weight = fc1.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # IA3's "unmerge can be inaccurate"
        ada.merge_adapter()
        assert _relative(_out(ada, probe), ref) <= 1e-9
        ada.unmerge_adapter()
    assert torch.allclose(fc1.weight, weight, rtol=0, atol=1e-7 if kind == "ia3" else 1e-12)  # IA3 divides by l+1e-8
    assert _relative(_out(ada, probe), ref) <= 1e-7
    merged = ada.merge_and_unload()
    assert carry.holds_op(merged.encoder.layer[0].mlp.fc1) and carry.missing_online_ops(merged) == []
    assert _relative(_out(merged, probe), ref) <= 1e-7


def test_a_lora_update_read_outside_a_merge_is_the_adapters_own():
    """The turned update is the merge's alone: ``get_delta_weight`` called by other code (PEFT's
    ``add_weighted_adapter`` combines adapters from it, to be read before the op) returns the class's update."""
    model, probe = _online_dinov2()
    lora = _lora(model, ["fc2"])
    layer = lora.get_base_model().encoder.layer[0].mlp.fc2
    expected = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
    assert torch.allclose(layer.get_delta_weight("default"), expected, rtol=0, atol=1e-12)


def test_an_adapter_family_whose_merge_normswap_does_not_know_is_refused_at_merge():
    """An adapter layer of another family (VeRA here) wrapping a Linear that runs an op: its merge is not known
    to be exact in the op's basis, so it is refused, one line, before the Linear changes."""
    from normswap.errors import NormswapError

    model, probe = _online_dinov2()
    for module in model.modules():  # fc2's centered rows refuse VeRA at attach (round 54): a Linear with an op alone
        module.__dict__.pop(carry.BASIS, None)
    vera = peft.get_peft_model(model, peft.VeraConfig(r=4, target_modules=["fc2"], init_weights=False))
    fc2 = vera.get_base_model().encoder.layer[0].mlp.fc2.base_layer
    weight = fc2.weight.detach().clone()
    with pytest.raises(NormswapError, match=r"^adapter layer \w+ on `\S*fc2` \(Linear\) runs an online Hadamard"):
        vera.merge_and_unload()
    assert torch.equal(fc2.weight, weight)


# ------------------------------------------------------------------ round 53: readers of an op shared after a norm
def _reader_configs():
    return {
        "lora": lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj"], init_lora_weights=False),
        "loha": lambda: peft.LoHaConfig(r=4, target_modules=["q_proj"], init_weights=False),
        "lokr": lambda: peft.LoKrConfig(r=4, target_modules=["k_proj"], init_weights=False),
        "ia3": lambda: peft.IA3Config(target_modules=["q_proj", "k_proj"], feedforward_modules=["q_proj"],
                                      init_ia3_weights=False),
    }


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr", "ia3"])
def test_an_adapter_on_a_reader_of_a_shared_op_computes_the_original_models_adapter_and_merges_exactly(kind):
    """q, k and v read norm1's output after one shared op (a hook on the norm): an adapter on ``q_proj`` read the
    turned tensor ``x·M``, so it computed something else than the same adapter on the model without ops (relative
    error 2.0e-3 for a LoRA on ``k_proj`` of this replica before round 53, no error). Since round 53 the op moves
    onto each reader as PEFT wraps one (``carry.split_shared_op``): the adapter reads ``x``, equals the adapter on
    the model without ops, and merges exactly; the manifest lists the readers' own ops."""
    import warnings

    from normswap.analysis.plan import plan_of

    model, probe = _online_dinov2()
    ref = _out(_adapter(_without_ops(), _reader_configs()[kind]()), probe)
    ada = _adapter(model, _reader_configs()[kind]())
    attention = ada.get_base_model().encoder.layer[0].attention
    assert _relative(_out(ada, probe), ref) <= 1e-9
    assert not carry.holds_op(ada.get_base_model().encoder.layer[0].norm1)
    bases = [getattr(m, "base_layer", m) for m in (attention.q_proj, attention.k_proj, attention.v_proj)]
    assert all(carry.holds_op(m) for m in bases)  # the op on each reader, wrapped or not
    rotations = plan_of(ada.get_base_model()).rotations
    assert not any(o["norm"] == "encoder.layer.0.norm1" for r in rotations for o in r.get("online_outputs", []))
    assert any("encoder.layer.0.attention.v_proj" in r.get("online", []) for r in rotations)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # IA3's "unmerge can be inaccurate"
        merged = ada.merge_and_unload()
    assert carry.missing_online_ops(merged) == []
    assert _relative(_out(merged, probe), ref) <= 1e-9


def test_a_merged_model_whose_shared_op_was_split_saves_and_loads_exactly(tmp_path):
    """The split is in the manifest: saved and loaded, each reader gets its own op back, outputs unchanged."""
    model, probe = _online_dinov2()
    merged = _lora(model, ["q_proj"]).merge_and_unload()
    ref = _out(merged, probe)
    normswap.save(merged, tmp_path / "ckpt")
    loaded = normswap.load(tmp_path / "ckpt", dtype=torch.float64)
    assert carry.holds_op(loaded.encoder.layer[0].attention.q_proj)
    assert not carry.holds_op(loaded.encoder.layer[0].norm1)
    assert _relative(_out(loaded, probe), ref) <= 1e-9


def test_the_split_costs_nothing_where_no_adapter_wraps_a_reader():
    """An adapter on fc1 only leaves the shared ops after the norms as they are (one op for q, k and v)."""
    model, probe = _online_dinov2()
    _lora(model, ["fc1"])
    assert all(carry.holds_op(layer.norm1) for layer in model.encoder.layer)


def test_an_adapter_on_a_reader_in_a_deep_copy_splits_the_copys_op_only():
    """The reader's mark names its model weakly; a deep copy's readers name the copy, so an adapter on the copy
    splits the copy's shared op and leaves the original's in place."""
    import copy

    model, probe = _online_dinov2()
    twin = copy.deepcopy(model)
    ref = _out(_adapter(_without_ops(), _reader_configs()["lora"]()), probe)
    ada = _adapter(twin, _reader_configs()["lora"]())
    assert _relative(_out(ada, probe), ref) <= 1e-9
    assert all(carry.holds_op(layer.norm1) for layer in model.encoder.layer)
    assert not any(carry.holds_op(layer.norm1) for layer in twin.encoder.layer)


# ------------------------------------------------------------------ round 54: the per-head turn of the values
def _head_configs():
    return {
        "lora-v": lambda: peft.LoraConfig(r=4, target_modules=["v_proj"], init_lora_weights=False),
        "lora-o": lambda: peft.LoraConfig(r=4, target_modules=["o_proj"], init_lora_weights=False),
        # v_proj is also a reader of norm1's shared op: with q_proj wrapped the op is split onto v_proj, so its
        # merge turns the update by the op (columns) and by the per-head H̃ (rows)
        "lora-qvo-fc1": lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj", "fc1"],
                                                init_lora_weights=False),
        "loha-vo": lambda: peft.LoHaConfig(r=4, target_modules=["v_proj", "o_proj"], init_weights=False),
        "lokr-vo": lambda: peft.LoKrConfig(r=4, target_modules=["v_proj", "o_proj"], init_weights=False),
        # (IA3 scaling o_proj's output, untouched by the per-head columns, is refused since round 54's adapt54:
        # o_proj's rows are centered, which a per-row scale does not commute with; test_peft_adapter_bases.py)
    }


@pytest.mark.parametrize("kind", list(_head_configs()))
def test_an_adapter_on_the_value_or_output_projection_acts_in_the_original_basis_and_merges_exactly(kind):
    """``rotate(model, "none", online=True)`` folds a per-head Hadamard ``H̃`` into v_proj's rows and o_proj's
    columns (no op runs). An adapter there added its update in the wrong basis before round 54 (relative error
    0.17 for a LoRA on v_proj, 0.44 on o_proj of this replica, no error). Since round 54 LoRA's ``lora_B`` output
    (v_proj) / ``lora_A`` input (o_proj) turns per head, LoHa's and LoKr's update turns: each equals the same
    adapter on the model without ops, unmerged, merged, unmerged again and merged for good."""
    import warnings

    model, probe = _online_dinov2()
    ref = _out(_adapter(_without_ops(), _head_configs()[kind]()), probe)
    ada = _adapter(model, _head_configs()[kind]())
    assert _relative(_out(ada, probe), ref) <= 1e-9
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # IA3's "unmerge can be inaccurate"
        ada.merge_adapter()
        assert _relative(_out(ada, probe), ref) <= 1e-9
        ada.unmerge_adapter()
        assert _relative(_out(ada, probe), ref) <= 1e-7  # IA3's unmerge divides by l + 1e-8
        merged = ada.merge_and_unload()
    assert carry.missing_online_ops(merged) == []
    assert _relative(_out(merged, probe), ref) <= 1e-7


def test_a_value_adapter_saved_and_loaded_keeps_the_original_basis(tmp_path):
    """The adapter's own weights stay in the original basis (the turn is a hook / a turned update, not a fold into
    them): saved with ``save_pretrained`` and loaded onto another converted model, or onto a converted checkpoint
    saved and loaded by normswap, it computes the same as on the model without ops, unmerged and merged."""
    config = _head_configs()["lora-qvo-fc1"]
    model, probe = _online_dinov2()
    ref = _out(_adapter(_without_ops(), config()), probe)
    ada = _adapter(model, config())
    lora_b = ada.get_base_model().encoder.layer[0].attention.v_proj.lora_B["default"].weight.detach().clone()
    ada.save_pretrained(tmp_path / "adapter")
    base, _ = _online_dinov2()
    assert _relative(_out(peft.PeftModel.from_pretrained(base, tmp_path / "adapter"), probe), ref) <= 1e-9
    base, _ = _online_dinov2()
    merged = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload()  # no call between
    assert _relative(_out(merged, probe), ref) <= 1e-9
    converted, _ = _online_dinov2()
    normswap.save(converted, tmp_path / "ckpt")
    loaded = normswap.load(tmp_path / "ckpt", dtype=torch.float64)
    again = peft.PeftModel.from_pretrained(loaded, tmp_path / "adapter")
    assert torch.equal(again.get_base_model().encoder.layer[0].attention.v_proj.lora_B["default"].weight, lora_b)
    assert _relative(_out(again, probe), ref) <= 1e-9


def test_an_adapter_added_later_on_a_turned_layer_is_turned_too_also_in_a_deep_copy():
    """``add_adapter`` puts a new ``lora_B`` / ``lora_A`` entry into the layer's dictionaries, which carry the
    turn (deep copies too), so the second adapter acts in the original basis as well."""
    import copy

    config = _head_configs()["lora-qvo-fc1"]
    plain = _adapter(_without_ops(), config())
    torch.manual_seed(12)
    plain.add_adapter("two", config())
    plain.set_adapter("two")
    model, probe = _online_dinov2()
    ref = _out(plain, probe)
    ada = _adapter(model, config())
    for target in (copy.deepcopy(ada), ada):
        torch.manual_seed(12)
        target.add_adapter("two", config())
        target.set_adapter("two")
        assert _relative(_out(target, probe), ref) <= 1e-9


def _refused_head_configs():
    return {
        "ia3-v": (lambda: peft.IA3Config(target_modules=["v_proj"], feedforward_modules=[]), "v_proj", "IA3 scaling"),
        "ia3-o-feedforward": (lambda: peft.IA3Config(target_modules=["o_proj"], feedforward_modules=["o_proj"]),
                              "o_proj", "IA3 scaling"),
        "dora-v": (lambda: peft.LoraConfig(r=4, target_modules=["v_proj"], use_dora=True), "v_proj", "a LoRA variant"),
        "lora-bias-v": (lambda: peft.LoraConfig(r=4, target_modules=["v_proj"], lora_bias=True), "v_proj",
                        "lora_bias"),
        "adalora-v": (lambda: peft.AdaLoraConfig(r=4, target_modules=["v_proj"], total_step=10), "v_proj", "AdaLoRA"),
        "vera-o": (lambda: peft.VeraConfig(r=4, target_modules=["o_proj"]), "o_proj", "this adapter type"),
    }


@pytest.mark.parametrize("kind", list(_refused_head_configs()))
def test_an_adapter_that_cannot_act_in_the_original_basis_on_the_turned_heads_is_refused_as_it_is_attached(kind):
    """Where the per-head turn does not commute with the adapter (a per-feature scale of the turned values, DoRA's
    row norms, a bias merged unturned) or normswap does not know where to turn it (AdaLoRA's matrices, VeRA), PEFT's
    attach raises one line naming the Linear, before that Linear is replaced (before round 54: it ran, silently
    in the wrong basis); the model computes what it did."""
    from normswap.errors import NormswapError

    config, target, why = _refused_head_configs()[kind]
    model, probe = _online_dinov2()
    before = _out(model, probe)
    with pytest.raises(NormswapError, match=rf"^a PEFT \w+ adapter \(\w+\) on `encoder\.layer\.0\.attention\.{target}` "
                                            rf"is refused: that Linear's weight holds the per-head Hadamard .*{why}"):
        peft.get_peft_model(model, config())
    assert type(getattr(model.encoder.layer[0].attention, target)) is torch.nn.Linear
    assert _relative(_out(model, probe), before) == 0


@pytest.mark.parametrize("extra", [{"use_dora": True}, {"lora_bias": True}])
def test_an_adapter_added_later_that_cannot_act_in_the_original_basis_is_refused_as_it_is_assigned(extra):
    """``add_adapter`` on a LoRA layer already wrapping the value projection creates no new layer: the refusal
    comes as its branch Linear is assigned (DoRA: its variant is set before; a bias on ``lora_B``)."""
    from normswap.errors import NormswapError

    model, probe = _online_dinov2()
    ada = _adapter(model, _head_configs()["lora-v"]())
    ref = _out(ada, probe)
    line = r"^a PEFT lora adapter \(Linear\) on `encoder\.layer\.0\.attention\.v_proj` is refused"
    with pytest.raises(NormswapError, match=line):
        ada.add_adapter("two", peft.LoraConfig(r=4, target_modules=["v_proj"], **extra))
    assert _relative(_out(ada, probe), ref) == 0


def test_a_wrapper_that_is_not_peft_on_the_turned_heads_is_left_alone():
    """Only PEFT's adapter layers are turned or refused: another module that keeps the Linear as ``base_layer``
    (and calls it) is assigned as before and the model computes what it did."""

    class Wrapper(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        def merge(self):
            """A ``merge`` like PEFT's layers have: the registration hook looks at that too."""

        def forward(self, x):
            return self.base_layer(x)

    model, probe = _online_dinov2()
    before = _out(model, probe)
    attention = model.encoder.layer[0].attention
    attention.v_proj = Wrapper(attention.v_proj)
    assert _relative(_out(model, probe), before) <= 1e-12


def test_torch_compile_fullgraph_runs_a_lora_on_the_turned_heads_and_its_merge():
    """The branch hooks (``lora_B``'s output, ``lora_A``'s input turned per head) trace with ``fullgraph=True``, with
    no eager call between wrapping and compiling; the merged model too."""
    torch._dynamo.reset()
    config = _head_configs()["lora-qvo-fc1"]
    model, probe = _online_dinov2()
    ref = _out(_adapter(_without_ops(), config()), probe)
    ada = _adapter(model, config())
    assert _relative(_out(torch.compile(ada, fullgraph=True, backend="eager"), probe), ref) <= 1e-9
    merged = ada.merge_and_unload()
    assert _relative(_out(torch.compile(merged, fullgraph=True, backend="eager"), probe), ref) <= 1e-9
    torch._dynamo.reset()
