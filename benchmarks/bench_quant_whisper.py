"""Whisper (a real checkpoint) through real int8 quantizers: how much each normswap variant loses.

Issue 40 §2 reported Whisper tiny.en in CTranslate2 int8 on 48 utterances (WER penalty +0.7 original,
+2.6 compat, +1.3 compat + Hadamard), too few to rank. WER moves in whole words; this benchmark measures
the quantized model's *distribution* instead, teacher-forced, at every decoder position of every clip:

* reference tokens: the float32 original's greedy transcript of each clip (CTranslate2 float32);
* KL(float32 original ‖ quantized variant), mean over all positions (the step after the last token,
  which predicts end-of-text, included), and top-1 agreement with the float32 original's argmax.

Engines: CTranslate2 int8 (each variant's transformers directory converted by CTranslate2's own
``ct2-transformers-converter --quantization int8``; teacher forcing through ``Whisper.generate`` with the
reference tokens as the prompt and ``return_logits_vocab=True``, which returns the logits of forced steps
too), and torch's dynamic int8 (``torch.ao.quantization.quantize_dynamic`` on every ``nn.Linear``,
per-tensor and per-channel weights; a CPU stand-in for ONNX Runtime's ``quantize_dynamic``, same scheme:
int8 weights, dynamic uint8 activations).

    python benchmarks/bench_quant_whisper.py --orig DIR name=DIR ... --speech DIR [DIR ...] \
        --work WORKDIR [--engines ct2,torch] [--json out.json]

The variants' directories come from ``normswap convert ORIG --format compat --dtype float32 ...``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speech_samples import load_clips  # noqa: E402

SOT_NOTS = (50257, 50362)  # tiny.en/base.en: <|startoftranscript|><|notimestamps|>


def features(orig: Path, speech_dirs: list[Path], limit: int = 0) -> np.ndarray:
    """Log-mel features (N, 80, 3000) of every clip, by the checkpoint's own feature extractor."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor.from_pretrained(orig)
    waves = [w.numpy() for d in speech_dirs for w, _ in load_clips(d)][: limit or None]
    return fe(waves, sampling_rate=16000, return_tensors="np").input_features.astype(np.float32)


def ct2_convert(src: Path, dst: Path, quantization: str) -> Path:
    if not (dst / "model.bin").exists():
        subprocess.run(["ct2-transformers-converter", "--model", str(src), "--output_dir", str(dst),
                        "--quantization", quantization, "--force"], check=True, capture_output=True)
    return dst


def ct2_logits(model_dir: Path, feats: np.ndarray, refs: list[list[int]] | None) -> tuple[list, list]:
    """(per-clip log-probs [n+1, V] teacher-forced on refs, greedy refs if refs is None)."""
    import ctranslate2

    m = ctranslate2.models.Whisper(str(model_dir), device="cpu", intra_threads=2)
    out_logp, out_refs = [], []
    for i in range(0, len(feats), 8):
        enc = m.encode(ctranslate2.StorageView.from_array(np.ascontiguousarray(feats[i:i + 8])), to_cpu=True)
        if refs is None:
            # Greedy with the logits of every step: the reference tokens, and the original's
            # distributions teacher-forced on them (each step is conditioned on the previous argmax).
            res = m.generate(enc, [list(SOT_NOTS)] * len(feats[i:i + 8]), beam_size=1, max_length=120,
                             return_logits_vocab=True, suppress_blank=False, suppress_tokens=[])
            for r in res:
                ref = [t for t in r.sequences_ids[0] if t != 50256]
                steps = np.stack([np.array(x) for x in r.logits[0]])[: len(ref) + 1]
                out_refs.append(ref)
                out_logp.append(torch.log_softmax(torch.from_numpy(steps).double(), -1))
            continue
        batch = refs[i:i + 8]
        prompts = [list(SOT_NOTS) + r for r in batch]
        res = m.generate(enc, prompts, beam_size=1, max_length=min(440, 2 * max(map(len, batch)) + 8),
                         return_logits_vocab=True, suppress_blank=False, suppress_tokens=[])
        for r, ref in zip(res, batch, strict=True):
            steps = np.stack([np.array(x) for x in r.logits[0]])[: len(ref) + 1]
            assert r.sequences_ids[0][: len(ref)] == ref, (r.sequences_ids[0], ref, len(steps))
            out_logp.append(torch.log_softmax(torch.from_numpy(steps).double(), -1))
    return out_logp, out_refs


