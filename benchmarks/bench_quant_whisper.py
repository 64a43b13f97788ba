"""Whisper (a real checkpoint) through real int8 quantizers: how much each normswap variant loses.

Issue 40 §2 reported Whisper tiny.en in CTranslate2 int8 on 48 utterances (WER penalty +0.7 original,
+2.6 compat, +1.3 compat + Hadamard), too few to rank. WER moves in whole words; this benchmark measures
the quantized model's *distribution* instead, teacher-forced, at every decoder position of every clip:

* reference tokens: the float32 original's greedy transcript of each clip (CTranslate2 float32);
* KL(float32 original ‖ quantized variant), mean over all positions (the step after the last token,
  which predicts end-of-text, included), and top-1 agreement with the float32 original's argmax;
* the ratio of each variant's KL to the original's in the same engine, with a 95% interval from a
  paired bootstrap over clips (the noise of the clip sample: "within noise" = the interval holds 1);
* ``--wer``: also the word error rate of each CTranslate2 variant's greedy transcript
  (:data:`WER_DECODING`) against the sentence spoken, and its penalty over the float32 original.

Engines: CTranslate2 int8 (each variant's transformers directory converted by CTranslate2's own
``ct2-transformers-converter --quantization int8``; teacher forcing through ``Whisper.generate`` with the
reference tokens as the prompt and ``return_logits_vocab=True``, which returns the logits of forced steps
too); ONNX Runtime's quantizers (``ort``: the whole teacher-forced forward exported to ONNX, then
``--ort-quant``: ``quantize_dynamic`` with int8 weights per tensor and per channel and uint8 activations,
``quantize_static`` in QDQ format calibrated on ``--calib`` clips, 4-bit ``MatMulNBits``; without ``ct2``
it is forced on the spoken sentences' tokens); and torch's dynamic int8 (``torch``:
``torch.ao.quantization.quantize_dynamic`` on every ``nn.Linear``, per-tensor and per-channel weights).

    python benchmarks/bench_quant_whisper.py --orig DIR name=DIR ... --speech DIR [DIR ...] \
        --work WORKDIR [--engines ct2,ort,torch] [--wer] [--json out.json]
    python benchmarks/bench_quant_whisper.py --orig DIR --speech DIR --work W --merge a.json b.json

The variants' directories come from ``normswap convert ORIG --format compat --dtype float32 ...``. Runs on
disjoint clip sets (one per ``--speech`` directory, side by side) pool with ``--merge``. Memory: the
reference log-probs of every position are held (float32, 51,864 per position: ~0.2 MB each).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speech_samples import load_clips  # noqa: E402

SOT_NOTS = (50257, 50362)  # tiny.en/base.en: <|startoftranscript|><|notimestamps|> (set_prompt: others)
EOT = 50256


def set_prompt(orig: Path) -> None:
    """The decoder prompt of ``orig``'s vocabulary: ``<|startoftranscript|>`` (``<|en|><|transcribe|>`` for a
    multilingual model) ``<|notimestamps|>``, and its end-of-text id."""
    global SOT_NOTS, EOT
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(orig)
    ids = tok.convert_tokens_to_ids
    multilingual = json.loads((orig / "config.json").read_text())["vocab_size"] >= 51865  # as openai-whisper tells
    lang = ["<|en|>", "<|transcribe|>"] if multilingual else []
    SOT_NOTS = tuple(ids(t) for t in ["<|startoftranscript|>", *lang, "<|notimestamps|>"])
    EOT = ids("<|endoftext|>")


def features(orig: Path, clips: list[tuple[torch.Tensor, str]]) -> np.ndarray:
    """Log-mel features (N, 80, 3000) of every clip, by the checkpoint's own feature extractor."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor.from_pretrained(orig)
    return fe([w.numpy() for w, _ in clips], sampling_rate=16000, return_tensors="np").input_features.astype(np.float32)


def ct2_convert(src: Path, dst: Path, quantization: str) -> Path:
    if not (dst / "model.bin").exists():
        subprocess.run(["ct2-transformers-converter", "--model", str(src), "--output_dir", str(dst),
                        "--quantization", quantization, "--force"], check=True, capture_output=True)
    return dst


# Greedy decoding for WER: CTranslate2's default token suppression, and no repeated 3-gram (greedy
# Whisper without the temperature fallback of openai-whisper / faster-whisper otherwise loops on a few
# synthetic clips until max_length, and those loops would be most of the word errors).
WER_DECODING = {"beam_size": 1, "no_repeat_ngram_size": 3, "max_length": 160}


