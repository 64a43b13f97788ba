"""The Whisper quantization benchmark's bookkeeping (``benchmarks/bench_quant_whisper.py``), no model run.

What can be wrong without anything crashing: clip sets pooled out of order (a paired bootstrap then
pairs one variant's clip with another clip of the original), a variant measured on fewer clips than the
original compared as if paired, and a penalty taken against the wrong float32 run.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests import benchmark_modules


def _load(name: str):
    return benchmark_modules.load(name)


bq = _load("bench_quant_whisper")


def _run(seed: int, clips: int, variants: tuple[str, ...]) -> list[dict]:
    """Rows of one fake clip set: float32 original WER row, int8 rows with KL and WER per variant."""
    rng = np.random.default_rng(seed)
    words = [int(w) for w in rng.integers(5, 30, clips)]
    rows = [{"engine": "CTranslate2 float32", "variant": "original",
             "clip_err": [int(e) for e in rng.integers(0, 5, clips)], "clip_words": words}]
    for v in variants:
        n = [int(x) for x in rng.integers(10, 40, clips)]
        rows.append({"engine": "CTranslate2 int8", "variant": v, "clip_kl": list(rng.random(clips) * 0.1),
                     "clip_n": n, "clip_agree": [x - 1 for x in n],
                     "clip_err": [int(e) for e in rng.integers(0, 6, clips)], "clip_words": words})
    return rows


def test_merge_pools_clip_sets_in_run_order_and_recomputes_the_means():
    a, b = _run(0, 5, ("original", "keep")), _run(1, 3, ("original", "keep"))
    pooled = {(r["engine"], r["variant"]): r for r in bq.merge([a, b])}
    keep = pooled[("CTranslate2 int8", "keep")]
    assert keep["clip_kl"] == a[2]["clip_kl"] + b[2]["clip_kl"]
    assert keep["kl"] == sum(keep["clip_kl"]) / sum(keep["clip_n"])
    assert keep["wer"] == sum(keep["clip_err"]) / sum(keep["clip_words"])


def test_wer_table_penalty_difference_is_the_int8_wer_difference_on_shared_float32():
    """Without a float32 run of its own, a variant's penalty is taken against the original's float32
    transcripts, so its difference to the original's penalty is exactly its int8 WER minus the original's."""
    rows = bq.merge([_run(2, 40, ("original", "keep"))])
    by = {(r["engine"], r["variant"]): r for r in rows}
    words = sum(by[("CTranslate2 float32", "original")]["clip_words"])
    diff = 100 * (sum(by[("CTranslate2 int8", "keep")]["clip_err"])
                  - sum(by[("CTranslate2 int8", "original")]["clip_err"])) / words
    line = next(ln for ln in bq.wer_table(rows).splitlines() if ln.startswith("| keep |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1].endswith("*")  # the original's float32 WER, marked
    point, interval = cells[4].split(" (")
    assert float(point) == round(diff, 2)
    lo, hi = (float(x) for x in interval.rstrip(")").split(" to "))
    assert lo <= float(point) <= hi and hi - lo > 0


def test_a_variant_on_fewer_clips_than_the_original_is_not_paired():
    full, part = _run(3, 6, ("original", "keep")), _run(4, 6, ("original", "keep", "extra"))
    rows = bq.merge([full, part])
    rows = [r for r in rows if r["variant"] != "extra"] + [r for r in bq.merge([part]) if r["variant"] == "extra"]
    text = bq.table(rows)
    extra = next(ln for ln in text.splitlines() if "| extra |" in ln)
    assert "not on the original's 12 clips" in extra
    assert "| extra |" not in bq.wer_table(rows)


def test_ort_feed_forces_each_clip_on_its_own_tokens_after_the_prompt_padded_with_end_of_text():
    """A clip's decoder row is the prompt then its tokens; shorter clips are padded with end-of-text after
    their own tokens (causal attention: padding after a position cannot change that position's logits)."""
    feats = np.zeros((2, 80, 3000), dtype=np.float32)
    feed = bq.ort_feed(feats, [[11, 12, 13], [21]])
    p = len(bq.SOT_NOTS)
    ids = feed["decoder_input_ids"]
    assert ids.dtype == np.int64 and ids.shape == (2, p + 3)
    assert list(ids[0]) == [*bq.SOT_NOTS, 11, 12, 13]
    assert list(ids[1]) == [*bq.SOT_NOTS, 21, bq.EOT, bq.EOT]
    assert feed["input_features"].flags["C_CONTIGUOUS"]


def test_gptq_calibration_reader_serves_every_clip_to_both_of_onnx_runtimes_protocols():
    """ONNX Runtime's GPTQ path iterates a deep copy of the reader; its static path drains ``get_next``.
    Both must see every calibration clip, once."""
    import copy

    feeds = [{"x": np.full(1, i)} for i in range(3)]
    reader = bq.CalibrationFeed(feeds)
    assert [int(f["x"][0]) for f in copy.deepcopy(reader)] == [0, 1, 2]
    drained = []
    while (f := reader.get_next()) is not None:
        drained.append(int(f["x"][0]))
    assert drained == [0, 1, 2]


def test_ratios_pair_each_variant_with_its_own_engines_original_and_skip_unpaired_rows():
    """The plotted ratio is the variant's KL over the original's in the same engine; a variant measured on
    other clips than that original (a partial merge) is left out rather than compared unpaired."""
    rows = _run(3, 6, ("original", "keep"))
    other = _run(4, 6, ("original", "keep"))
    for r in other:
        r["engine"] = r["engine"].replace("CTranslate2", "ONNX Runtime")
    short = dict(other[2], variant="short", clip_kl=other[2]["clip_kl"][:4], clip_n=other[2]["clip_n"][:4])
    got = {(e, v): (x, lo, hi) for e, v, x, lo, hi in bq.ratios(bq.merge([rows + other[1:] + [short]]))}
    assert set(got) == {("CTranslate2 int8", "keep"), ("ONNX Runtime int8", "keep")}
    x, lo, hi = got[("ONNX Runtime int8", "keep")]
    want = (sum(other[2]["clip_kl"]) / sum(other[2]["clip_n"])) / (sum(other[1]["clip_kl"]) / sum(other[1]["clip_n"]))
    assert abs(x - want) < 1e-12 and lo <= x <= hi


def test_calibration_overlap_counts_the_calibration_clips_a_run_also_measures(tmp_path):
    """Static QDQ and GPTQ calibrate on ``--calib``'s last clips; a run that measures them too would grade
    the quantizer on its own calibration data, so the benchmark refuses it (this count non-zero)."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    sets = [(a, 82), (b, 82)]
    assert bq.calibration_overlap(sets, c, 16, 0) == 0  # not a measured directory
    assert bq.calibration_overlap(sets, b, 16, 0) == 16  # all of b measured
    assert bq.calibration_overlap(sets, b, 16, 82 + 66) == 0  # b's first 66 measured, its last 16 not
    assert bq.calibration_overlap(sets, b, 16, 82 + 70) == 4
    assert bq.calibration_overlap(sets, a, 16, 50) == 0 and bq.calibration_overlap(sets, a, 40, 50) == 8
    assert bq.calibration_overlap([(a / ".." / "a", 82)], a, 8, 0) == 8  # the same directory spelt differently


def test_static_qdq_names_parse_into_knobs_and_refuse_unknown_or_orphaned_ones():
    """``qdq-mm-pc-pct`` is the weight MatMuls, per-channel weights, Percentile calibration; the earlier rounds'
    names keep their meaning; a knob the name grammar does not know, two calibration methods, or an exclusion
    that only makes sense with ``mm`` is refused (before any measuring)."""
    assert bq.qdq_knobs("qdq") == []
    assert bq.qdq_knobs("qdq-mm-pc-pct") == ["mm", "pc", "pct"]
    assert bq.qdq_knobs("nbits-rtn") is None and bq.qdq_knobs("qdqx") is None
    assert bq.calibrated("qdq-mm-nofc2") and bq.calibrated("nbits-gptq-patched") and not bq.calibrated("dyn-pc")
    for bad in ("qdq-mm-foo", "qdq-nofc2", "qdq-nohead-pc", "qdq-mm-pct-ent"):
        with pytest.raises(ValueError):
            bq.qdq_knobs(bad)
    assert bq.ort_engine("qdq-mm") == "ONNX Runtime static QDQ int8, weight MatMuls only"  # earlier JSON merges
    assert bq.ort_engine("qdq-mm-nofc2-pc") == "ONNX Runtime static QDQ int8 qdq-mm-nofc2-pc"


def test_an_unknown_quantizer_name_exits_with_one_line_before_loading_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bq.main(["--orig", str(tmp_path / "absent"), "--speech", str(tmp_path), "--work", str(tmp_path),
                 "--engines", "ort", "--ort-quant", "dyn-pt,qdq-mm-nofc3"])
    assert "nofc3" in str(e.value) and "\n" not in str(e.value)


def _whisper_like_graph(path):
    """A graph with the MatMul kinds of an exported Whisper: weight MatMuls (one through a Transpose of its
    initializer), an attention score MatMul of two activations, an fc2 and the logits' projection."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = {k: numpy_helper.from_array(np.ones((4, 4), np.float32), k) for k in ("wq", "wt", "wfc2", "whead")}
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="/model/encoder/layers.0/self_attn/q_proj/MatMul"),
             helper.make_node("Transpose", ["wt"], ["wtT"], name="T"),
             helper.make_node("MatMul", ["x", "wtT"], ["k"], name="/model/encoder/layers.0/self_attn/k_proj/MatMul"),
             helper.make_node("MatMul", ["q", "k"], ["s"], name="/model/encoder/layers.0/self_attn/MatMul"),
             helper.make_node("MatMul", ["s", "wfc2"], ["h"], name="/model/encoder/layers.0/fc2/MatMul"),
             helper.make_node("MatMul", ["h", "whead"], ["logits"], name="/model/proj_out/MatMul")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 4])], list(w.values()))
    onnx.save(helper.make_model(graph), str(path))
    return path


