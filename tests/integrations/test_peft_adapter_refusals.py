"""PEFT adapters on Linears under edits round 55's adapter bases did not model (round 56).

Round 54/55 made an adapter act as on the original model where the conversion folded γ/β into a reader or
centered a writer (tests/integrations/test_peft_adapter_bases.py). Elsewhere it ran on the converted Linear's own
input and output: silently not the original's. Measured before this round on float64 replicas
(benchmarks/peft_edit_gaps.py: a random LoRA, its delta on the output against the same LoRA's delta on the
original): a bias-less value projection whose β share moved through attention 0.26-0.41 of the delta off, a
stream rotated by ``rotate("hadamard")`` 0.86-1.45, a mean carry's or a centered reader's Linears 1.5-1.6.
Now a rotated stream is mapped like the folds (``lora_A`` reads ``x·Qᵀ``, ``lora_B``'s output is turned by
``Q``: exact), and the rest is refused as PEFT attaches it, in one line naming the Linear and the reason (the
plan's ``adapter_bases`` record ``{"kind", "refuse"}``, so it survives a save and a load), before the Linear is
replaced. The refusal and rotation tests fail on main (the attach succeeds / the adapter is off).

Float64 replicas built from configs, LayerNorm γ/β randomised."""

from __future__ import annotations

import copy

import pytest
import torch

import normswap
from normswap.analysis.plan import REFUSE_ROTATED, plan_of
from normswap.errors import NormswapError
from normswap.inputs import hf_example_inputs
from normswap.rotation import carry
from normswap.rotation.rotate import rotate
from tests.custom_models import ProjLM, randomise
from tests.integrations.test_peft_adapter_bases import assert_acts_as
from tests.integrations.test_peft_online_ops import _out, _relative
from tests.zoo import APPROXIMATE, EXACT, MORE, build

peft = pytest.importorskip("peft")


def _lora(model, targets, seed=1, **kw):
    torch.manual_seed(seed)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False, **kw))


def _refused(model, probe, targets, path, why, **kw):
    """Attaching LoRA on ``targets`` raises one line naming ``path`` and ``why``; the model is left as it was."""
    before = _out(model, probe)
    with pytest.raises(NormswapError, match="is refused") as info:
        _lora(model, targets, **kw)
    line = str(info.value)
    assert "\n" not in line and f"`{path}`" in line and why in line, line
    assert not hasattr(model.get_submodule(path), "base_layer")  # that Linear is not wrapped
    assert _relative(_out(model, probe), before) == 0.0
    return line


def dinov3_no_value_bias():
    """A DINOv3 ViT without value bias (γ/β randomised) patched with ``beta_placement="fold"``, so its norms' β
    moves through attention: ``(original, converted, probe)``. Also ``benchmarks/peft_edit_gaps.py``'s case."""
    cls, config = MORE["dinov3-vit-no-value-bias"][0]()
    torch.manual_seed(0)
    from tests.zoo import randomise as zoo_randomise

    original = zoo_randomise(cls(config), 0)
    probe = hf_example_inputs(original, seed=5)
    converted = copy.deepcopy(original)
    normswap.patch(converted, beta_placement="fold")
    return original, converted, probe


def test_a_value_projection_whose_beta_moved_through_attention_is_refused():
    original, converted, probe = dinov3_no_value_bias()
    moves = plan_of(converted).beta_moves
    assert moves and all(plan_of(converted).adapter_bases[m.reader].get("refuse") for m in moves)
    _refused(converted, probe, ["v_proj"], moves[0].reader, "through attention into the output projection's bias")
    # the query (β folded into its own bias) still acts as on the original
    ref = _out(_lora(copy.deepcopy(original), ["q_proj"]), probe)
    assert _relative(_out(_lora(converted, ["q_proj"]), probe), ref) <= 1e-9


def test_beta_moved_custom_attention_is_refused_and_keep_leaves_it_exact():
    ids = (torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(0)),)
    torch.manual_seed(0)
    original = randomise(ProjLM(v_bias=False))
    converted = copy.deepcopy(original)
    normswap.patch(converted, example_inputs=ids, mode="exact", beta_placement="fold")
    with pytest.raises(NormswapError, match=r"`blocks\.0\.attn\.v` is refused .*beta_placement='keep'"):
        _lora(converted, ["attn.v"])
    kept = copy.deepcopy(original)
    normswap.patch(kept, example_inputs=ids, mode="exact", beta_placement="keep")
    with torch.no_grad():
        ref, out = _lora(copy.deepcopy(original), ["attn.v"])(ids[0]), _lora(kept, ["attn.v"])(ids[0])
    assert _relative(out, ref) <= 1e-9