def torch_logits(model_dir: Path, feats: np.ndarray, refs: list[list[int]], quant: str) -> list:
    from transformers import WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    if quant != "fp32":
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        spec = {torch.nn.Linear: per_channel_dynamic_qconfig} if quant == "per-channel" else {torch.nn.Linear}
        model = quantize_dynamic(model, spec, dtype=torch.qint8)
    out = []
    with torch.inference_mode():
        for i in range(0, len(feats), 4):
            batch = refs[i:i + 4]
            n = max(map(len, batch))
            ids = torch.full((len(batch), 2 + n), 50256)
            for j, r in enumerate(batch):
                ids[j, : 2 + len(r)] = torch.tensor(list(SOT_NOTS) + r)
            logits = model(input_features=torch.from_numpy(feats[i:i + 4]), decoder_input_ids=ids).logits
            for j, r in enumerate(batch):
                out.append(torch.log_softmax(logits[j, 1: 2 + len(r)].double(), -1))
    return out


def compare(ref: list, got: list) -> dict:
    # A clip whose greedy reference stopped at max_length has no end-of-text step: common length.
    pairs = [(p[: min(len(p), len(q))], q[: min(len(p), len(q))]) for p, q in zip(ref, got, strict=True)]
    kl = torch.cat([(p.exp() * (p - q)).sum(-1) for p, q in pairs])
    agree = torch.cat([(p.argmax(-1) == q.argmax(-1)).double() for p, q in pairs])
    return {"kl": kl.mean().item(), "top1": agree.mean().item(), "positions": kl.numel()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--orig", type=Path, required=True)
    ap.add_argument("variants", nargs="*", help="name=DIR (transformers directories written by normswap)")
    ap.add_argument("--speech", type=Path, nargs="+", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--engines", default="ct2,torch")
    ap.add_argument("--limit", type=int, default=0, help="first N clips only")
    ap.add_argument("--ct2-types", default="int8", help="CTranslate2 compute types, e.g. float32,int8")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    variants = {"original": args.orig, **{v.split("=", 1)[0]: Path(v.split("=", 1)[1]) for v in args.variants}}
    feats = features(args.orig, args.speech, args.limit)
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    ref_logp, refs = ct2_logits(ct2_convert(args.orig, args.work / "original-float32", "float32"), feats, None)
    print(f"{len(feats)} clips, {sum(map(len, refs)) + len(refs)} decoder positions "
          f"(reference: CTranslate2 float32 original, {time.time() - t0:.0f} s)", flush=True)
    rows = []
    engines = args.engines.split(",")
    if "ct2" in engines:
        for name, d in variants.items():
            for q in args.ct2_types.split(","):
                logp, _ = ct2_logits(ct2_convert(d, args.work / f"{name}-{q}", q), feats, refs)
                rows.append({"engine": f"CTranslate2 {q}", "variant": name, **compare(ref_logp, logp)})
                print(rows[-1], flush=True)
    if "torch" in engines:
        ref_t = torch_logits(args.orig, feats, refs, "fp32")
        for name, d in variants.items():
            for q in ("per-tensor", "per-channel"):
                rows.append({"engine": f"torch dynamic int8 {q}", "variant": name,
                             **compare(ref_t, torch_logits(d, feats, refs, q))})
                print(rows[-1], flush=True)
    print("\n| engine | variant | KL(fp32 original ‖ q) | ratio vs original | top-1 agreement |")
    print("|---|---|---|---|---|")
    base = {r["engine"]: r["kl"] for r in rows if r["variant"] == "original"}
    for r in rows:
        ratio = r["kl"] / base[r["engine"]] if base[r["engine"]] else float("nan")
        print(f"| {r['engine']} | {r['variant']} | {r['kl']:.3e} | {ratio:.2f} | {r['top1']:.4f} |")
    if args.json:
        args.json.write_text(json.dumps({"clips": len(feats), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