def test_qdq_options_leave_float_what_each_knob_names_and_nothing_else(tmp_path):
    from onnxruntime.quantization import CalibrationMethod, QuantType

    fp32 = _whisper_like_graph(tmp_path / "model.onnx")
    score = "/model/encoder/layers.0/self_attn/MatMul"
    fc2, head = "/model/encoder/layers.0/fc2/MatMul", "/model/proj_out/MatMul"
    default = bq.qdq_options(fp32, [])
    assert "op_types_to_quantize" not in default and default["nodes_to_exclude"] == []  # ONNX Runtime's defaults
    assert default["calibrate_method"] == CalibrationMethod.MinMax and default["activation_type"] == QuantType.QUInt8
    assert not default["per_channel"] and not default["extra_options"]["ActivationSymmetric"]
    assert "CalibMaxIntermediateOutputs" not in default["extra_options"]  # drops full chunks unread in ORT 1.32
    assert "LayerNormalization" not in bq.qdq_options(fp32, ["nonorm"])["op_types_to_quantize"]
    mm = bq.qdq_options(fp32, ["mm"])
    assert mm["op_types_to_quantize"] == ["MatMul"] and mm["nodes_to_exclude"] == [score]  # k_proj (Transpose) kept
    assert bq.qdq_options(fp32, ["mm", "nohead"])["nodes_to_exclude"] == [score, head]
    assert bq.qdq_options(fp32, ["mm", "nofc2"])["nodes_to_exclude"] == [score, fc2]
    knobs = bq.qdq_options(fp32, ["mm", "pc", "ent", "sym", "s8", "rr"])
    assert knobs["per_channel"] and knobs["reduce_range"] and knobs["extra_options"]["ActivationSymmetric"]
    assert knobs["calibrate_method"] == CalibrationMethod.Entropy and knobs["activation_type"] == QuantType.QInt8
    assert bq.qdq_options(fp32, ["pct"])["calibrate_method"] == CalibrationMethod.Percentile


