"""The online-op guard's round-52 cases (:mod:`normswap.rotation.carry`): a submodule called directly after a
swap, an op's hook removed from a module that stays in place, and ops carried after the model's dtype changed.

The float64 DINOv2 replica (γ/β/λ randomised) with the ops alone (``rotate(model, "none", online=True)``), as in
``test_online_carry.py``, whose stand-in engine module (a new module computing ``x @ Wᵀ + b``, no hooks) it
reuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import normswap
from normswap.errors import NormswapError
from normswap.pipeline import default_dtype
from normswap.rotation import carry
from normswap.rotation.rotate import HADAMARD_BUFFER, SIGNS_BUFFER
from tests.rotation.test_online_carry import StandInLinear, _online_model, _register_standin_quantizer, _relative, _run

FC = [f"encoder.layer.{i}.mlp.{fc}" for i in range(2) for fc in ("fc1", "fc2")]


def _hidden(model, probe):
    """The first layer's input (the embeddings' output), for calling layers directly."""
    with torch.no_grad():
        return model.embeddings(probe["pixel_values"])


def _layer(layer, x):
    with torch.no_grad(), default_dtype(x.dtype):
        out = layer(x)
    return out[0] if isinstance(out, tuple) else out


# ------------------------------------------------------------------------------ a submodule called directly
def test_a_layer_called_directly_after_a_swap_is_refused_before_the_swapped_module_runs():
    """``model.encoder.layer[0](x)`` does not pass the model's pre-hook: the swapped module itself refuses (the
    swap is seen as it happens, by torch's module-registration hook), one line naming it; carried back, the
    layer computes what it did before the swap."""
    model, probe, ref = _online_model()
    x = _hidden(model, probe)
    layer = model.encoder.layer[0]
    before = _layer(layer, x)
    layer.mlp.fc1 = StandInLinear.from_linear(layer.mlp.fc1)
    line = r"^`encoder\.layer\.0\.mlp\.fc1` \(StandInLinear\) has lost its online Hadamard.*carry_online_ops"
    with pytest.raises(NormswapError, match=line):
        _layer(layer, x)
    with pytest.raises(NormswapError, match=line):  # the module itself, and the MLP above it
        layer.mlp.fc1(torch.zeros(1, 32, dtype=torch.float64))
    with pytest.raises(NormswapError, match=line):
        _layer(layer.mlp, x)
    with pytest.raises(NormswapError, match=line):  # the model's call: its guard, as before
        _run(model, probe)
    assert carry.carry_online_ops(model) == ["encoder.layer.0.mlp.fc1"]
    assert _relative(_layer(layer, x), before) <= 1e-9
    assert _relative(_run(model, probe), ref) <= 1e-9


def test_a_module_above_the_op_replaced_then_called_directly_is_refused_at_the_op_path():
    """The whole MLP rebuilt (its fresh ``fc1`` holds no op): a direct call of the layer meets the refusal at
    ``mlp.fc1``; an unrelated assignment (a Dropout elsewhere) arms nothing."""
    model, probe, ref = _online_model()
    x = _hidden(model, probe)
    layer = model.encoder.layer[1]
    layer.drop_path = nn.Identity()  # not on the way to an op: nothing to refuse
    assert _relative(_run(model, probe), ref) <= 1e-9
    layer.mlp = type(layer.mlp)(model.config).double()
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.1\.mlp\.fc1` \(Linear\) has lost"):
        _layer(layer, x)


def test_torch_ao_copies_the_hook_without_its_values_a_direct_call_is_refused_in_one_line():
    """torch.ao's ``quantize_dynamic`` writes into ``_modules`` (no registration hook) and copies the op's hook
    onto its int8 Linear without the op's buffers: a direct call of the layer runs that hook, which refuses in
    the guard's line (before round 52: ``AttributeError: ... no attribute 'normswap_hadamard'``)."""
    import warnings

    from torch.ao.quantization import quantize_dynamic

    model, probe, ref = _online_model()
    model, probe = model.float(), {k: v.float() for k, v in probe.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    x = _hidden(q, probe)
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.0\.mlp\.fc1` \(Linear\) has lost its online "
                                            r"Hadamard"):
        _layer(q.encoder.layer[0], x)
    carry.carry_online_ops(q)
    assert _relative(_layer(q.encoder.layer[0], x), _layer(model.encoder.layer[0], x)) < 0.05  # int8 rounding


# ------------------------------------------------------------------------------ an op's hook removed in place
@pytest.mark.parametrize("how", ["clear", "remove", "del"])
def test_an_op_hook_removed_from_a_module_that_stays_is_refused_at_the_next_call(how):
    """The module stays (nothing to swap), its op's hook goes: ``_forward_pre_hooks.clear()``, the handle's
    ``remove()``, or a ``del`` of the entry. Refused at the model's next call (before round 52: only at save),
    and carrying the op back puts the hook on again, exact."""
    model, probe, ref = _online_model()
    fc2 = model.encoder.layer[1].mlp.fc2
    handle = fc2.__dict__[carry.HANDLE]
    if how == "clear":
        fc2._forward_pre_hooks.clear()
    elif how == "remove":
        handle.remove()
    else:
        del fc2._forward_pre_hooks[handle.id]
    assert _relative(_run(model, probe, hooks=False), ref) > 1e-3  # what running it would give
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.1\.mlp\.fc2` \(Linear\) has lost its online"):
        _run(model, probe)
    assert carry.carry_online_ops(model) == ["encoder.layer.1.mlp.fc2"]
    assert _relative(_run(model, probe), ref) <= 1e-9


def test_a_shared_ops_forward_hook_removed_from_its_norm_is_refused_at_the_next_call():
    """The op after ``norm1`` (a forward hook on the norm, shared by q, k and v) removed in place."""
    model, probe, ref = _online_model()
    norm = model.encoder.layer[0].norm1
    norm._forward_hooks.clear()
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.0\.norm1` \(\w+\) has lost its online Hadamard"):
        _run(model, probe)
    assert carry.carry_online_ops(model) == ["encoder.layer.0.norm1"]
    assert _relative(_run(model, probe), ref) <= 1e-9


def test_an_unrelated_hook_added_or_removed_does_not_trip_the_guard(monkeypatch):
    """Only the op's own hook entry is watched: other hooks on the same module come and go freely."""
    model, probe, ref = _online_model()
    fc1 = model.encoder.layer[0].mlp.fc1
    handle = fc1.register_forward_pre_hook(lambda m, a: None)
    monkeypatch.setattr(carry, "check_online_ops", lambda m: pytest.fail("the full check ran"))
    assert _relative(_run(model, probe), ref) <= 1e-9
    handle.remove()
    assert _relative(_run(model, probe), ref) <= 1e-9


# ------------------------------------------------------------------------------ dtype changes, then a carry
def _op_dtypes(model):
    return {f"{p}.{n}": b.dtype for p, m in model.named_modules() for n, b in m.named_buffers(recurse=False)
            if n.startswith(carry.BUFFER_PREFIX)}


@pytest.mark.parametrize("cast", ["float", "half", "bfloat16"])
def test_ops_carried_after_a_dtype_change_take_the_dtype_the_model_has_now(cast):
    """``model.float()`` / ``.half()`` / ``.to(torch.bfloat16)`` turn the ops' buffers with the model; a swap and
    a carry afterwards must put back the op in that dtype, not the float64 values recorded at the rotation
    (before round 52: float64 factors on a float32 model, and in its saved checkpoint)."""
    model, probe, ref = _online_model()
    dtype = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}[cast]
    model.to(dtype)
    assert set(_op_dtypes(model).values()) == {dtype}
    for path in FC:
        parent, _, name = path.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, name, StandInLinear.from_linear(getattr(owner, name)))
    carry.carry_online_ops(model)
    assert set(_op_dtypes(model).values()) == {dtype}, _op_dtypes(model)
    if dtype == torch.float32:
        with torch.no_grad():
            out = model(pixel_values=probe["pixel_values"].float()).last_hidden_state
        assert _relative(out, ref.float()) <= 1e-4


def test_a_carry_takes_the_values_the_module_holds_now_not_those_recorded():
    """The record follows the module's buffers as they are now: a value assigned after the rotation (a new
    tensor, as ``load_state_dict(..., assign=True)`` or ``fc1.normswap_hadamard_signs = ...`` put there) is the
    one carried."""
    model, probe, ref = _online_model()
    fc1 = model.encoder.layer[0].mlp.fc1
    setattr(fc1, SIGNS_BUFFER, -getattr(fc1, SIGNS_BUFFER))
    now = getattr(fc1, SIGNS_BUFFER).clone()
    model.encoder.layer[0].mlp.fc1 = StandInLinear.from_linear(fc1)
    carry.carry_online_ops(model)
    assert torch.equal(getattr(model.encoder.layer[0].mlp.fc1, SIGNS_BUFFER), now)


def test_a_quantization_config_load_in_another_dtype_carries_the_ops_in_that_dtype(tmp_path):
    """Saved in float64, loaded in float32 with a quantizer that swaps the Linears before the weights load:
    the ops put back from the checkpoint take the dtype the model was built in, as the ops on the norms do."""
    from transformers import AutoModel

    config_cls = _register_standin_quantizer()
    model, probe, ref = _online_model()
    normswap.save(model, tmp_path / "ckpt")
    loaded = AutoModel.from_pretrained(tmp_path / "ckpt", quantization_config=config_cls(), dtype=torch.float32)
    fc2 = loaded.encoder.layer[1].mlp.fc2
    assert type(fc2).__name__ == "StandInLinear" and carry.holds_op(fc2)  # the quantizer's (registered once)
    assert set(_op_dtypes(loaded).values()) == {torch.float32}, _op_dtypes(loaded)
    assert getattr(fc2, HADAMARD_BUFFER).dtype == torch.float32


# ------------------------------------------------------------------------------ round 53: `_modules` writes above
def _swap_modules_entry(model, how):
    """A write straight into a ``_modules`` dictionary above an op (no torch hook sees it); returns the path of
    the first op the write dropped."""
    layer = model.encoder.layer[1]
    fresh_mlp = type(layer.mlp)(model.config).double()
    if how == "mlp":
        layer._modules["mlp"] = fresh_mlp
    elif how == "update":
        layer._modules.update(mlp=fresh_mlp)
    elif how == "layer":
        model.encoder.layer._modules["1"] = type(layer)(model.config).double()
    elif how == "layers":
        model.encoder._modules["layer"] = nn.ModuleList([type(layer)(model.config).double() for _ in range(2)])
        return "encoder.layer.0.mlp.fc1"
    return "encoder.layer.1.mlp.fc1"


@pytest.mark.parametrize("how", ["mlp", "update", "layer", "layers"])
def test_a_modules_write_above_an_op_is_refused_at_the_next_call(how):
    """A whole MLP, a layer or the list of layers written into a parent's ``_modules`` (not ``setattr``): the
    fresh modules hold no op, and the model ran with wrong outputs (relative error 0.58-1.04 on this replica
    before round 53; refused only by save and ``check_online_ops``). Refused at the next call, one line, and a
    direct call of the new layer meets the refusal at the op's path too."""
    model, probe, ref = _online_model()
    path = _swap_modules_entry(model, how)
    with pytest.raises(NormswapError, match=rf"^`{path.replace('.', chr(92) + '.')}` \(Linear\) has lost its online"):
        _run(model, probe)
    x = _hidden(model, probe)
    with pytest.raises(NormswapError, match="has lost its online Hadamard"):
        _layer(model.encoder.layer[int(path.split(".")[2])], x)


def test_a_modules_write_of_a_copy_that_holds_the_ops_runs_and_is_watched_again():
    """A deep copy of the MLP (it holds its ops) written into ``_modules``: the next call runs the full check,
    which passes, and the guard watches the copy from then on (a later write above its op is refused)."""
    import copy

    model, probe, ref = _online_model()
    layer = model.encoder.layer[1]
    layer._modules["mlp"] = copy.deepcopy(layer.mlp)
    assert _relative(_run(model, probe), ref) <= 1e-9
    layer.mlp._modules["fc2"] = nn.Linear(128, 32).double()
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.1\.mlp\.fc2` \(Linear\) has lost"):
        _run(model, probe)


def test_a_modules_write_in_a_deep_copy_is_refused_in_the_copy_and_the_original_runs():
    import copy

    model, probe, ref = _online_model()
    twin = copy.deepcopy(model)
    _swap_modules_entry(twin, "mlp")
    with pytest.raises(NormswapError, match="has lost its online Hadamard"):
        _run(twin, probe)
    assert _relative(_run(model, probe), ref) <= 1e-9


def test_an_unrelated_modules_write_does_not_run_the_full_check(monkeypatch):
    """Writes that drop no op (a Dropout above the ops replaced, through ``_modules``) cost nothing at the call."""
    model, probe, ref = _online_model()
    _run(model, probe)
    monkeypatch.setattr(carry, "check_online_ops", lambda m: pytest.fail("the full check ran"))
    model.encoder.layer[0]._modules["drop_path"] = nn.Identity()
    assert _relative(_run(model, probe), ref) <= 1e-9


def test_a_module_above_the_op_written_into_modules_is_refused_at_save_and_by_the_check(tmp_path):
    """Save and ``check_online_ops`` refuse a whole MLP written into ``_modules`` too (since round 53 the call
    does as well: the ``_modules`` dictionaries above the ops tell the guard of each write)."""
    model, probe, ref = _online_model()
    layer = model.encoder.layer[1]
    layer._modules["mlp"] = type(layer.mlp)(model.config).double()
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.1\.mlp\.fc1` \(Linear\) has lost"):
        carry.check_online_ops(model)
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.1\.mlp\.fc1` \(Linear\) has lost"):
        normswap.save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.1\.mlp\.fc1` \(Linear\) has lost"):
        _run(model, probe)  # armed by the check: the fresh fc1 refuses its own calls


# ------------------------------------------------------------------ round 54: a `_modules` dictionary replaced whole
def _replace_modules_dict(model, how):
    """A module's whole ``_modules`` replaced above an op (no torch hook, and not a write into the watched
    dictionary): returns the path of the first op the new dictionary dropped, or None where it drops none."""
    layer = model.encoder.layer[1]
    fresh_mlp = type(layer.mlp)(model.config).double()
    if how == "layer-dict":
        layer._modules = {**layer._modules, "mlp": fresh_mlp}
        return "encoder.layer.1.mlp.fc1"
    if how == "model-dict":  # the top: the encoder replaced by one whose layers hold no op
        encoder = type(model.encoder)(model.config).double()
        model._modules = {**model._modules, "encoder": encoder}
        return "encoder.layer.0.mlp.fc1"
    if how == "copied-then-written":  # the new dictionary drops nothing; a write into it afterwards does
        layer._modules = dict(layer._modules)
        layer._modules["mlp"] = fresh_mlp
        return "encoder.layer.1.mlp.fc1"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["layer-dict", "model-dict", "copied-then-written"])
def test_a_modules_dictionary_replaced_whole_above_an_op_is_refused_at_the_next_call(how):
    """``layer._modules = {...}`` replaces the watched dictionary itself: before round 54 the guard kept watching
    the old one, so the model ran with wrong outputs until something else ran the full check. Since round 54 the
    slot holding each watched dictionary is compared at every call: refused at the next call, one line."""
    model, probe, ref = _online_model()
    _run(model, probe)
    path = _replace_modules_dict(model, how)
    with pytest.raises(NormswapError, match=rf"^`{path.replace('.', chr(92) + '.')}` \(Linear\) has lost its online"):
        _run(model, probe)


def test_deleting_a_layer_rebuilds_the_lists_dictionary_which_is_watched_again():
    """``del model.encoder.layer[0]`` rebuilds the list's ``_modules`` (a new dictionary, the layers renumbered):
    the next call runs the full check, which passes (each remaining layer keeps its ops), and watches the new
    dictionary, so a later write into it that drops an op is refused (before round 54 it ran)."""
    model, probe, ref = _online_model()
    _run(model, probe)
    del model.encoder.layer[0]
    _run(model, probe)
    assert type(model.encoder.layer.__dict__["_modules"]) is carry.WatchedModules
    model.encoder.layer._modules["0"] = type(model.encoder.layer[0])(model.config).double()
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.0\.mlp\.fc1` \(Linear\) has lost its online"):
        _run(model, probe)


def test_a_replaced_dictionary_in_a_deep_copy_is_refused_in_the_copy_and_the_original_runs():
    """The guard's slot entries name the copy's own modules' ``__dict__`` after ``copy.deepcopy``."""
    import copy

    model, probe, ref = _online_model()
    _run(model, probe)
    twin = copy.deepcopy(model)
    _replace_modules_dict(twin, "layer-dict")
    with pytest.raises(NormswapError, match="has lost its online Hadamard"):
        _run(twin, probe)
    assert _relative(_run(model, probe), ref) <= 1e-9


def test_a_replaced_dictionary_in_an_unpickled_model_is_refused():
    """Pickled and loaded, the guard's slot entries read the loaded modules' own ``__dict__``."""
    import pickle

    model, probe, ref = _online_model()
    _run(model, probe)
    loaded = pickle.loads(pickle.dumps(model))
    assert _relative(_run(loaded, probe), ref) <= 1e-9
    _replace_modules_dict(loaded, "layer-dict")
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.1\.mlp\.fc1` \(Linear\) has lost its online"):
        _run(loaded, probe)


# --------------------------------------- round 55: the op's own parent, a direct call after a write, hook dictionaries
def _fresh_fc1(model):
    """A Linear with fc1's shape and no op (what a quantization engine's module looks like to the guard)."""
    return StandInLinear.from_linear(model.encoder.layer[0].mlp.fc1)


FC1_LOST = r"^`encoder\.layer\.0\.mlp\.fc1` \(StandInLinear\) has lost its online Hadamard"


@pytest.mark.parametrize("how", ["merged", "rebuilt"])
def test_the_ops_own_parents_modules_replaced_whole_is_refused_at_the_next_call(how):
    """``mlp._modules = {...}`` with fc1 (which holds the op) replaced: before round 55 the guard compared the edge
    into fc1 in the *old* dictionary, so the model ran with wrong outputs until save or ``check_online_ops``. Since
    round 55 every ``_modules`` on the way to an op is watched and held weakly: the replaced one is seen as it is
    freed, and the next call refuses; the MLP called directly refuses too."""
    model, probe, ref = _online_model()
    _run(model, probe)
    mlp = model.encoder.layer[0].mlp
    fresh = _fresh_fc1(model)
    if how == "merged":
        mlp._modules = {**mlp._modules, "fc1": fresh}
    else:
        mlp._modules = {"activation_fn": mlp.activation_fn, "fc1": fresh, "fc2": mlp.fc2}
    with pytest.raises(NormswapError, match=FC1_LOST):
        _layer(mlp, _hidden(model, probe))
    with pytest.raises(NormswapError, match=FC1_LOST):
        _run(model, probe)
    assert _relative(_run(model, probe, hooks=False), ref) > 1e-3  # what running it would give
    assert carry.carry_online_ops(model) == ["encoder.layer.0.mlp.fc1"]
    assert _relative(_run(model, probe), ref) <= 1e-9


def test_the_ops_own_parents_modules_copied_whole_runs_and_is_watched_again():
    """A new dictionary that keeps the op's module runs (exact: one full check at the next call), and is watched
    from then on: a write into it that drops the op is refused, at a direct call of the MLP too."""
    model, probe, ref = _online_model()
    _run(model, probe)
    mlp = model.encoder.layer[0].mlp
    mlp._modules = dict(mlp._modules)
    assert _relative(_run(model, probe), ref) <= 1e-9
    assert type(mlp.__dict__["_modules"]) is carry.WatchedModules
    mlp._modules["fc1"] = _fresh_fc1(model)
    with pytest.raises(NormswapError, match=FC1_LOST):
        _layer(mlp, _hidden(model, probe))


def test_the_ops_own_parents_modules_replaced_in_an_unpickled_model_and_a_deep_copy():
    import copy
    import pickle

    model, probe, ref = _online_model()
    _run(model, probe)
    for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert _relative(_run(twin, probe), ref) <= 1e-9
        mlp = twin.encoder.layer[0].mlp
        mlp._modules = {**mlp._modules, "fc1": _fresh_fc1(twin)}
        with pytest.raises(NormswapError, match=FC1_LOST):
            _run(twin, probe)
    assert _relative(_run(model, probe), ref) <= 1e-9


@pytest.mark.parametrize("how", ["item", "update", "setdefault"])
@pytest.mark.parametrize("call", ["mlp", "layer"])
def test_a_write_into_the_ops_own_parent_then_a_direct_call_is_refused(how, call):
    """``mlp._modules["fc1"] = new`` (no torch hook sees it), then the MLP or the layer called directly, before any
    call of the model: before round 55 the op's own parent kept a plain dictionary whose edge only the model's
    call compared, so the direct call ran with wrong outputs. Now the write is told as it happens and the new
    module refuses its own calls."""
    model, probe, ref = _online_model()
    x = _hidden(model, probe)
    layer = model.encoder.layer[0]
    fresh = _fresh_fc1(model)
    if how == "item":
        layer.mlp._modules["fc1"] = fresh
    elif how == "update":
        layer.mlp._modules.update(fc1=fresh)
    else:
        del layer.mlp._modules["fc1"]
        layer.mlp._modules.setdefault("fc1", fresh)
    with pytest.raises(NormswapError, match=FC1_LOST):
        _layer(layer.mlp if call == "mlp" else layer, x)
    with pytest.raises(NormswapError, match=FC1_LOST):
        _run(model, probe)
    assert carry.carry_online_ops(model) == ["encoder.layer.0.mlp.fc1"]
    assert _relative(_run(model, probe), ref) <= 1e-9


@pytest.mark.parametrize("where", ["fc2 pre-hooks", "norm1 forward hooks"])
def test_an_ops_hook_dictionary_replaced_whole_is_refused_at_the_next_call(where):
    """``fc2._forward_pre_hooks = OrderedDict()`` (the norm's shared op: ``_forward_hooks``): the module stays, its op
    is gone with the dictionary. Before round 55 the guard read the old dictionary, which still held the op, so the
    model ran with wrong outputs until save; now the slot holding the dictionary is compared at every call."""
    from collections import OrderedDict

    model, probe, ref = _online_model()
    _run(model, probe)
    if where == "fc2 pre-hooks":
        model.encoder.layer[1].mlp.fc2._forward_pre_hooks = OrderedDict()
        line = r"^`encoder\.layer\.1\.mlp\.fc2` \(Linear\) has lost its online Hadamard"
    else:
        model.encoder.layer[0].norm1._forward_hooks = OrderedDict()
        line = r"^`encoder\.layer\.0\.norm1` \(\w+\) has lost its online Hadamard"
    assert _relative(_run(model, probe, hooks=False), ref) > 1e-3
    with pytest.raises(NormswapError, match=line):
        _run(model, probe)
    carry.carry_online_ops(model)
    assert _relative(_run(model, probe), ref) <= 1e-9


def test_an_ops_hook_dictionary_copied_whole_runs_and_is_watched_again():
    """A new hook dictionary that keeps the op runs (one full check), and the op removed from it later is refused."""
    from collections import OrderedDict

    model, probe, ref = _online_model()
    _run(model, probe)
    fc2 = model.encoder.layer[1].mlp.fc2
    fc2._forward_pre_hooks = OrderedDict(fc2._forward_pre_hooks)
    assert _relative(_run(model, probe), ref) <= 1e-9
    fc2._forward_pre_hooks.clear()
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.1\.mlp\.fc2` \(Linear\) has lost"):
        _run(model, probe)


def test_the_guard_compares_no_modules_edge_at_the_call():
    """The per-call work is two lookups per op (its hook entry, and the slot holding that hook dictionary): every
    ``_modules`` on the way is a watched dictionary, told of writes and held weakly, so none is read at the call
    (round 54 read the edge into each op's module and the slot of each watched dictionary too)."""
    model, probe, ref = _online_model()
    _run(model, probe)
    (guard,) = [h for h in model._forward_pre_hooks.values() if isinstance(h, carry.OpsGuard)]
    ops = carry.held_ops(model)
    assert len(guard.modules) == 2 * len(ops)
    checked = zip(guard.dicts, guard.names, strict=True)
    assert not any(type(d) is carry.WatchedModules or k == "_modules" for d, k in checked)
    on_the_way = {p.rpartition(".")[0] for p in ops} | {""}
    assert all(type(model.get_submodule(p).__dict__["_modules"]) is carry.WatchedModules for p in on_the_way)


def test_a_modules_dictionary_replaced_while_another_reference_keeps_it_is_refused_at_save(tmp_path):
    """The replaced dictionary is seen as it is freed: one kept alive elsewhere is not seen at the call (documented),
    but ``check_online_ops`` and save still refuse, and nothing is written."""
    model, probe, ref = _online_model()
    mlp = model.encoder.layer[0].mlp
    kept = mlp._modules
    mlp._modules = {**kept, "fc1": _fresh_fc1(model)}
    with pytest.raises(NormswapError, match=FC1_LOST):
        normswap.save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["own parent's _modules replaced whole", "hook dictionary replaced whole",
                                 "written into the own parent's _modules"])