def ct2_logits(model_dir: Path, feats: np.ndarray, refs: list[list[int]] | None,
               greedy: bool = False, forced: bool = True) -> tuple[list, list, list]:
    """(per-clip log-probs [n+1, V] teacher-forced on refs, greedy token ids for WER, reference ids).

    ``refs=None``: the greedy transcript (no suppression, raw logits) is the reference (returned third),
    and its logits the reference distributions (each step conditioned on the previous argmax).
    ``greedy``: also decode with :data:`WER_DECODING` (for WER), on the same encoder output (the
    encoder is most of the time of a pass over 30-second windows); ``forced=False`` skips the
    teacher-forced pass."""
    import ctranslate2

    m = ctranslate2.models.Whisper(str(model_dir), device="cpu", intra_threads=2)
    opts = {"beam_size": 1, "return_logits_vocab": True, "suppress_blank": False, "suppress_tokens": []}
    out_logp, out_greedy, out_refs = [], [], []
    for i in range(0, len(feats), 8):
        enc = m.encode(ctranslate2.StorageView.from_array(np.ascontiguousarray(feats[i:i + 8])), to_cpu=True)
        n = len(feats[i:i + 8])
        if greedy:
            res = m.generate(enc, [list(SOT_NOTS)] * n, **WER_DECODING)
            out_greedy += [[t for t in r.sequences_ids[0] if t != EOT] for r in res]
        if refs is None:
            res = m.generate(enc, [list(SOT_NOTS)] * n, max_length=120, **opts)
            for r in res:
                ids = [t for t in r.sequences_ids[0] if t != EOT]
                out_refs.append(ids)
                steps = np.stack([np.array(x) for x in r.logits[0]])[: len(ids) + 1]
                out_logp.append(torch.log_softmax(torch.from_numpy(steps).double(), -1).float())
            continue
        if not forced:
            continue
        batch = refs[i:i + 8]
        prompts = [list(SOT_NOTS) + r for r in batch]
        res = m.generate(enc, prompts, max_length=min(440, 2 * max(map(len, batch)) + 8), **opts)
        for r, ref in zip(res, batch, strict=True):
            steps = np.stack([np.array(x) for x in r.logits[0]])[: len(ref) + 1]
            assert r.sequences_ids[0][: len(ref)] == ref, (r.sequences_ids[0], ref, len(steps))
            out_logp.append(torch.log_softmax(torch.from_numpy(steps).double(), -1).float())
    return out_logp, out_greedy, out_refs


def whisper_model(model_dir: Path) -> torch.nn.Module:
    """A variant's directory in float32, eager attention: a compat (stock) directory as
    ``WhisperForConditionalGeneration``, a native one through the auto class its config names (registered
    by ``import normswap``), as the docs load it."""
    import transformers

    import normswap  # noqa: F401  (registers the native checkpoints' model types)

    native = json.loads((model_dir / "config.json").read_text())["model_type"].startswith("normswap")
    cls = transformers.AutoModelForSpeechSeq2Seq if native else transformers.WhisperForConditionalGeneration
    return cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def torch_logits(model_dir: Path, feats: np.ndarray, refs: list[list[int]], quant: str) -> list:
    """Teacher-forced log-probs in torch eager: ``fp32``; torch's ``quantize_dynamic`` (``per-tensor`` /
    ``per-channel`` int8 weights); or torchao's ``Int8DynamicActivationInt8WeightConfig`` (``torchao``:
    int8 weights per output channel, int8 activations per token at run time, ``torch._int_mm``)."""
    model = whisper_model(model_dir)
    if quant == "torchao":
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        quantize_(model, Int8DynamicActivationInt8WeightConfig())
    elif quant != "fp32":
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        spec = {torch.nn.Linear: per_channel_dynamic_qconfig} if quant == "per-channel" else {torch.nn.Linear}
        model = quantize_dynamic(model, spec, dtype=torch.qint8)
    out = []
    with torch.inference_mode():
        for i in range(0, len(feats), 4):
            batch = refs[i:i + 4]
            n = max(map(len, batch))
            p = len(SOT_NOTS)
            ids = torch.full((len(batch), p + n), EOT)
            for j, r in enumerate(batch):
                ids[j, : p + len(r)] = torch.tensor(list(SOT_NOTS) + r)
            logits = model(input_features=torch.from_numpy(feats[i:i + 4]), decoder_input_ids=ids).logits
            for j, r in enumerate(batch):
                out.append(torch.log_softmax(logits[j, p - 1: p + len(r)].double(), -1).float())
    return out


class TeacherForced(torch.nn.Module):
    """Whisper's whole teacher-forced forward as one graph: (log-mel features, decoder ids) → logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.train(model.training)  # torch.onnx.export restores the wrapper's mode recursively

    def forward(self, input_features: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        # an explicit all-ones mask: without one, transformers' mask builder looks for packed sequences
        # in the position ids (``aten::diff``, which the TorchScript exporter has no symbolic for)
        return self.model(input_features=input_features, decoder_input_ids=decoder_input_ids, use_cache=False,
                          decoder_attention_mask=torch.ones_like(decoder_input_ids)).logits


def ort_export(model_dir: Path, path: Path) -> Path:
    """The variant's transformers directory exported to ONNX (fp32, opset 17, TorchScript exporter)."""
    import warnings

    if path.exists():
        return path
    model = whisper_model(model_dir)
    feats = torch.zeros(1, model.config.num_mel_bins, 3000)
    ids = torch.tensor([list(SOT_NOTS) + [EOT]])
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(TeacherForced(model), (feats, ids), str(path), input_names=["input_features",
                          "decoder_input_ids"], output_names=["logits"], dynamo=False, opset_version=17,
                          dynamic_axes={"input_features": {0: "batch"}, "decoder_input_ids": {0: "batch", 1: "len"},
                                        "logits": {0: "batch", 1: "len"}})
    from normswap.rotation.onnx_nodes import float_nodes

    # the rotation's own ops (output="restore"'s Qᵀ, online Hadamards), for --float-ops
    path.with_name("float_nodes.json").write_text(json.dumps(float_nodes(path, model)))
    return path


FLOAT_OPS = False  # --float-ops: the quantizers leave the rotation's own ops in float (nodes_to_exclude)


def excluded(fp32: Path) -> list[str]:
    side = fp32.with_name("float_nodes.json")
    return json.loads(side.read_text()) if FLOAT_OPS and side.exists() else []


