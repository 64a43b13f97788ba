"""The Whisper quantization benchmark's bookkeeping (``benchmarks/bench_quant_whisper.py``), no model run.

What can be wrong without anything crashing: clip sets pooled out of order (a paired bootstrap then
pairs one variant's clip with another clip of the original), a variant measured on fewer clips than the
original compared as if paired, and a penalty taken against the wrong float32 run.
"""

from __future__ import annotations

import numpy as np

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