def test_after_torch_compile_the_round_55_cases_are_refused_at_the_recompiled_call(how):
    """Compiled first, then edited: Dynamo recompiles and traces the guard. The trace that compiled the model keeps
    the old ``_modules`` alive in reference cycles (until the collector runs), so the guard's watched dictionaries
    are also compared as a compilation starts (a Dynamo compile-start callback): refused, then exact once carried."""
    from collections import OrderedDict

    model, probe, ref = _online_model()
    compiled = torch.compile(model, backend="eager")
    assert _relative(_run(compiled, probe), ref) <= 1e-9
    mlp = model.encoder.layer[0].mlp
    if how.startswith("own parent"):
        mlp._modules = {**mlp._modules, "fc1": _fresh_fc1(model)}
    elif how.startswith("hook"):
        mlp.fc1._forward_pre_hooks = OrderedDict()
    else:
        mlp._modules["fc1"] = _fresh_fc1(model)
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.0\.mlp\.fc1` \(\w+\) has lost its online Hadamard"):
        _run(compiled, probe)
    carry.carry_online_ops(model)
    assert _relative(_run(compiled, probe), ref) <= 1e-9



def test_torch_compile_reaches_the_guards_state_by_one_path_no_aliasing_guard_of_its_own():
    """Round 65: Dynamo used to trace the guard's comparison, reaching each op's hook (and hook dictionary) through
    the guard's tuples and again through the model's modules, and installed an object-aliasing guard per pair
    (``L['self'].dicts[0][121] is L['self'].modules[0]``, and the same hook by the module path), built as one Python
    lambda: most of a first compile's time on a PEFT model (``benchmarks/compile_guard_cost.py``). A compiled call
    now takes the comparison as a constant at trace time: none of Dynamo's guards (``TORCH_LOGS=guards``) reads
    the guard's recorded tuples. (The refusals after compiling, which those guards kept, are the tests above.)"""
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.extend(record.getMessage().splitlines())

    model, probe, _ = _online_model()
    torch._dynamo.reset()
    logger, keep = logging.getLogger("torch._dynamo.guards.__guards"), Keep()
    torch._logging.set_logs(guards=True)
    logger.addHandler(keep)
    try:
        with torch.no_grad(), default_dtype(torch.float64):
            torch.compile(model, backend="eager", fullgraph=True)(**probe)
    finally:
        logger.removeHandler(keep)
        torch._logging.set_logs()
        torch._dynamo.reset()
    guards = [line.split("#")[0] for line in lines if "_GUARD" in line or "_MATCH" in line]
    assert any("LAMBDA_GUARD" in g for g in guards)  # the log still shows Dynamo's own lambda guards
    assert not [g for g in guards if any(k in g for k in (".dicts[", ".names[", ".modules["))]


def test_after_torch_compile_an_ops_hook_removed_is_refused_at_the_recompiled_call():
    """Since round 65 a compiled call does not trace the guard's comparison: it guards on each op module's hook
    dictionary (by id and length), so ``handle.remove()`` after compiling still recompiles and is refused there."""
    model, probe, ref = _online_model()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    assert _relative(_run(compiled, probe), ref) <= 1e-9
    model.encoder.layer[1].mlp.fc2.__dict__[carry.HANDLE].remove()
    with pytest.raises(NormswapError, match=r"^`encoder\.layer\.1\.mlp\.fc2` \(Linear\) has lost its online Hadamard"):
        _run(compiled, probe)
    torch._dynamo.reset()
