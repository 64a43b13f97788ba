"""Pieces of ``benchmarks/whisper_paired_draws.py``: the exact reordering that draws another 4-bit rounding of a
Whisper's writers, applied alike to the original and its compat conversion, and the native-format variant
(RMSNorm with one centering op) of the conversion.

What could be silently wrong: a reordering that changes the function (a "draw" would then measure another
model), one that leaves every ``MatMulNBits`` block of a writer as it was (no draw), a reader whose blocks
change (the draw would no longer be of the writers only), a converted draw that is not the conversion of the
original's draw with the same seed (no pair), and an ``rms`` variant that is not the conversion's function.
Round 49's pieces: the HQQ simulation against ONNX Runtime's own quantizer and kernel, the rounding cache (a hit
must be the same rounding), runs joined clip by clip, the per-pair tests, and the writer swaps that attribute
the conversion's excess to the encoder or the decoder (they must compute the original's function).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as tf

from tests import benchmark_modules

draws = benchmark_modules.load("whisper_paired_draws")
groups = benchmark_modules.load("whisper_nbits_groups")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    import normswap

    root = tmp_path_factory.mktemp("whisper_draws")
    benchmark_modules.tiny_whisper().double().save_pretrained(root / "orig")  # float64 on disk: "auto" keeps it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # untied as the benchmark's checkpoints were (its native-shaped variant centers the decoder table by weights)
        normswap.convert(root / "orig", root / "compat", format="compat", dtype="auto", untie=True)
    original = tf.WhisperForConditionalGeneration.from_pretrained(root / "orig", dtype=torch.float64).eval()
    converted = tf.WhisperForConditionalGeneration.from_pretrained(root / "compat", dtype=torch.float64).eval()
    g = torch.Generator().manual_seed(1)
    inputs = {"input_features": torch.randn(2, 8, 32, generator=g, dtype=torch.float64),
              "decoder_input_ids": torch.randint(1, 99, (2, 6), generator=g)}
    return original.double(), converted, inputs


def _logits(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_a_draw_is_exact_for_the_original_and_its_conversion(models) -> None:
    original, converted, inputs = models
    ref = _logits(original, inputs)
    assert _rel(_logits(converted, inputs), ref) < 1e-9  # the compat conversion itself, float64
    for model in (original, converted):
        for seed in (1, 2):
            assert _rel(_logits(draws.reordered(model, seed), inputs), ref) < 1e-9
    assert draws.reordered(original, 0) is original  # seed 0: the model as shipped


def test_a_draw_rounds_other_writer_blocks_and_the_same_reader_rows(models) -> None:
    original, _, _ = models
    drawn = draws.reordered(original, 3)
    redrawn = []
    for name, new in drawn.named_modules():
        if not isinstance(new, torch.nn.Linear) or name == "proj_out":
            continue
        old = original.get_submodule(name)
        if name.rsplit(".", 1)[-1] in ("out_proj", "fc2"):  # columns moved: a block may hold other entries
            redrawn.append((name, not torch.equal(groups.rtn4(new.weight).sort(1).values,
                                                  groups.rtn4(old.weight).sort(1).values)))
        else:  # rows moved whole: each block keeps its entries, the rounded rows are the original's reordered
            assert torch.equal(groups.rtn4(new.weight).sort(0).values, groups.rtn4(old.weight).sort(0).values)
    # every fc2 (4 blocks of 32 neurons) rounds other numbers; an out_proj (2 blocks of 2 heads) may keep its
    # blocks' sets when the head order does, but not all of them do
    assert all(changed for name, changed in redrawn if name.endswith("fc2"))
    assert any(changed for name, changed in redrawn if name.endswith("out_proj"))


def test_the_converted_draw_is_the_conversion_of_the_originals_draw(models) -> None:
    original, converted, _ = models
    a, b = draws.reordered(original, 4), draws.reordered(converted, 4)
    for name, mod in a.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ("out_proj", "fc2"):
            w = mod.weight
            centred = w - w.mean(0, keepdim=True)  # compat's writer edit: every row minus the mean row
            assert (b.get_submodule(name).weight - centred).abs().max() < 1e-12 * w.abs().max()


def test_the_native_shaped_variant_computes_the_conversion(models) -> None:
    import copy

    original, converted, inputs = models
    rms = draws.rms_norms(copy.deepcopy(converted))
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in rms.modules())
    assert _rel(_logits(rms, inputs), _logits(original, inputs)) < 1e-9
    # without its one centering op the encoder's stream (a GELU stem) is not zero-mean: the op is needed
    plain = draws.rms_norms(copy.deepcopy(converted))
    plain.model.encoder.layers[0]._forward_pre_hooks.clear()
    assert _rel(_logits(plain, inputs), _logits(original, inputs)) > 1e-3


def test_runs_split_over_seeds_join_and_clip_sets_pool_over_the_seeds_all_have() -> None:
    def run(speech: str, seeds: list[int], clips: int, scale: float) -> dict:
        kl = {"original": [[1.0 + s] * clips for s in seeds],
              "conversion": [[scale * (1.0 + s)] * clips for s in seeds]}
        return {"speech": [speech], "skip": 0, "clips": clips, "seeds": seeds, "positions": [5] * clips, "kl": kl}

    # speech2 measured by two processes (seeds 0-1 and 2-3), speech by one that stopped after seed 2
    seeds, kl, positions = draws.pooled([run("a", [0, 1, 2], 2, 1.1), run("b", [0, 1], 3, 1.1),
                                         run("b", [2, 3], 3, 1.1)])
    assert seeds == [0, 1, 2]  # seed 3 is in one clip set only
    assert kl["original"].shape == (3, 5) and positions == 25
    assert kl["original"][:, 0].tolist() == [1.0, 2.0, 3.0] and kl["original"][:, 4].tolist() == [1.0, 2.0, 3.0]
    text = draws.table([run("a", [0, 1, 2], 2, 1.1), run("b", [0, 1], 3, 1.1), run("b", [2, 3], 3, 1.1)])
    assert "**1.100** (1.100-1.100)" in text  # every pair 1.1×: no spread between draws or clips


def test_runs_split_over_clips_join_clip_by_clip() -> None:
    """A clip set measured for new seeds by two processes, each on half of its clips (``--skip``), joins the run
    that measured all of them for the first seeds."""
    def run(skip: int, clips: int, seeds: list[int]) -> dict:
        idx = range(skip, skip + clips)
        return {"speech": ["s"], "skip": skip, "clips": clips, "seeds": seeds, "positions": [i + 1 for i in idx],
                "kl": {"original": [[10.0 * s + i for i in idx] for s in seeds],
                       "conversion": [[20.0 * s + i for i in idx] for s in seeds]}}

    seeds, kl, positions = draws.pooled([run(0, 4, [0, 1]), run(0, 2, [2, 3]), run(2, 2, [2])])
    assert seeds == [0, 1, 2]  # seed 3: clips 2-3 not measured
    assert kl["original"].tolist() == [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]]
    assert kl["conversion"][2].tolist() == [40, 41, 42, 43] and positions == 10
    assert draws.run_clips({"speech": ["a", "b"], "skip": 3, "clips": 4}) == [("a", 3), ("a", 4), ("b", 3), ("b", 4)]


def test_runs_of_the_same_clips_written_elsewhere_join_by_directory_name() -> None:
    """A variant measured in another session, whose clips ``speech_samples.py`` wrote under another parent
    (round 58's original in ``/tmp/a/speech``, round 59's op variant in ``/tmp/b/speech``), pairs clip by clip."""
    def run(speech: str, name: str, scale: float) -> dict:
        return {"speech": [speech], "skip": 0, "clips": 2, "seeds": [0, 1], "positions": [3, 4],
                "kl": {name: [[scale * 1.0, scale * 2.0], [scale * 3.0, scale * 4.0]]}}

    seeds, kl, positions = draws.pooled([run("/tmp/a/speech", "original", 1.0), run("/tmp/b/speech", "op", 1.5)])
    assert seeds == [0, 1] and set(kl) == {"original", "op"} and positions == 7
    assert kl["op"].tolist() == [[1.5, 3.0], [4.5, 6.0]]
    assert "**1.500** (1.500-1.500)" in draws.table([run("/tmp/a/speech", "original", 1.0),
                                                     run("/tmp/b/speech", "op", 1.5)])
    with pytest.raises(SystemExit, match="do not pool"):  # seed 1 of rotate+fc2 is not seed 1 of rotate
        draws.pooled([run("/tmp/a/speech", "original", 1.0) | {"draws": "rotate"},
                      run("/tmp/b/speech", "op", 1.5) | {"draws": "rotate+fc2"}])
    other = run("/tmp/b/speech", "op", 1.5) | {"positions": [3, 5]}  # another clip 1: not the same clip set
    with pytest.raises(SystemExit, match="not the same clips"):
        draws.pooled([run("/tmp/a/speech", "original", 1.0), other])


def test_tables_are_per_quantizer() -> None:
    def run(quant: str | None, scale: float) -> dict:
        r = {"speech": ["s"], "skip": 0, "clips": 2, "seeds": [0, 1], "positions": [3, 3],
             "kl": {"original": [[1.0, 2.0], [2.0, 3.0]], "conversion": [[scale, 2 * scale], [2 * scale, 3 * scale]]}}
        if quant:
            r["quant"] = quant
        return r

    text = draws.table([run("hqq", 0.9), run(None, 1.2)])  # a run without the field is RTN (round 48's)
    rtn, hqq = text.split("simulated MatMulNBits HQQ")  # RTN's table first
    assert "MatMulNBits RTN" in rtn and "**1.200**" in rtn and "**1.200**" not in hqq and "**0.900**" in hqq


def test_the_rounding_cache_returns_the_same_rounding_and_keeps_only_what_a_draw_used() -> None:
    cache = draws.RoundingCache()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    first = cache.get("rtn", a)
    assert torch.equal(first, groups.rtn4(a)) and cache.get("rtn", a.clone()) is first  # same bytes: a hit
    cache.get("rtn", b)
    cache.keep_used()
    cache.get("rtn", b)
    cache.keep_used()  # a was not used by the last draw: dropped
    assert len(cache.store) == 1 and cache.get("rtn", a) is not first
    assert not torch.equal(cache.get("hqq", a), first)  # the quantizer is part of the key


def test_hqq4_is_onnx_runtimes_hqq_matmulnbits() -> None:
    """The simulated HQQ rounding against ONNX Runtime's own: the codes, scales and zero points it writes
    (``check_hqq``) and the output of its ``MatMulNBits`` kernel (``(code − zero) · scale``)."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import matmul_nbits_quantizer as mq

    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 96, generator=g) * torch.linspace(0.2, 3.0, 96)  # (out, in): uneven input columns
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 96])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 48])],
                              [numpy_helper.from_array(w.T.contiguous().numpy(), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        fp32, nbits = Path(tmp) / "f.onnx", Path(tmp) / "q.onnx"
        onnx.save(model, fp32)  # before quantizing: the quantizer edits the graph in place
        quantizer = mq.MatMulNBitsQuantizer(model, block_size=32, is_symmetric=True,
                                            algo_config=mq.HQQWeightOnlyQuantConfig(block_size=32, bits=4))
        quantizer.process()
        quantizer.model.save_model_to_file(str(nbits), use_external_data_format=False)
        assert draws.check_hqq(fp32, nbits) == (0, w.numel())
        x = torch.randn(3, 96, generator=g)
        y = ort.InferenceSession(str(nbits), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    sim = x @ draws.hqq4(w).T
    assert float((torch.from_numpy(y) - sim).abs().max()) < 1e-4 * float(sim.abs().max())
    assert float((sim - x @ w.T).abs().max()) > 1e-3 * float(sim.abs().max())  # it does round


def test_pair_tests_count_pairs_above_one_and_interval_their_geometric_mean() -> None:
    import numpy as np

    above, p, lo, hi = draws.pair_tests(np.array([1.1] * 9))
    assert above == 9 and abs(p - 2 / 2**9) < 1e-12 and abs(lo - 1.1) < 1e-12 and abs(hi - 1.1) < 1e-12
    above, p, lo, hi = draws.pair_tests(np.array([0.9, 1.1, 0.95, 1.05]))
    assert above == 2 and p == 1.0 and lo < 1 < hi  # as many below as above: no evidence either way


def test_the_conversions_writers_swapped_into_the_original_compute_the_original(models) -> None:
    """The attribution variants: one side's writers from the conversion (rows centred) in the original compute
    the original's function (float64), and the swap takes exactly that side's writers."""
    original, converted, inputs = models
    ref = _logits(original, inputs)
    for side in ("encoder", "decoder"):
        mixed = draws.swapped_writers(original, converted, side)
        assert _rel(_logits(mixed, inputs), ref) < 1e-9
        for name, mod in mixed.named_modules():
            if not isinstance(mod, torch.nn.Linear):
                continue
            donor = converted if f".{side}." in f".{name}" and name.rsplit(".", 1)[-1] in ("out_proj", "fc2") \
                else original
            assert torch.equal(mod.weight, donor.get_submodule(name).weight), name
    # the swapped writers are not the original's: the conversion moved them (so a draw rounds other numbers)
    assert not torch.equal(draws.swapped_writers(original, converted, "decoder").model.decoder.layers[0].fc2.weight,
                           original.model.decoder.layers[0].fc2.weight)


# Round 58: the rotation draws for per-row / per-token int8 engines (torchao), and their float check.

def _int8_rows(w: torch.Tensor) -> torch.Tensor:
    """torchao's symmetric per-row int8 integers: ``round(w / (absmax / 127.5))`` clamped to [-128, 127]."""
    scale = (w.abs().amax(1, keepdim=True) / 127.5).clamp_min(1e-30)  # a padding row of proj_out is zero
    return torch.clamp(torch.round(w / scale), -128, 127)


def test_a_rotation_draw_is_exact_for_the_original_and_its_conversion_and_pairs_them(models) -> None:
    original, converted, inputs = models
    ref = _logits(original, inputs)
    for model in (original, converted):
        for seed in (1, 2):
            assert _rel(_logits(draws.rotated(model, seed), inputs), ref) < 1e-9
    assert draws.rotated(original, 0) is original
    a, b = draws.rotated(original, 5), draws.rotated(converted, 5)
    for name, mod in a.named_modules():  # the converted draw is the conversion (centred writers) of the original's
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] == "out_proj":
            centred = mod.weight - mod.weight.mean(0, keepdim=True)
            assert (b.get_submodule(name).weight - centred).abs().max() < 1e-12 * mod.weight.abs().max()


def test_a_rotation_draw_rounds_new_attention_rows_and_a_reordering_rounds_none(models) -> None:
    """On a per-row grid a reordering gives each row's integers back in another order (no draw); a rotation draw
    gives every q/k/v/out_proj row new integers and leaves fc1, fc2 and proj_out as shipped."""
    original, _, _ = models
    rotated, reordered = draws.rotated(original, 3), draws.reordered(original, 3)
    for name, old in original.named_modules():
        if not isinstance(old, torch.nn.Linear):
            continue
        ints = _int8_rows(old.weight).sort(1).values.sort(0).values
        assert torch.equal(_int8_rows(reordered.get_submodule(name).weight).sort(1).values.sort(0).values, ints)
        new = _int8_rows(rotated.get_submodule(name).weight)
        if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "out_proj"):
            assert (new != _int8_rows(old.weight)).any(1).float().mean() > 0.9, name
        else:
            assert torch.equal(new, _int8_rows(old.weight)), name


def test_the_fc2_shift_is_exact_only_where_layernorms_read_the_stream(models) -> None:
    import copy

    original, converted, inputs = models
    ref = _logits(original, inputs)
    shifted = draws.rotated(original, 2, fc2=True)
    assert _rel(_logits(shifted, inputs), ref) < 1e-9
    layer = shifted.model.encoder.layers[0]
    assert not torch.equal(_int8_rows(layer.fc2.weight), _int8_rows(draws.rotated(original, 2).model.encoder
                                                                     .layers[0].fc2.weight))
    rms = draws.rms_norms(copy.deepcopy(converted))  # the native graph: RMSNorm, the stream must stay zero-mean
    assert _rel(_logits(draws.rotated(rms, 2, fc2=True, grid_from=original), inputs), ref) > 1e-6


def test_the_draw_check_stops_a_draw_that_is_not_the_original(models) -> None:
    original, _, inputs = models
    feats = inputs["input_features"].float()
    ids = list(inputs["decoder_input_ids"])
    base = copy_float(original)
    ref = draws._logits(base, feats, ids)
    found = draws.check_drawn(draws.rotated(base, 1), ref, feats, ids, base, lambda m: draws.rotated(m, 1), "ok")
    assert found["rel"] < 1e-5 and found["rel64"] < 1e-9

    def broken(m: torch.nn.Module) -> torch.nn.Module:
        out = draws.rotated(m, 1)
        with torch.no_grad():
            out.model.decoder.layers[0].fc1.weight.mul_(1.01)
        return out

    with pytest.raises(SystemExit, match="not the original's function"):
        draws.check_drawn(broken(base), ref, feats, ids, base, broken, "broken")
    with pytest.raises(SystemExit, match="not exact in float64"):  # float32 within tolerance, the transform is not
        draws.check_drawn(draws.rotated(base, 1), ref, feats, ids, base, broken, "broken")


def copy_float(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model).float()


def test_the_torchao_emulation_is_round_53s_torchao_linear_bit_for_bit_on_both_product_paths() -> None:
    """``--quant torchao-emu``'s float32 integer product must be the exact integer product (round 53's float64
    ``quant_utils.torchao_linear_``, checked against torchao bit for bit on DINOv2-small): on ordinary inputs (the
    float32 path) and on a token large enough that its partial sums could leave float32's exact integers (the
    float64 path); every ``nn.Linear`` of a Whisper is swapped, nothing else."""
    quant_utils = benchmark_modules.load("quant_utils")
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(1536, 24)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 1536, generator=g))
        lin.weight[:, 0] = 40.0  # every row's absmax in one column: most codes near 127 / 40 · |w|
    ref = quant_utils.torchao_linear_(copy.deepcopy(lin))
    emu = draws.TorchaoInt8Linear(lin)
    x = torch.randn(2, 5, 1536, generator=g)
    big = torch.full((1, 1, 1536), 127.0)  # Σ|x_q| · max|w_q| = 1536 · 127 · 127 > 2²⁴: the float64 path
    for inp in (x, big):
        assert torch.equal(emu(inp), ref(inp))
    # an off-grid emulation would differ: the plain float Linear is not the same numbers
    assert not torch.equal(emu(x), lin(x))
    # in a model: every Linear emulated in place, its hooks kept (--writer-centering op centers by a forward hook)
    whisper = benchmark_modules.tiny_whisper().float().eval()
    fc2 = whisper.model.encoder.layers[0].fc2
    fc2.register_forward_hook(lambda _m, _a, y: y - y.mean(-1, keepdim=True))
    emulated = draws.torchao_int8_emulated(whisper)
    linears = [(n, m) for n, m in emulated.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all("forward" in m.__dict__ for _, m in linears)
    assert not any("forward" in m.__dict__ for m in whisper.modules())  # the model itself untouched
    h = torch.randn(3, fc2.in_features, generator=g)
    plain = copy.deepcopy(fc2)
    plain._forward_hooks.clear()
    want = quant_utils.torchao_linear_(plain)(h)
    got = emulated.model.encoder.layers[0].fc2(h)
    assert torch.equal(got, want - want.mean(-1, keepdim=True))


# ---------------------------------------------------------------- round 60: GGUF Q8_0 on the decoder alone

def test_gguf_q8_0_is_the_gguf_packages_round_trip_and_a_reordering_redraws_only_the_writers(models) -> None:
    """``--quant gguf-q8_0``: the ``gguf`` package's own ``Q8_0`` (one float16 scale per 32 inputs of a row), and a
    :func:`reordered` draw gives the writers' blocks other entries while each reader row keeps its integers."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    original, _, _ = models
    w = original.model.decoder.layers[0].fc2.weight.detach().float()
    want = quants.dequantize(quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    got = draws.gguf_q8_0(w)
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32)).reshape(w.shape))
    step = (w.reshape(w.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127).half().float()
    # half a step, plus the float16 scale's own rounding (2⁻¹¹ relative) times up to 127
    assert ((got - w).reshape(step.shape[0], -1, 32).abs() <= step * (0.5 + 127 * 2 ** -11) + 1e-12).all()
    assert not torch.equal(got, w)
    drawn = draws.reordered(original, 3)
    for name, new in drawn.named_modules():
        if not isinstance(new, torch.nn.Linear) or not name.startswith(draws.DECODER):
            continue
        old = original.get_submodule(name)
        a, b = draws.gguf_q8_0(new.weight.detach().float()), draws.gguf_q8_0(old.weight.detach().float())
        if name.endswith("fc2"):
            assert not torch.equal(a.sort(1).values, b.sort(1).values)  # other blocks: other numbers
        elif not name.endswith("out_proj"):  # a reader: its rows moved whole, each rounds as before
            assert torch.equal(a.sort(0).values, b.sort(0).values)


def test_decoder_only_rounding_leaves_the_encoder_the_head_and_a_writers_hooks(models) -> None:
    original, _, _ = models
    model = copy.deepcopy(original).float()
    calls = []
    model.model.decoder.layers[0].fc2.register_forward_hook(lambda *_: calls.append(1))
    q = draws.rounded(model, "gguf-q8_0", None, draws.DECODER)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            same = torch.equal(q.get_submodule(name).weight, mod.weight)
            assert same == (not name.startswith("model.decoder.")), name  # proj_out is not under model.decoder
    ids = torch.randint(1, 99, (1, 6))
    with torch.no_grad():
        q(input_features=torch.randn(1, 8, 32), decoder_input_ids=ids)
    assert calls  # the hook (a --writer-centering op) still runs on the rounded copy


def test_batched_decoder_passes_give_each_clips_own_log_probs(models) -> None:
    """Clips of different lengths padded into one pass: each clip's log-probs are its own pass's (causal decoder)."""
    original, _, _ = models
    model = copy.deepcopy(original).float()
    p = len(draws.bq.SOT_NOTS)
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(1, 99, (p + n,), generator=g) for n in (2, 7, 4)]
    feats = torch.randn(3, 8, 32, generator=g)
    enc = draws.encoder_states(model, feats)
    alone, states = groups.forced_logp(model, feats, ids)
    batched, _ = draws.decoder_logp(model, ids, enc, batch=2)
    assert [len(a) for a in alone] == [len(b) for b in batched] == [n + 1 for n in (2, 7, 4)]
    for a, b, s, e in zip(alone, batched, states, enc, strict=True):
        assert torch.equal(s, e)
        assert (a - b).abs().max() < 1e-5
    # the streamed KL (a batch at a time, never every clip's log-probs at once) is clip_kl of the whole
    q = draws.rounded(model, "gguf-q8_0", None, draws.DECODER)
    whole = groups.clip_kl(alone, draws.decoder_logp(q, ids, enc)[0])
    streamed = draws.decoder_kl(q, ids, enc, alone, batch=2)
    assert whole.shape == streamed.shape == (3,) and (whole > 0).all()
    assert abs(streamed - whole).max() < 1e-5 * whole.max()  # other padded widths: float32 order only


def test_rounding_energy_sees_block_widening_and_nothing_else(models) -> None:
    """The diagnostic's ratios: 1 for the same weights; a writer whose rows are scaled by 2 has 4x the block scale
    squared and 4x the error energy; compat's centered rows are measured against the original's."""
    original, converted, _ = models
    same = draws.rounding_energy(original, copy.deepcopy(original))
    assert all(abs(v - 1) < 1e-12 for row in same.values() for v in row.values())
    doubled = copy.deepcopy(original)
    with torch.no_grad():
        doubled.model.decoder.layers[1].fc2.weight.mul_(2)
    got = draws.rounding_energy(original, doubled)
    row = got["model.decoder.layers.1.fc2"]
    assert abs(row["step"] - 4) < 1e-2 and abs(row["full"] - 4) < 0.2
    assert 1 < got["all"]["full"] < 4
    assert set(draws.rounding_energy(original, converted)) == {
        f"model.decoder.layers.{i}.{w}" for i in (0, 1) for w in ("self_attn.out_proj", "encoder_attn.out_proj", "fc2")
    } | {"all"}


def test_decoder_only_runs_table_apart_and_say_so() -> None:
    def run(quant: str) -> dict:
        return {"speech": ["s"], "skip": 0, "clips": 2, "seeds": [0, 1], "positions": [3, 3], "quant": quant,
                "kl": {"original": [[1.0, 1.0], [1.0, 1.1]], "native": [[1.1, 1.0], [1.0, 1.2]]}}

    text = draws.table([run("gguf-q8_0:decoder"), run("rtn")])
    assert "GGUF Q8_0 weight round trip (gguf package), the decoder's Linears only" in text
    assert text.index("MatMulNBits RTN") < text.index("GGUF Q8_0")