ORT_QUANT = ("dyn-pt", "dyn-pc", "qdq", "qdq-pc", "qdq-nonorm", "qdq-mm", "nbits-rtn", "nbits-hqq", "nbits-gptq",
             "nbits-gptq-patched", "nbits-gptq-patched-act")
# Static QDQ: ``qdq`` followed by any of these knobs (ONNX Runtime's own ``quantize_static`` options), joined by
# ``-``: ``qdq-mm-pc-pct`` = weight MatMuls only, per-channel weights, Percentile calibration.
QDQ_KNOBS = {
    "nonorm": "LayerNormalization left float (every other op type of ONNX Runtime's QDQ registry quantized)",
    "mm": "only the MatMuls that have a weight (attention's activation-by-activation MatMuls, norms, gathers float)",
    "nohead": "with mm: the output projection (proj_out, the logits) left float as well",
    "nofc2": "with mm: the MLPs' output projections (fc2, whose post-GELU input spans 0.2 to 560 in tiny.en's last "
             "encoder layer) left float as well",
    "pc": "int8 weights per output channel (per_channel=True)",
    "pct": "Percentile calibration (99.999th percentile of |x|; default MinMax)",
    "ent": "Entropy (KL) calibration",
    "sym": "symmetric activation ranges (extra_options ActivationSymmetric)",
    "s8": "int8 activations (QInt8; default uint8)",
    "rr": "reduce_range=True (7-bit weights)",
}
QDQ = ("qdq", "qdq-pc", "qdq-nonorm", "qdq-mm")  # the named configurations of earlier rounds (any qdq-… is accepted)
GPTQ = ("nbits-gptq", "nbits-gptq-patched", "nbits-gptq-patched-act")


def qdq_knobs(how: str) -> list[str]:
    """The knobs of a static QDQ name (``qdq-mm-pc`` → ``["mm", "pc"]``); [] for ``qdq``, None if not one."""
    if how != "qdq" and not how.startswith("qdq-"):
        return None
    knobs = how.split("-")[1:]
    if bad := [k for k in knobs if k not in QDQ_KNOBS]:
        raise ValueError(f"{how}: unknown static QDQ knob(s) {', '.join(bad)} (known: {', '.join(QDQ_KNOBS)})")
    if bad := [k for k in ("nohead", "nofc2") if k in knobs and "mm" not in knobs]:
        raise ValueError(f"{how}: {bad[0]} goes with mm")
    if "pct" in knobs and "ent" in knobs:
        raise ValueError(f"{how}: one calibration method (pct or ent)")
    return knobs


def calibrated(how: str) -> bool:
    """Whether a quantizer needs ``--calib`` (static QDQ and GPTQ)."""
    return qdq_knobs(how) is not None or how in GPTQ


ORT_ENGINE = {"dyn-pt": "ONNX Runtime dynamic int8 dyn-pt", "dyn-pc": "ONNX Runtime dynamic int8 dyn-pc",
              "qdq": "ONNX Runtime static QDQ int8 qdq", "qdq-pc": "ONNX Runtime static QDQ int8 qdq-pc",
              "qdq-nonorm": "ONNX Runtime static QDQ int8, LayerNormalization float",
              "qdq-mm": "ONNX Runtime static QDQ int8, weight MatMuls only",
              "nbits-rtn": "ONNX Runtime MatMulNBits 4-bit RTN", "nbits-hqq": "ONNX Runtime MatMulNBits 4-bit HQQ",
              "nbits-gptq": "ONNX Runtime MatMulNBits 4-bit GPTQ",
              "nbits-gptq-patched": "ONNX Runtime MatMulNBits 4-bit GPTQ, patched (ort_gptq.py)",
              "nbits-gptq-patched-act": "ONNX Runtime MatMulNBits 4-bit GPTQ, patched, act-order (ort_gptq.py)"}


def ort_engine(how: str) -> str:
    """The row label of a quantizer (the earlier rounds' labels kept, so their JSON merges with new runs)."""
    return ORT_ENGINE.get(how) or f"ONNX Runtime static QDQ int8 {how}"


class CalibrationFeed:
    """ONNX Runtime calibration reader: one clip per call (features, decoder ids forced on its tokens)."""

    def __init__(self, feeds: list[dict]) -> None:
        self.feeds = list(feeds)

    def get_next(self) -> dict | None:
        return self.feeds.pop(0) if self.feeds else None

    def __iter__(self):  # noqa: ANN204 (the GPTQ path iterates a deep copy)
        return iter(list(self.feeds))


def ort_feed(feats: np.ndarray, refs: list[list[int]]) -> dict:
    """The exported graph's inputs for a batch of clips, forced on ``refs`` (padded with end-of-text)."""
    n = max(map(len, refs))
    ids = np.full((len(refs), len(SOT_NOTS) + n), EOT, dtype=np.int64)
    for j, r in enumerate(refs):
        ids[j, : len(SOT_NOTS) + len(r)] = list(SOT_NOTS) + r
    return {"input_features": np.ascontiguousarray(feats), "decoder_input_ids": ids}