def test_the_centered_reader_of_an_approximate_norm_is_refused():
    model = build(APPROXIMATE, "bert")
    probe = hf_example_inputs(model, seed=5)
    normswap.patch(model)
    readers = [r.reader for r in plan_of(model).centered_readers]
    assert readers
    _refused(model, probe, ["intermediate.dense"], readers[0], "an approximate RMSNorm leaks")


def test_the_linears_a_mean_carry_widened_are_refused():
    model = build(APPROXIMATE, "bert")
    probe = hf_example_inputs(model, seed=5)
    normswap.patch(model, mode="exact")
    carries = plan_of(model).mean_carries
    assert carries
    _refused(model, probe, ["intermediate.dense"], carries[0].up, "--no-mean-carry")
    _refused(model, probe, r".*layer\.\d+\.output\.dense", carries[0].down, "--no-mean-carry")


def test_a_post_ln_residual_fold_refuses_its_readers_and_leaves_its_writers_as_with_beta_kept():
    """A Post-LN norm's β folded through the residual: its readers' input lacks β (refused); its residual
    writers' output joins the same sum, so an adapter there acts as on the conversion that keeps β in the norm."""
    model = build(APPROXIMATE, "bert")
    probe = hf_example_inputs(model, seed=5)
    kept = copy.deepcopy(model)
    normswap.patch(model, beta_placement="fold", mean_carry=False)
    normswap.patch(kept, beta_placement="keep", mean_carry=False)
    folds = plan_of(model).residual_folds
    assert folds and folds[0].readers and folds[0].writers, plan_of(model).table()
    assert _relative(_out(model, probe), _out(kept, probe)) <= 1e-9  # the same calibration, β moved
    reader = folds[0].readers[0]
    _refused(model, probe, [reader], reader, "folded through the residual")
    writers = sorted({w for rf in folds for w in rf.writers})
    ref = _out(_lora(kept, writers), probe)
    lora = _lora(model, writers)
    assert _relative(_out(lora, probe), ref) <= 1e-9
    assert _relative(_out(lora.merge_and_unload(), probe), ref) <= 1e-9


ROTATED = [
    ("gpt2", ["c_attn"], {"fan_in_fan_out": True}),  # a reader of the rotated stream
    ("gpt2", ["c_attn", "c_proj", "c_fc"], {"fan_in_fan_out": True}),  # readers and writers
    ("opt", ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], {}),
    ("opt", ["lm_head"], {}),  # the head reads the last norm's (turned) output
]


@pytest.mark.parametrize("online", [False, True])
@pytest.mark.parametrize("name,targets,kw", ROTATED, ids=[f"{c[0]}-{'+'.join(c[1])}" for c in ROTATED])
def test_lora_on_a_rotated_stream_acts_as_on_the_original(name, targets, kw, online):
    """A rotation is a reader/writer map like the conversion's folds: ``lora_A`` reads ``x·Qᵀ``, ``lora_B``'s
    output is turned by ``Q``; merges add ``ΔW·Q`` to a reader, ``Qᵀ·ΔW`` to a writer (round 56; before, the
    adapter ran on the turned stream: its delta 0.86-1.45 of its size off)."""
    original = build(EXACT, name)
    probe = hf_example_inputs(original, seed=5)
    model = copy.deepcopy(original)
    normswap.patch(model, fold_gamma=True)
    rotate(model, "hadamard", seed=2, online=online)
    assert _relative(_out(model, probe), _out(original, probe)) <= 1e-9
    bases = plan_of(model).adapter_bases
    assert any(r.get("turn_in") for r in bases.values()) and any(r.get("turn_out") for r in bases.values())
    ref = _out(_lora(copy.deepcopy(original), targets, **kw), probe)
    assert _relative(ref, _out(original, probe)) > 1e-4
    lora = _lora(model, targets, **kw)
    assert_acts_as(lora, probe, ref)


def test_a_rotated_stream_survives_save_and_load_and_a_pre_56_rotated_manifest_refuses(tmp_path):
    original = build(EXACT, "opt")
    probe = hf_example_inputs(original, seed=5)
    model = copy.deepcopy(original)
    normswap.patch(model, fold_gamma=True)
    rotate(model, "random", seed=3)
    normswap.save(model, tmp_path / "ckpt")
    loaded = normswap.load(tmp_path / "ckpt", dtype=torch.float64)
    targets = ["q_proj", "fc1", "fc2", "out_proj"]
    ref = _out(_lora(copy.deepcopy(original), targets), probe)
    assert _relative(_out(_lora(copy.deepcopy(loaded), targets), probe), ref) <= 1e-9
    # a checkpoint rotated before round 56 recorded its γ/β bases only (no Q), and its rotations no
    # "adapter_bases": every recorded Linear refuses
    plain = copy.deepcopy(original)
    normswap.patch(plain, fold_gamma=True)
    plan = plan_of(loaded)
    plan.adapter_bases = copy.deepcopy(plan_of(plain).adapter_bases)
    plan.adapter_vectors = dict(plan_of(plain).adapter_vectors)
    for r in plan.rotations:
        r.pop("adapter_bases", None)
    carry.mark_bases(loaded, plan)
    _refused(loaded, probe, ["fc1"], "model.decoder.layers.0.fc1", "before round 56")


