"""Post-LN norms made exact by an MLP that cancels the stream's mean (``plan.MeanCarry``).

In BERT-style blocks the FFN-output norm reads ``h + down(act(up(h)))`` with ``h`` the previous
norm's output. ``act(t) - act(-t) = t`` for ReLU/GELU/SiLU-type activations, so two added neurons
compute ``mean(h)`` and the MLP subtracts it: the norm reads a zero-mean stream and is exactly an
RMSNorm. These tests check it in float64 against the original, on every Post-LN family in the zoo,
through a native and a compat checkpoint, and that an activation without the property is refused.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers as tf

import normswap
from normswap.analysis.plan import MeanCarry, int8_asym, int8_asym_step
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.surgery.verify import compare
from tests.zoo import APPROXIMATE, LLM, build, randomise


def _fp64_error(original, model, seed=5):
    probe = hf_example_inputs(model, seed=seed)
    with torch.no_grad(), default_dtype(torch.float64):
        return compare(original(**probe), model(**probe))["worst_rel_error_any_output"]


@pytest.mark.parametrize("name", sorted(APPROXIMATE))
def test_ffn_output_norms_become_exact_in_float64(name):
    model = build(APPROXIMATE, name)
    original = copy.deepcopy(model)
    report = normswap.patch(model, mode="exact")
    carries = report.plan.mean_carries
    # two layers, each with an FFN-output norm; ALBERT shares one layer across depth: one carry, in an
    # MLP that runs at every depth and cancels, at each call, the mean of what that call reads
    assert len(carries) >= (1 if name == "albert" else 2), report.plan.table()
    for c in carries:
        site = report.plan.site(c.site)
        assert site.verdict == "exact" and site.convert and "cancelled" in site.reason
        assert isinstance(model.get_submodule(c.site), normswap.RMSNorm)
        up, down = model.get_submodule(c.up), model.get_submodule(c.down)
        assert up.out_features == down.in_features == c.hidden + c.added
        assert (c.hidden + c.added) % 8 == 0 and c.added >= 2
    assert _fp64_error(original, model) <= 1e-9


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "quick_gelu"])
def test_activations_with_the_odd_split_carry_the_mean(act):
    torch.manual_seed(0)
    model = randomise(tf.BertModel(tf.BertConfig(**{**LLM, "hidden_act": act})))
    original = copy.deepcopy(model)
    report = normswap.patch(model, mode="exact")
    assert len(report.plan.mean_carries) == 2, report.plan.table()
    assert _fp64_error(original, model) <= 1e-9


def test_activation_without_the_odd_split_stays_approximate():
    torch.manual_seed(0)
    model = randomise(tf.BertModel(tf.BertConfig(**{**LLM, "hidden_act": "tanh"})))
    plan = normswap.plan(model)
    assert not plan.mean_carries
    assert all(s.verdict == "approximate" for s in plan.sites if "encoder" in s.name), plan.table()


def test_the_users_model_is_widened_and_a_failed_conversion_leaves_it_alone():
    model = build(APPROXIMATE, "bert")
    up = model.bert.encoder.layer[0].intermediate.dense
    before = up.weight.shape
    plan = normswap.plan(model)
    assert plan.mean_carries and up.weight.shape == before  # a dry run touches nothing
    normswap.patch(model, mode="exact")
    assert up.weight.shape[0] == before[0] + plan.mean_carries[0].added


def test_mean_carry_can_be_switched_off(tmp_path):
    """``mean_carry=False`` (``--no-mean-carry``): stock MLP widths, those norms approximate again."""
    model = build(APPROXIMATE, "bert")
    widths = {n: p.shape for n, p in model.named_parameters()}
    with_carry = normswap.plan(model)
    without = normswap.plan(model, mean_carry=False)
    assert with_carry.mean_carries and not without.mean_carries
    carried_sites = {c.site for c in with_carry.mean_carries}
    assert all(without.site(n).verdict == "approximate" for n in carried_sites), without.table()
    normswap.patch(model, options=normswap.ConvertOptions(mode="exact", mean_carry=False))
    after = dict(model.named_parameters(remove_duplicate=False))
    assert all(after[n].shape == shape for n, shape in widths.items() if "LayerNorm" not in n)
    assert all(isinstance(model.get_submodule(n), torch.nn.LayerNorm) for n in carried_sites)

    from click.testing import CliRunner

    from normswap.cli import main

    res = CliRunner().invoke(main, ["convert", "tiny-bert", "--out", str(tmp_path / "b"), "-q", "--no-mean-carry"])
    assert res.exit_code == 0, res.stderr
    manifest = json.loads((tmp_path / "b" / "config.json").read_text())["normswap"]
    assert manifest["plan"]["mean_carries"] == [] and manifest["counts"]["approximate"] == 4
    assert manifest["plan"]["options"]["mean_carry"] is False


def test_carry_width_pads_to_the_multiple_asked_for(tmp_path):
    """``carry_multiple`` (``--carry-multiple``): a weight quantizer that groups along the MLP's width
    (OpenVINO NNCF int4, groups of 128) refuses a width its group does not divide; the widened MLP is
    padded to the multiple asked for (zero neurons besides the carry's four) and stays exact, through
    a native checkpoint too. A bad multiple is a one-line usage error."""
    model = build(APPROXIMATE, "bert")
    original = copy.deepcopy(model)
    report = normswap.patch(model, mode="exact", carry_multiple=48)
    carries = report.plan.mean_carries
    assert len(carries) == 2 and report.plan.options["carry_multiple"] == 48
    for c in carries:  # 64 + 4 needs a second group of 48: 96
        assert c.hidden + c.added == 96 and model.get_submodule(c.up).out_features == 96
        down = model.get_submodule(c.down).weight
        assert torch.count_nonzero(down[:, c.hidden + MeanCarry.NEURONS:]) == 0  # the padding neurons write nothing
    assert _fp64_error(original, model) <= 1e-9
    normswap.save(model, tmp_path / "n")
    assert _fp64_error(original, normswap.load(tmp_path / "n", dtype=torch.float64).eval()) <= 1e-9

    from click.testing import CliRunner

    from normswap.cli import main

    res = CliRunner().invoke(main, ["convert", "tiny-bert", "--out", str(tmp_path / "b"), "-q",
                                    "--carry-multiple", "128"])
    assert res.exit_code == 0, res.stderr
    manifest = json.loads((tmp_path / "b" / "config.json").read_text())["normswap"]
    assert manifest["plan"]["options"]["carry_multiple"] == 128
    assert all((c["hidden"] + c["added"]) % 128 == 0 for c in manifest["plan"]["mean_carries"])
    res = CliRunner().invoke(main, ["convert", "tiny-bert", "--out", str(tmp_path / "c"), "--carry-multiple", "0"])
    assert res.exit_code == 2 and "--carry-multiple" in res.stderr and not (tmp_path / "c").exists()
    with pytest.raises(normswap.NormswapError, match="carry_multiple must be a whole number"):
        normswap.plan(build(APPROXIMATE, "bert"), carry_multiple=True)


@pytest.mark.parametrize("fmt", ["native", "compat"])
def test_checkpoints_round_trip(tmp_path, fmt):
    model = build(APPROXIMATE, "bert")
    original = copy.deepcopy(model)
    normswap.patch(model, mode="exact")
    normswap.save(model, tmp_path / fmt, format=fmt)
    if fmt == "native":
        loaded = normswap.load(tmp_path / fmt, dtype=torch.float64)
        for carry in normswap.plan_of(loaded).mean_carries:  # the two-scale carry, as written
            assert loaded.get_submodule(carry.up).out_features == carry.hidden + carry.added
            _assert_two_scale_carry(loaded.get_submodule(carry.up).weight.detach().double(),
                                    loaded.get_submodule(carry.down).weight.detach().double(), carry)
    else:  # stock transformers, stock width: the norm is a LayerNorm again and ignores the mean
        loaded = tf.BertForMaskedLM.from_pretrained(tmp_path / fmt, dtype=torch.float64)
        assert loaded.bert.encoder.layer[0].intermediate.dense.out_features == original.config.intermediate_size
    assert _fp64_error(original, loaded.eval()) <= 1e-9


@pytest.mark.parametrize("name", sorted(APPROXIMATE))
def test_half_precision_costs_about_what_the_dtype_costs(name):
    """The carry neurons (rows ±1/d, columns ∓1) round like any weight: the converted model in bf16/fp16
    is about as far from the float64 original as the original in that dtype (the bounds of
    tests/surgery/test_bf16_fidelity.py for the shipped backends)."""
    from normswap.inputs import cast_inputs
    from normswap.surgery.verify import dtype_error_ratio

    model = build(APPROXIMATE, name)
    probe = hf_example_inputs(model, batch=8, seq=32, seed=11)
    with torch.no_grad(), default_dtype(torch.float64):
        reference = model(**probe)
    converted = copy.deepcopy(model)
    report = normswap.patch(converted, mode="exact")
    for dtype, bound in ((torch.bfloat16, 1.25), (torch.float16, 1.3)):
        args, kwargs = cast_inputs((), probe, dtype)
        with torch.no_grad():
            original = compare(reference, copy.deepcopy(model).to(dtype)(*args, **kwargs))
            ours = compare(reference, copy.deepcopy(converted).to(dtype)(*args, **kwargs),
                           set(report.plan.changed_outputs))
        assert dtype_error_ratio(original, ours) <= bound, (name, dtype)


def _int8_per_tensor(w: torch.Tensor) -> torch.Tensor:
    """``w`` through symmetric per-tensor int8 (ONNX Runtime ``quantize_dynamic``'s weights: step max|w|/127),
    dequantized, in float64."""
    step = w.abs().max() / 127
    return torch.round(w / step).clamp(-127, 127) * step


def _exact_carries(model):
    """Patch ``model`` exactly (checked against its float64 original) and return the plan's mean carries (some)."""
    original = copy.deepcopy(model)
    normswap.patch(model, mode="exact")
    assert _fp64_error(original, model) <= 1e-9
    carries = normswap.plan_of(model).mean_carries
    assert carries
    return carries


def _one_scale_gain(up_real: torch.Tensor, down_real: torch.Tensor, scale: float, d: int) -> float:
    """The gain ``(s/d)·d·(1/s)`` of one carry pair at ``scale`` (a row ``s/d``, a constant column ``1/s``: the
    scale :meth:`MeanCarry.scale_for` chooses is judged on it) after per-tensor int8 rounding of ``up`` and
    ``down`` widened by that pair (1 in float)."""
    up = torch.cat([up_real, torch.full((1, d), scale / d, dtype=up_real.dtype)])
    down = torch.cat([down_real, torch.full((d, 1), 1 / scale, dtype=down_real.dtype)], dim=1)
    return float(_int8_per_tensor(up)[-1, 0] * d * _int8_per_tensor(down)[0, -1])


def _assert_two_scale_carry(up: torch.Tensor, down: torch.Tensor, c, atol: float = 1e-12) -> None:
    """The carry as round 65 writes it (see :class:`MeanCarry`), on ``up``/``down`` as written (float64 view):
    four ± pairs, scales ``s`` then ``s/SECOND_RATIO``, each on the even then the odd features; in each row of
    ``down`` the first pairs' entry ``c1`` is a whole number of that row's INT8_ASYM steps (NNCF's int8 weights,
    from the row's real entries in float32), within half a step of ``1/s``, and NNCF's rounding of the whole row
    keeps it; ``c1·s + c2·s₂ = 1`` in every row (``atol``: 1e-12 for float64 weights, float32's rounding of
    ``c2`` for a float32 checkpoint); the padding neurons are zero."""
    n, d, s = c.hidden, c.features, float(c.scale)
    scales = (s, s / MeanCarry.SECOND_RATIO)
    c1, c2 = -down[:, n], -down[:, n + 4]
    for k, col in enumerate((c1, c2)):
        for pair, first in enumerate((0, 1)):  # a ± pair on the even features, then one on the odd
            m = n + 4 * k + 2 * pair
            assert torch.equal(down[:, m], -col) and torch.equal(down[:, m + 1], col)
            torch.testing.assert_close(up[m, first::2], torch.full_like(up[0, first::2], scales[k] / d))
            assert not up[m, 1 - first::2].any()
            assert torch.equal(up[m + 1], -up[m])
    assert c.added >= MeanCarry.NEURONS == 8
    assert not down[:, n + MeanCarry.NEURONS:].any() and not up[n + MeanCarry.NEURONS:].any()  # padding: zero
    step = int8_asym_step(down[:, :n]).double()
    assert bool((step > 0).all())
    count = c1 / step
    assert torch.allclose(count, count.round(), rtol=0, atol=1e-4), float((count - count.round()).abs().max())
    assert bool((count.round() >= 1).all())
    assert float(((c1 - 1 / s).abs() / step).max()) <= 0.5 + 1e-4  # each row's grid point nearest 1/s
    assert not torch.equal(c1, torch.full_like(c1, c1[0]))  # per row, not one constant column
    torch.testing.assert_close(c1 * scales[0] + c2 * scales[1], torch.ones_like(c1), rtol=0, atol=atol)
    # NNCF's rounding of the row as exported keeps c1 wherever it lies inside the row's real range
    inside = (c1 <= down[:, :n].amax(1)) & (-c1 >= down[:, :n].amin(1))
    assert int(inside.sum()) >= 1
    rounded = int8_asym(down.float())[:, n].double()
    torch.testing.assert_close(rounded[inside], -c1[inside].float().double(), rtol=1e-6, atol=0)


def test_carry_first_entries_lie_on_each_rows_int8_asym_grid_and_set_no_rows_weight_scale():
    """NNCF's int8 weights (INT8_ASYM, one grid per row of ``down``) round a constant column ``1/s`` differently in
    every row; the carry's first pairs take each row's grid point nearest ``1/s`` and second pairs at ``s/16`` take
    the remainder, exactly in float64 (see :func:`_assert_two_scale_carry`). ``1/s`` stays no larger than any row's
    own largest weight (per output channel the real rows keep their scales) and as close to 1 in per-tensor gain
    as whole steps of ``down`` would be (``scale_for``'s choice of ``s``, unchanged). The replica's FFN output
    dense has an all-mpnet-like outlier (one weight ~60x the rms)."""
    model = build(APPROXIMATE, "bert")
    with torch.no_grad():  # a trained-like spread: rows that peak well below 1, one outlier weight
        for i, layer in enumerate(model.bert.encoder.layer):
            w = layer.output.dense.weight
            w.mul_(0.2 / w.abs().max())
            w[3, 5] = 0.71 + 0.29 * i
    for c in _exact_carries(model):
        down = model.get_submodule(c.down).weight.detach().double()
        up = model.get_submodule(c.up).weight.detach().double()
        _assert_two_scale_carry(up, down, c)
        real = down[:, :c.hidden]
        peaks, step = real.abs().amax(dim=1), float(real.abs().max()) / 127
        col = 1 / c.scale
        assert col <= max(float(peaks.min()), step) * (1 + 1e-6)  # within every row's peak
        # per tensor, the scale keeps the gain as well as whole steps of down would
        whole = 1 / (max(1, round(col / step)) * step) if col >= step else 1 / step
        d = c.features
        assert abs(_one_scale_gain(up[:c.hidden], real, c.scale, d) - 1) <= \
            abs(_one_scale_gain(up[:c.hidden], real, whole, d) - 1) + 1e-6


def test_carry_is_as_wide_as_its_per_tensor_gain_allows():
    """The invariant the carry's scale rests on: the per-tensor gain ``round(P·x)·round(1/x)/P`` (``x = s·step``
    of ``down``, ``P = 1/(d·step_down·step_up)``) is piecewise constant in ``s``, so among the scales whose
    gain after per-tensor rounding of both matrices is no further from 1 than the fewest whole steps' (and
    whose row stays at most half the longest real ``up`` row), the carry takes the largest: its activations
    ``±s·mean(h)`` span the most uint8 steps, and their rounding comes back divided by ``s``. Here one
    outlier in each ``up`` sets ``P = 0.7`` (an all-mpnet-like layer 7 has 0.53): at one whole step the
    gain is ``1/0.7`` after rounding, and it stays so up to ``x = 2``, where ``1/s`` would round to no step
    at all; the carry widens to just under that (a 3% margin from the boundary). The choice before
    (``1/s`` exactly one step) fails the width."""
    model = build(APPROXIMATE, "bert")
    d = model.config.hidden_size
    with torch.no_grad():
        for layer in model.bert.encoder.layer:
            w = layer.output.dense.weight
            w.mul_(0.2 / w.abs().max())
            w[3, 5] = 1.0
            wc = w - w.mean(0, keepdim=True)
            step = float(wc.abs().max()) / 127
            layer.intermediate.dense.weight[0, 0] = 127 / (0.7 * d * step)  # P = 127²/(d·max|down|·max|up|)
    original = copy.deepcopy(model)
    normswap.patch(model, mode="exact")
    assert _fp64_error(original, model) <= 1e-9
    carries = normswap.plan_of(model).mean_carries
    assert len(carries) == 2
    for c in carries:
        down = model.get_submodule(c.down).weight.detach().double()
        up = model.get_submodule(c.up).weight.detach().double()
        real, step = down[:, :c.hidden], float(down[:, :c.hidden].abs().max()) / 127
        x = c.scale * step
        # wider than one whole step (round 65: not the widest; where the symmetric gain allows, the scale whose
        # asymmetric uint8 gain, then whose up rows, round best: tests/surgery/test_carry_gain.py)
        assert 1 < x <= 2 / (1 + MeanCarry.GAIN_MARGIN) * (1 + 1e-6), x
        longest = float(original.get_submodule(c.up).weight.detach().norm(dim=1).max())
        assert c.scale / d ** 0.5 <= 0.5 * longest  # the carry row: at most half the longest real row
        g = _one_scale_gain(up[:c.hidden], real, c.scale, d)
        g_whole = _one_scale_gain(up[:c.hidden], real, 1 / step, d)
        assert abs(g_whole - 1) > 0.3  # the replica's grids: no scale keeps the gain
        assert abs(g - 1) <= abs(g_whole - 1) + 1e-6, (g, g_whole)


def test_carry_takes_the_fewest_grid_steps_its_row_length_allows_and_stays_inside_the_activation_range():
    """``1/s`` is the *fewest* whole per-tensor int8 steps of ``down`` for which the carry neuron's ``up`` row
    (length ``s/√d``) is at most half the longest real ``up`` row: the carry's activations ``±s·mean(h)``
    then span as many of the intermediate's dynamic uint8 steps as they can (their rounding, times ``1/s``,
    lands in the mean direction the RMSNorm keeps), without becoming the intermediate's largest neuron.
    Layer 0's ``up`` rows are long enough for one step; layer 1's cap the carry at four (from there
    ``test_carry_is_as_wide_as_its_per_tensor_gain_allows`` widens it within the same row bound). The
    choice before (the most steps within the row peaks, 30-40 here) fails both."""
    model = build(APPROXIMATE, "bert")
    d = model.config.hidden_size
    with torch.no_grad():
        for i, layer in enumerate(model.bert.encoder.layer):
            w = layer.output.dense.weight
            w.mul_(0.2 / w.abs().max())
            w[3, 5] = 1.0  # the outlier sets the per-tensor step: 1/127
            wc = w - w.mean(0, keepdim=True)
            step = float(wc.abs().max()) / 127
            row = 1 / (step * d ** 0.5)  # the carry row's length at one step
            up = layer.intermediate.dense.weight
            up.mul_((2.02 if i == 0 else 0.6) * row / up.norm(dim=1).max())  # room for 1 step / for 1/0.3 -> 4
    original = copy.deepcopy(model)
    normswap.patch(model, mode="exact")
    assert _fp64_error(original, model) <= 1e-9
    carries = sorted(normswap.plan_of(model).mean_carries, key=lambda c: c.down)
    assert len(carries) == 2
    reach: dict[str, list[torch.Tensor]] = {}
    hooks = [model.get_submodule(c.up).register_forward_hook(
        lambda mod, args, out, c=c: reach.setdefault(c.up, []).append(out.detach().abs().flatten(0, -2)))
        for c in carries]
    probe = hf_example_inputs(model, seed=3)
    with torch.no_grad():
        model(**probe)
    for h in hooks:
        h.remove()
    for c, expected_k in zip(carries, (1, 4), strict=True):
        down = model.get_submodule(c.down).weight.detach().double()
        real = down[:, :c.hidden]
        step = float(real.abs().max()) / 127
        k = 1 / c.scale / step
        # at least as wide as the fewest whole steps (it widens further only where the per-tensor gain allows)
        assert expected_k - 1 < k <= expected_k * (1 + 1e-6), (c.down, k)
        longest = float(original.get_submodule(c.up).weight.detach().norm(dim=1).max())
        assert c.scale / d ** 0.5 <= 0.5 * longest * (1 + 1e-9)  # the carry row is at most half the longest
        if expected_k > 1:  # one step fewer would make it longer
            assert 1 / ((expected_k - 1) * step) / d ** 0.5 > 0.5 * longest
        # on real inputs the carry neurons' pre-activations (±s·mean(h)) stay inside the real neurons' range
        pre = torch.cat(reach[c.up])
        assert float(pre[:, c.hidden:c.hidden + MeanCarry.NEURONS].max()) <= float(pre[:, :c.hidden].max())


def test_carry_rows_fit_int8_gemms_that_add_product_pairs_in_int16():
    """x86 int8 GEMMs without VNNI (AVX2 ``vpmaddubsw``: ONNX Runtime's u8s8 kernels) add each adjacent pair of
    uint8 activation × int8 weight products in a saturating int16. Per output channel a carry row is rounded to
    ±127 wherever it is nonzero; a pair of those meeting two large activations (255) would need 64,770 > 32,767,
    and the carried mean came out clipped (all-MiniLM-L6-v2 on an AVX2 machine: 11x the original's int8 error).
    Every carry row has at most one nonzero weight in each pair, so its worst pair fits; the model stays exact."""
    model = build(APPROXIMATE, "bert")
    for c in _exact_carries(model):
        up = model.get_submodule(c.up).weight.detach().double()
        rows = up[c.hidden:c.hidden + MeanCarry.NEURONS]
        q = torch.round(rows / rows.abs().amax(dim=1, keepdim=True) * 127).abs()  # per-channel symmetric int8
        pairs = q[:, :c.features // 2 * 2].reshape(len(q), -1, 2).sum(-1)  # the kernel's adjacent pairs
        assert float(pairs.max()) * 255 <= 32767, f"{c.up}: a carry row's pair needs {float(pairs.max()) * 255:.0f}"


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_patch_and_the_streamed_rewrite_write_the_same_carry(tmp_path, dtype):
    """``normswap convert`` in memory (``patch``) and streamed (``--low-memory``, ``checkpoint.rewrite``) write the
    same bits for every tensor, the two-scale carry's per-row entries included (computed from ``down``'s real
    rows in float32, ``c2`` in float64, cast once), in float32 and in bfloat16; the streamed float32 carry is
    the two-scale one and exact in float64."""
    from safetensors.torch import load_file

    from tests.streaming_models import MODELS as STREAMING_MODELS

    cls, config = STREAMING_MODELS["bert"]()
    torch.manual_seed(0)
    source = randomise(cls(config)).float().eval()  # a float32 checkpoint, as published
    source.save_pretrained(tmp_path / "src")
    options = {"mode": "exact", **({"dtype": dtype} if dtype else {})}
    normswap.convert(tmp_path / "src", tmp_path / "mem", low_memory=False, **options)
    report = normswap.convert(tmp_path / "src", tmp_path / "low", low_memory=True, **options)
    assert report.streamed
    mem, low = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("mem", "low"))
    assert sorted(mem) == sorted(low)
    assert not [k for k in mem if mem[k].dtype != low[k].dtype or not torch.equal(mem[k], low[k])]
    loaded = normswap.load(tmp_path / "low", dtype=torch.float64).eval()
    carries = normswap.plan_of(loaded).mean_carries
    assert len(carries) == config.num_hidden_layers
    if dtype is None:
        for c in carries:
            _assert_two_scale_carry(loaded.get_submodule(c.up).weight.detach().double(),
                                    loaded.get_submodule(c.down).weight.detach().double(), c, atol=1e-9)
        original = tf.BertForMaskedLM.from_pretrained(tmp_path / "src", dtype=torch.float64)
        assert _fp64_error(original.eval(), loaded) <= 1e-6  # float32 weights, float64 arithmetic


@pytest.mark.parametrize("intermediate, multiple, width", [(64, 8, 72), (64, 1, 72), (68, 8, 80), (61, 8, 72)])
def test_the_carry_takes_eight_neurons_and_the_next_multiple_past_them(intermediate, multiple, width):
    """Eight carry neurons (round 65; four before): the widened width is the next multiple of ``carry_multiple``
    with room for them. A width that is a multiple of 8 grows by 8 as with four neurons (64 -> 72); ``carry_multiple``
    1 adds exactly 8; a width 1-4 past a multiple of 8 takes one more block than four neurons did (68 -> 80, was
    72). Planning only: the plan records what ``patch`` and the streamed rewrite will widen."""
    torch.manual_seed(0)
    model = randomise(tf.BertModel(tf.BertConfig(**{**LLM, "intermediate_size": intermediate})))
    carries = normswap.plan(model, carry_multiple=multiple).mean_carries
    assert len(carries) == 2
    assert all(c.hidden == intermediate and c.hidden + c.added == width for c in carries)
    assert all(c.added >= MeanCarry.NEURONS == 8 for c in carries)