def ort_quantize(fp32: Path, how: str, calib: list[dict] | None = None) -> Path:
    """The exported fp32 graph quantized by ONNX Runtime's own tools.

    ``dyn-pt`` / ``dyn-pc``: ``quantize_dynamic``, int8 weights per tensor / per channel, uint8
    activations per tensor at run time. ``qdq``: ``quantize_static`` in QDQ format with its defaults (every op
    type of its QDQ registry: ``MatMul``, ``LayerNormalization``, ``Gather``, ``Conv``, …; int8 weights per
    tensor, uint8 activations with MinMax ranges calibrated on ``calib``: the settings of
    ``bench_quant_engines.py``'s ``qdq``); ``qdq-KNOB-…``: the same with the knobs of :data:`QDQ_KNOBS`
    (:func:`qdq_options`). ``nbits-rtn`` / ``nbits-hqq`` / ``nbits-gptq``: ``MatMulNBitsQuantizer``, 4-bit
    weights in blocks of 32 along the input features (RTN symmetric, its default algorithm; HQQ; GPTQ
    calibrated on ``calib``, one scale per block and output column, ``perchannel=True``);
    ``nbits-gptq-patched``: that GPTQ with ONNX Runtime 1.32's two bugs fixed (``ort_gptq.py``);
    ``nbits-gptq-patched-act``: the same, rows rounded in act-order on static groups; activations float."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    if how == "fp32":
        return fp32
    out = fp32.with_name(f"{fp32.stem}.{how}.onnx")
    if out.exists():
        return out
    if how in ("dyn-pt", "dyn-pc"):
        quantize_dynamic(str(fp32), str(out), weight_type=QuantType.QInt8, per_channel=how == "dyn-pc",
                         nodes_to_exclude=excluded(fp32))
    elif (knobs := qdq_knobs(how)) is not None:
        quantize_static(str(fp32), str(out), CalibrationFeed(calib or []), quant_format=QuantFormat.QDQ,
                        weight_type=QuantType.QInt8, **qdq_options(fp32, knobs))
    elif how in GPTQ:
        import ort_gptq

        ort_gptq.quantize(fp32, out, how, calib, nodes_to_exclude=excluded(fp32))
    elif how.startswith("nbits-"):
        import onnx
        from onnxruntime.quantization import matmul_nbits_quantizer as mq

        algo = {"nbits-rtn": lambda: mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True),
                "nbits-hqq": lambda: mq.HQQWeightOnlyQuantConfig(block_size=32, bits=4)}[how]()
        q = mq.MatMulNBitsQuantizer(onnx.load(str(fp32)), block_size=32, is_symmetric=True, algo_config=algo,
                                    nodes_to_exclude=excluded(fp32))
        q.process()
        q.model.save_model_to_file(str(out), use_external_data_format=False)
    else:
        raise ValueError(how)
    return out


def qdq_options(fp32: Path, knobs: list[str]) -> dict:
    """``quantize_static``'s keyword arguments (besides the model, reader and format) for the knobs of
    :data:`QDQ_KNOBS`: op types and excluded nodes, per-channel weights, calibration method, activation type
    and symmetry, reduced range. No knob: ONNX Runtime's defaults (every op type its QDQ registry lists,
    MinMax, uint8 activations, int8 weights per tensor)."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantType
    from onnxruntime.quantization.registry import QDQRegistry

    which: dict = {"nodes_to_exclude": excluded(fp32), "per_channel": "pc" in knobs, "reduce_range": "rr" in knobs,
                   "activation_type": QuantType.QInt8 if "s8" in knobs else QuantType.QUInt8,
                   "calibrate_method": CalibrationMethod.Percentile if "pct" in knobs
                   else CalibrationMethod.Entropy if "ent" in knobs else CalibrationMethod.MinMax,
                   # (not CalibMaxIntermediateOutputs: ONNX Runtime 1.32's MinMax calibrator then drops every
                   # full chunk of outputs unread, keeping only the remainder's ranges)
                   "extra_options": {"ActivationSymmetric": "sym" in knobs}}
    if "nonorm" in knobs:
        which["op_types_to_quantize"] = sorted(set(QDQRegistry) - {"LayerNormalization"})
    if "mm" in knobs:
        graph = onnx.load(str(fp32), load_external_data=False).graph
        weights = {i.name for i in graph.initializer}
        weights |= {n.output[0] for n in graph.node if n.op_type == "Transpose" and n.input[0] in weights}
        which["op_types_to_quantize"] = ["MatMul"]
        outputs = {o.name for o in graph.output}  # nohead: the MatMul that writes the logits
        which["nodes_to_exclude"] += [n.name for n in graph.node if n.op_type == "MatMul" and (
            not weights.intersection(n.input) or ("nohead" in knobs and outputs.intersection(n.output))
            or ("nofc2" in knobs and "/fc2/" in n.name))]
    return which


def calibration_overlap(speech: list[tuple[Path, int]], calib: Path, count: int, limit: int) -> int:
    """How many of ``calib``'s last ``count`` clips a run also measures: ``speech`` is the run's clip
    directories with their clip counts, in order, of which it measures the first ``limit`` clips (0: all)."""
    before = 0
    for d, size in speech:
        if d.resolve() == calib.resolve():
            measured = min(size, max(0, (limit or before + size) - before))  # this directory's first ones
            return max(0, measured - (size - count))
        before += size
    return 0


def ort_logits(path: Path, feats: np.ndarray, refs: list[list[int]]) -> list:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 2, 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    out = []
    p = len(SOT_NOTS)
    for i in range(0, len(feats), 4):
        batch = refs[i:i + 4]
        (logits,) = sess.run(None, ort_feed(feats[i:i + 4], batch))
        for j, r in enumerate(batch):
            out.append(torch.log_softmax(torch.from_numpy(logits[j, p - 1: p + len(r)]).double(), -1).float())
    return out