def test_a_rotated_embedding_and_a_smoothed_stream_refuse():
    original = build(EXACT, "opt")
    probe = hf_example_inputs(original, seed=5)
    model = copy.deepcopy(original)
    normswap.patch(model, fold_gamma=True)
    rotate(model, "hadamard", seed=2)
    assert plan_of(model).adapter_bases["model.decoder.embed_tokens"]["refuse"]  # (centered, then turned)
    with pytest.raises(NormswapError, match="`model.decoder.embed_tokens` is refused"):
        _lora(model, ["embed_tokens"])
    smoothed = copy.deepcopy(original)
    normswap.patch(smoothed, fold_gamma=True)
    rotate(smoothed, "hadamard", seed=2, smooth=0.5, calibration=[probe])
    bases = plan_of(smoothed).adapter_bases
    assert bases["model.decoder.layers.0.fc1"]["refuse"] == REFUSE_ROTATED
    _refused(smoothed, probe, ["fc1"], "model.decoder.layers.0.fc1", "smoothing")


def test_the_hint_works_merge_before_rotating():
    """What the rotation refusal says to do: attach and merge on the converted model, then rotate."""
    original = build(EXACT, "opt")
    probe = hf_example_inputs(original, seed=5)
    targets = ["q_proj", "v_proj", "fc1", "fc2"]
    ref = _out(_lora(copy.deepcopy(original), targets), probe)
    model = copy.deepcopy(original)
    normswap.patch(model, fold_gamma=True)
    merged = _lora(model, targets).merge_and_unload()
    rotate(merged, "hadamard", seed=2)
    assert _relative(_out(merged, probe), ref) <= 1e-9


def test_online_ops_without_a_turned_stream_still_take_adapters():
    """rotate("none", online=True) turns no stream: its Linears keep their bases (exact, not refused)."""
    original = build(EXACT, "opt")
    probe = hf_example_inputs(original, seed=5)
    model = copy.deepcopy(original)
    normswap.patch(model, beta_placement="keep")
    rotate(model, "none", online=True, seed=4)
    bases = plan_of(model).adapter_bases
    assert not any(r.get("refuse") for p, r in bases.items() if p.endswith(("q_proj", "fc2"))), bases
    ref = _out(_lora(copy.deepcopy(original), ["q_proj", "fc2"]), probe)
    assert _relative(_out(_lora(model, ["q_proj", "fc2"]), probe), ref) <= 1e-9


def test_merging_lora_on_a_value_projection_that_took_beta_under_online_ops():
    """rotate("none", online=True) with β folded into the value projection's bias: the adapter's β share that a
    merge adds to that bias is turned per head like the rows (before round 56 it was added unturned: the merged
    model 0.04 off the unmerged one on this replica, the unmerged adapter exact)."""
    original = build(EXACT, "opt")
    probe = hf_example_inputs(original, seed=5)
    model = copy.deepcopy(original)
    normswap.patch(model)
    rotate(model, "none", online=True, seed=4)
    assert any(r.get("beta") for p, r in plan_of(model).adapter_bases.items() if p.endswith("v_proj"))
    ref = _out(_lora(copy.deepcopy(original), ["v_proj"]), probe)
    lora = _lora(model, ["v_proj"])
    assert _relative(_out(lora, probe), ref) <= 1e-9
    lora.merge_adapter()
    assert _relative(_out(lora, probe), ref) <= 1e-9
    lora.unmerge_adapter()
    assert _relative(_out(lora.merge_and_unload(), probe), ref) <= 1e-9


def test_lora_on_a_stream_turned_by_a_user_matrix_acts_as_on_the_original():
    from normswap.rotation.rotate import rotation_matrix

    original = build(EXACT, "gpt2")
    probe = hf_example_inputs(original, seed=5)
    model = copy.deepcopy(original)
    normswap.patch(model, fold_gamma=True)
    rotate(model, rotation_matrix(32, "random", 7)[0])  # orthogonal and mean-preserving
    targets, kw = ["c_attn", "c_proj", "c_fc"], {"fan_in_fan_out": True}
    ref = _out(_lora(copy.deepcopy(original), targets, **kw), probe)
    lora = _lora(model, targets, **kw)
    assert _relative(_out(lora, probe), ref) <= 1e-9
    assert _relative(_out(lora.merge_and_unload(), probe), ref) <= 1e-9