def test_against_takes_every_rows_ratio_to_one_engines_original():
    """``--against ENGINE``: each row's KL over the original's in ENGINE (paired on the same clips), its own
    engine's original included; an engine with no original row is refused by name."""
    rtn = [r for r in _run(5, 8, ("original", "rot")) if "clip_kl" in r]
    gptq = [dict(r, engine="GPTQ", clip_kl=[0.6 * k for k in r["clip_kl"]]) for r in _run(6, 8, ("original", "rot"))
            if "clip_kl" in r]
    for r in rtn:
        r["engine"] = "RTN"
    for r in gptq:  # the same clips as RTN's (positions are a clip's, not a quantizer's)
        r["clip_n"] = rtn[0]["clip_n"]
    for r in rtn + gptq:  # KL rows only (no WER)
        del r["clip_err"], r["clip_words"]
    rows = bq.merge([rtn + gptq])

    def ratio(text: str, engine: str, variant: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {engine} | {variant} |"))
        return float(line.split("|")[5].split()[0])

    text = bq.table(rows, against="RTN")
    base = sum(rtn[0]["clip_kl"])
    for r in gptq:
        assert abs(ratio(text, "GPTQ", r["variant"]) - sum(r["clip_kl"]) / base) < 1e-3
    assert ratio(text, "RTN", "original") == 1.0
    assert abs(ratio(bq.table(rows), "GPTQ", "original") - 1.0) < 1e-12  # without: its own engine's original
    with pytest.raises(ValueError, match="no original row"):
        bq.table(rows, against="HQQ")