def compare(ref: list, got: list) -> dict:
    """Mean KL(ref ‖ got) over every position, top-1 agreement, and the per-clip sums (for the bootstrap)."""
    # A clip whose greedy reference stopped at max_length has no end-of-text step: common length.
    # (log-probs are stored in float32 to bound memory: positions × 51,864 vocabulary; KL summed in float64)
    kl, agree = [], []
    for p, q in zip(ref, got, strict=True):  # one clip at a time in float64
        n = min(len(p), len(q))
        p, q = p[:n].double(), q[:n].double()
        kl.append((p.exp() * (p - q)).sum(-1))
        agree.append(float((p.argmax(-1) == q.argmax(-1)).sum()))
    total = sum(k.numel() for k in kl)
    return {"kl": float(sum(k.sum() for k in kl)) / total, "top1": sum(agree) / total, "positions": total,
            "clip_kl": [float(k.sum()) for k in kl], "clip_n": [k.numel() for k in kl], "clip_agree": agree}


def words(text: str) -> list[str]:
    """Lower-case words, punctuation dropped (the clips are prose: no digits, no symbols)."""
    return re.sub(r"[^a-z' ]+", " ", text.lower().replace("-", " ")).split()


def edit_distance(a: list[str], b: list[str]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def wer_counts(tokenizer, hyps: list[list[int]], texts: list[str]) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """Per clip (word errors, reference words) of the greedy transcripts against the spoken sentences."""
    errs = [edit_distance(words(t), words(tokenizer.decode(h, skip_special_tokens=True)))
            for h, t in zip(hyps, texts, strict=True)]
    return errs, [len(words(t)) for t in texts]


def bootstrap(num: np.ndarray, den: np.ndarray, base_num: np.ndarray, base_den: np.ndarray,
              draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of ``(Σnum/Σden) / (Σbase_num/Σbase_den)`` over clips resampled with replacement
    (paired: a draw takes the same clips for the variant and the original)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(num), size=(draws, len(num)))
    ratios = (num[idx].sum(1) / den[idx].sum(1)) / (base_num[idx].sum(1) / base_den[idx].sum(1))
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(lo), float(hi)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--orig", type=Path, required=True)
    ap.add_argument("variants", nargs="*", help="name=DIR (transformers directories written by normswap)")
    ap.add_argument("--speech", type=Path, nargs="+", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--engines", default="ct2,torch", help="comma list of ct2, ort, torch")
    ap.add_argument("--limit", type=int, default=0, help="first N clips only")
    ap.add_argument("--ort-limit", type=int, default=0, help="first N clips only for the ONNX Runtime rows")
    ap.add_argument("--ort-quant", default="dyn-pt,dyn-pc", help="comma list of " + ", ".join(ORT_QUANT) + "; or "
                    "qdq-KNOB-KNOB…, static QDQ with knobs " + ", ".join(f"{k} ({v})" for k, v in QDQ_KNOBS.items()))
    ap.add_argument("--nbits-variants", help="comma list: the only variants the 4-bit quantizers run (time)")
    ap.add_argument("--ref-cache", type=Path, help="file holding the ONNX Runtime float32 original's log-probs, "
                    "reused by a later run on the same clips (another quantizer, another variant)")
    ap.add_argument("--calib", type=Path, help="clip directory for the calibration of qdq, qdq-pc and nbits-gptq "
                    "(its last --calib-count clips; none of them may be measured)")
    ap.add_argument("--calib-count", type=int, default=8, help="clips of --calib used (its last N)")
    ap.add_argument("--torch-quant", default="per-tensor,per-channel",
                    help="comma list of per-tensor, per-channel, torchao (engine torch)")
    ap.add_argument("--ct2-types", default="int8", help="CTranslate2 compute types, e.g. float32,int8")
    ap.add_argument("--wer", action="store_true", help="also greedy-decode every CTranslate2 variant: WER")
    ap.add_argument("--no-kl", action="store_true", help="with --wer: WER only (no reference distributions "
                    "and no teacher-forced pass; the encoder, most of a pass's time, runs either way)")
    ap.add_argument("--float-ops", action="store_true", help="ONNX Runtime quantizers leave a rotation's own ops "
                    "(output='restore''s Qᵀ, online Hadamards) in float: nodes_to_exclude")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="with --merge: a PNG of the KL ratios and their intervals")
    ap.add_argument("--against", help="with --merge: ratios to the original's row in this engine (its label, "
                    "e.g. 'ONNX Runtime MatMulNBits 4-bit RTN') instead of each row's own engine")
    ap.add_argument("--plot-title", default="Whisper: quantized variants against the quantized original")
    ap.add_argument("--merge", type=Path, nargs="+", help="no measuring: the table of earlier --json runs on "
                    "disjoint clip sets (e.g. one per --speech directory, run side by side), clips pooled")
    args = ap.parse_args(argv)
    global FLOAT_OPS
    FLOAT_OPS = args.float_ops
    for q in args.ort_quant.split(","):  # before any measuring: a typo costs nothing
        try:
            known = q in ORT_QUANT or qdq_knobs(q) is not None
        except ValueError as e:
            sys.exit(f"error: --ort-quant {e}")
        if not known:
            sys.exit(f"error: --ort-quant {q}: not one of {', '.join(ORT_QUANT)}, "
                     f"nor qdq-KNOB-… ({', '.join(QDQ_KNOBS)})")
    if args.merge:
        rows = merge([json.loads(p.read_text())["rows"] for p in args.merge])
        try:
            print(table(rows, args.against))
        except ValueError as e:
            sys.exit(f"error: {e}")
        if args.plot:
            plot(rows, args.plot, args.plot_title)
        if any("wer" in r for r in rows):
            print(wer_table(rows))
        if args.json:
            args.json.write_text(json.dumps({"clips": len(rows[0].get("clip_kl") or rows[0]["clip_err"]),
                                             "merged": [str(p) for p in args.merge], "rows": rows}))
        return
    torch.set_num_threads(2)
    set_prompt(args.orig)
    variants = {"original": args.orig, **{v.split("=", 1)[0]: Path(v.split("=", 1)[1]) for v in args.variants}}
    clips = [c for d in args.speech for c in load_clips(d)][: args.limit or None]
    feats = features(args.orig, clips)
    texts = [t for _, t in clips]
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    engines = args.engines.split(",")
    if args.no_kl:  # transcripts only: no reference distributions, no teacher-forced pass
        if not args.wer or engines != ["ct2"]:
            sys.exit("error: --no-kl measures WER only: pass --wer and --engines ct2")
        ct2_convert(args.orig, args.work / "original-float32", "float32")
        ref_logp, refs = None, [[] for _ in feats]
        what = "nothing: --no-kl"
    elif "ct2" in engines or args.wer:
        t1 = time.time()
        ref_logp, ref_hyps, refs = ct2_logits(ct2_convert(args.orig, args.work / "original-float32", "float32"),
                                              feats, None, greedy=args.wer)
        what = "CTranslate2 float32 original's greedy transcripts"
    else:  # no CTranslate2 here: teacher-force the sentences spoken
        from transformers import AutoTokenizer

        spoken = AutoTokenizer.from_pretrained(args.orig)
        refs = [spoken.encode(" " + t.strip(), add_special_tokens=False) for t in texts]
        what = "the spoken sentences"
    print(f"{len(feats)} clips, {sum(map(len, refs)) + len(refs)} decoder positions "
          f"(forced on {what}, {time.time() - t0:.0f} s)", flush=True)
    rows = []
    tok = None
    if args.wer:
        from transformers import WhisperTokenizer

        tok = WhisperTokenizer.from_pretrained(args.orig)
        if args.no_kl:
            t1 = time.time()
            _, ref_hyps, _ = ct2_logits(args.work / "original-float32", feats, refs, greedy=True, forced=False)
        hyps = ref_hyps
        errs, nwords = wer_counts(tok, hyps, texts)
        rows.append({"engine": "CTranslate2 float32", "variant": "original", "wer": sum(errs) / sum(nwords),
                     "clip_err": errs, "clip_words": nwords, "seconds": round(time.time() - t1, 1)})
        report(rows, args.json, len(feats))
    if "ct2" in engines:
        for q in args.ct2_types.split(","):  # every variant in one type before the next type
            for name, d in variants.items():
                # float32 with --wer: transcripts only (an exact variant's float32 KL to the float32
                # original is rounding noise, and the original's float32 WER row is measured above)
                wer_only = args.wer and (q == "float32" or args.no_kl)
                if wer_only and name == "original":
                    continue
                t1 = time.time()
                logp, hyps, _ = ct2_logits(ct2_convert(d, args.work / f"{name}-{q}", q), feats, refs,
                                        greedy=args.wer, forced=not wer_only)
                rows.append({"engine": f"CTranslate2 {q}", "variant": name,
                             **({} if wer_only else compare(ref_logp, logp))})
                del logp  # one variant's log-probs at a time
                if args.wer:
                    errs, nwords = wer_counts(tok, hyps, texts)
                    rows[-1].update(wer=sum(errs) / sum(nwords), clip_err=errs, clip_words=nwords)
                rows[-1]["seconds"] = round(time.time() - t1, 1)
                report(rows, args.json, len(feats))
    if "ort" in engines:
        n = args.ort_limit or len(feats)
        calib = None
        if needs := [q for q in args.ort_quant.split(",") if calibrated(q)]:
            if not args.calib:
                sys.exit(f"error: {', '.join(needs)} need(s) --calib DIR (clips not among the measured ones)")
            from transformers import AutoTokenizer

            cal = load_clips(args.calib)[-args.calib_count:]
            if shared := calibration_overlap([(d, len(load_clips(d))) for d in args.speech], args.calib, len(cal),
                                             args.limit):
                sys.exit(f"error: --calib {args.calib}: {shared} of its last {len(cal)} clips are measured too; "
                         "lower --calib-count or --limit")
            spoken = AutoTokenizer.from_pretrained(args.orig)
            calib = [ort_feed(features(args.orig, [c]), [spoken.encode(" " + c[1].strip(), add_special_tokens=False)])
                     for c in cal]
        paths = {name: ort_export(d, args.work / "onnx" / name / "model.onnx") for name, d in variants.items()}
        key = {"clips": n, "refs": refs[:n], "speech": [str(d) for d in args.speech]}
        if args.ref_cache and args.ref_cache.exists() and (c := torch.load(args.ref_cache))["key"] == key:
            ref_o = c["logp"]  # the same clips, tokens and float32 graph as a run before
        else:
            ref_o = ort_logits(paths["original"], feats[:n], refs[:n])
            if args.ref_cache:
                torch.save({"key": key, "logp": ref_o}, args.ref_cache)
        # the exported float32 graphs of the variants against the original's (exact conversions: rounding)
        for name, path in paths.items():
            if name != "original":
                got = ort_logits(path, feats[:2], refs[:2])
                err = max(float((a.exp() - b.exp()).abs().max()) for a, b in zip(ref_o[:2], got, strict=True))
                print(f"{name}: ONNX Runtime float32, max |Δprob| against the original on 2 clips {err:.2e}",
                      flush=True)
        for q in args.ort_quant.split(","):
            for name, path in paths.items():
                if q.startswith("nbits") and args.nbits_variants and name not in args.nbits_variants.split(","):
                    continue
                t1 = time.time()
                rows.append({"engine": ort_engine(q), "variant": name,
                             **compare(ref_o, ort_logits(ort_quantize(path, q, calib), feats[:n], refs[:n])),
                             "seconds": round(time.time() - t1, 1)})
                report(rows, args.json, len(feats))
    if "torch" in engines:
        ref_t = torch_logits(args.orig, feats, refs, "fp32")
        for q in args.torch_quant.split(","):
            for name, d in variants.items():
                t1 = time.time()
                rows.append({"engine": "torchao int8 dynamic" if q == "torchao" else f"torch dynamic int8 {q}",
                             "variant": name, **compare(ref_t, torch_logits(d, feats, refs, q)),
                             "seconds": round(time.time() - t1, 1)})
                report(rows, args.json, len(feats))
    print(table(rows))
    if args.wer:
        print(wer_table(rows))


def report(rows: list[dict], path: Path | None, clips: int) -> None:
    """Print the newest row and rewrite the JSON with every row so far (a long run keeps what it measured)."""
    print({k: v for k, v in rows[-1].items() if not k.startswith("clip")}, flush=True)
    if path:
        path.write_text(json.dumps({"clips": clips, "rows": rows}))


def merge(runs: list[list[dict]]) -> list[dict]:
    """Rows of runs on disjoint clip sets pooled into one row per (engine, variant): per-clip lists
    concatenated, means recomputed from them."""
    pooled: dict[tuple[str, str], dict] = {}
    for rows in runs:
        for r in rows:
            into = pooled.setdefault((r["engine"], r["variant"]), {"engine": r["engine"], "variant": r["variant"]})
            for k, v in r.items():
                if k.startswith("clip_"):
                    into.setdefault(k, []).extend(v)
    for r in pooled.values():
        if "clip_kl" in r:
            total = sum(r["clip_n"])
            r.update(kl=sum(r["clip_kl"]) / total, top1=sum(r["clip_agree"]) / total, positions=total)
        if "clip_err" in r:
            r["wer"] = sum(r["clip_err"]) / sum(r["clip_words"])
    return list(pooled.values())


def ratios(rows: list[dict]) -> list[tuple[str, str, float, float, float]]:
    """(engine, variant, KL ratio to the original's in that engine, 95% bootstrap low, high) of every
    variant measured on the same clips as its engine's original."""
    base = {r["engine"]: r for r in rows if r["variant"] == "original" and "kl" in r}
    out = []
    for r in rows:
        b = base.get(r["engine"])
        if r["variant"] == "original" or "kl" not in r or b is None or len(r["clip_kl"]) != len(b["clip_kl"]):
            continue
        lo, hi = bootstrap(*(np.array(x, dtype=float) for x in (r["clip_kl"], r["clip_n"], b["clip_kl"], b["clip_n"])))
        out.append((r["engine"], r["variant"], r["kl"] / b["kl"], lo, hi))
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    """One row per engine, one marker per variant: KL ratio to the original's with its 95% interval
    (log scale; the band is ±5%, the issue's "within noise of the original")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = ratios(rows)
    engines = list(dict.fromkeys(e for e, *_ in pts))
    variants = list(dict.fromkeys(v for _, v, *_ in pts))
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.25 * len(engines) * max(2, len(variants))))
    ax.axvspan(1 / 1.05, 1.05, color="0.9")
    ax.axvline(1, color="0.4", lw=0.8)
    step = 0.8 / max(1, len(variants))
    for k, v in enumerate(variants):
        ys = [engines.index(e) + (k - (len(variants) - 1) / 2) * step for e, w, *_ in pts if w == v]
        xs = [(x, lo, hi) for _, w, x, lo, hi in pts if w == v]
        ax.errorbar([x for x, _, _ in xs], ys, xerr=[[x - lo for x, lo, _ in xs], [hi - x for x, _, hi in xs]],
                    fmt="o", ms=4, capsize=2, label=v)
    ax.set_yticks(range(len(engines)), engines)
    ax.set_ylim(len(engines) - 0.5, -0.5)  # first engine on top, every marker inside
    ax.set_xscale("log")
    low, high = min(lo for *_, lo, _ in pts) / 1.1, max(hi for *_, hi in pts) * 1.1
    fine = (0.9, 0.95, 1.05, 1.1) if high / low < 1.6 else ()  # a narrow span (intervals near 1): more ticks
    ticks = [t for t in sorted((0.25, 0.5, 0.67, 0.8, 1, 1.25, 1.5, 2, 4, *fine)) if low <= t <= high]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("KL(fp32 original ‖ quantized variant) / KL(fp32 original ‖ quantized original), "
                  "95% bootstrap", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(rows: list[dict], against: str | None = None) -> str:
    """Markdown: KL and its ratio to the original's in the same engine with a 95% bootstrap interval over
    clips, top-1 agreement, and (with ``--wer``) the WER and its penalty over the float32 original.
    ``against``: every row's ratio to the original's in that one engine instead (what a user who changes both
    the model and the quantizer gains, e.g. a rotated model under GPTQ against the original under RTN)."""
    base = {r["engine"]: r for r in rows if r["variant"] == "original"}
    if against:
        if against not in base:
            raise ValueError(f"--against {against!r}: no original row in that engine (engines: {', '.join(base)})")
        base = dict.fromkeys(base, base[against])
    fp32_wer = next((r["wer"] for r in rows if r["engine"] == "CTranslate2 float32"), None)
    with_wer = any("wer" in r for r in rows)
    lines = ["| engine | variant | clips | KL(fp32 original ‖ q) | ratio to original (95% bootstrap) | top-1 "
             "agreement |" + (" WER | WER − fp32 |" if with_wer else ""),
             "|---|---|---|---|---|---|" + "---|" * 2 * with_wer]
    for r in rows:
        if "kl" not in r:
            lines.append(f"| {r['engine']} | {r['variant']} | {len(r['clip_err'])} | | | | {100 * r['wer']:.2f}% | "
                         f"{100 * (r['wer'] - fp32_wer):+.2f} |")
            continue
        b = base.get(r["engine"])
        if b is None:  # the original not measured in this run (--nbits-variants): merge with a run that has it
            lines.append(f"| {r['engine']} | {r['variant']} | {len(r['clip_kl'])} | {r['kl']:.3e} | (no original "
                         f"in this run) | {100 * r['top1']:.2f}% |" + " |" * 2 * with_wer)
            continue
        if len(r["clip_kl"]) != len(b["clip_kl"]):  # merged from fewer runs than the original: not paired
            lines.append(f"| {r['engine']} | {r['variant']} | {len(r['clip_kl'])} | (not on the original's "
                         f"{len(b['clip_kl'])} clips: merge its runs alone) | | | |" + " |" * 2 * with_wer)
            continue
        ratio = r["kl"] / b["kl"] if b["kl"] else float("nan")
        lo, hi = bootstrap(*(np.array(x, dtype=float) for x in (r["clip_kl"], r["clip_n"], b["clip_kl"], b["clip_n"])))
        wer = f" {100 * r['wer']:.2f}% | {100 * (r['wer'] - fp32_wer):+.2f} |" if "wer" in r else " | |" * with_wer
        lines.append(f"| {r['engine']} | {r['variant']} | {len(r['clip_kl'])} | {r['kl']:.3e} | {ratio:.3f} "
                     f"({lo:.3f}-{hi:.3f}) | {100 * r['top1']:.2f}% |{wer}")
    return "\n".join(lines)


def wer_table(rows: list[dict], quant: str = "CTranslate2 int8", full: str = "CTranslate2 float32",
              draws: int = 2000, seed: int = 0) -> str:
    """Markdown: each variant's WER in float32 and int8, its int8 penalty (int8 − float32, both of that
    variant), and the penalty's difference to the original's with a 95% paired bootstrap over clips
    (a draw takes the same clips for every cell; word counts are the same for every variant)."""
    by = {(r["engine"], r["variant"]): r for r in rows if "wer" in r}
    if (quant, "original") not in by or (full, "original") not in by:
        return ""
    words_ = np.array(by[(full, "original")]["clip_words"], dtype=float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(words_), size=(draws, len(words_)))

    def errs(engine: str, name: str) -> np.ndarray:
        return np.array(by[(engine, name)]["clip_err"], dtype=float)

    def interval(per_clip: np.ndarray) -> tuple[float, float]:
        lo, hi = np.percentile(per_clip[idx].sum(1) / words_[idx].sum(1), [2.5, 97.5])
        return 100 * float(lo), 100 * float(hi)

    base = errs(quant, "original") - errs(full, "original")
    lines = [f"{len(words_)} clips, {int(words_.sum())} words; WER in %, penalty = {quant} − {full} of the same "
             "variant, in points (95% paired bootstrap over clips)",
             "",
             "| variant | WER float32 | WER int8 | int8 penalty | penalty − original's |",
             "|---|---|---|---|---|"]
    shared = False
    for name in dict.fromkeys(r["variant"] for r in rows):
        if (quant, name) not in by or len(by[(quant, name)]["clip_err"]) != len(words_):
            continue
        # a variant without float32 transcripts of its own is measured against the original's: an exact
        # conversion's float32 model is the original's up to float32 rounding (marked *)
        own = (full, name) in by and len(by[(full, name)]["clip_err"]) == len(words_)
        shared |= not own
        fp32 = errs(full, name if own else "original")
        pen = errs(quant, name) - fp32
        lo, hi = interval(pen)
        dlo, dhi = interval(pen - base)
        d = f"{100 * (pen - base).sum() / words_.sum():+.2f} ({dlo:+.2f} to {dhi:+.2f})"
        lines.append(f"| {name} | {100 * fp32.sum() / words_.sum():.2f}{'' if own else '*'} | "
                     f"{100 * by[(quant, name)]['wer']:.2f} | "
                     f"{100 * pen.sum() / words_.sum():+.2f} ({lo:+.2f} to {hi:+.2f}) | "
                     f"{'–' if name == 'original' else d} |")
    if shared:
        lines.append("\n\\* the original's float32 transcripts (no float32 run of this variant): its penalty "
                     "difference is then its int8 WER minus the original's, paired over clips")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
