"""Whisper (a real checkpoint) at 4-bit activations: round-to-nearest W8A4 / W4A4, original against rotated.

No ONNX Runtime or CTranslate2 CPU quantizer offers 4-bit activations, so this is the fake quantization of
the DINOv2-shaped rows of ``docs/results/quantization.md`` (``bench_quant_rotation.py``'s ``w8a4`` /
``w4a4``), on Whisper tiny.en: every ``nn.Linear`` (``proj_out`` included) with its weight rounded per
output channel (symmetric absmax, ``bits``) and its input rounded per token (symmetric absmax, 4 bits) by
``quant_utils.fake_quantize_``; the encoder's two convolutions and a rotation's own ops (``output="restore"``'s
``Qᵀ``, online Hadamards) stay in float, as ``bench_quant_whisper.py --float-ops`` leaves them.

Variants: ``original``; ``hadamard`` = ``normswap.patch(model, fold_gamma=True)`` then
``normswap.rotate(model, "hadamard", output="restore")`` (native: the encoder's stream turns too, one ``Qᵀ``
op before its last norm); ``hadamard+online`` = the same with ``online=True`` (QuaRot's online Hadamard
before every MLP down projection, ``fc2``); and any ``name=DIR`` (a native checkpoint, e.g. one
``whisper_learned_rotation.py`` wrote). Metric as ``bench_quant_whisper.py``'s: KL(float32 original ‖
quantized variant) at every teacher-forced decoder position (forced on the sentence each clip speaks),
top-1 agreement, and each variant's KL as a ratio to the original's in the same setting with a 95% paired
bootstrap over clips. The float32 variants are checked against the original first (max |Δprob|).

    python benchmarks/whisper_rtn_activations.py --orig tiny-orig --speech speech --limit 64 \
        [learned=DIR ...] [--settings w8a4,w4a4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_whisper as bqw  # noqa: E402
from quant_utils import fake_quantize_  # noqa: E402
from speech_samples import load_clips  # noqa: E402

SETTINGS = {"w8a4": (8, 4), "w4a4": (4, 4), "w4a8": (4, 8), "w8a8": (8, 8), "w4": (4, None)}


def rotated(orig: Path, online: bool) -> Callable[[], torch.nn.Module]:
    """A builder of tiny-orig rotated by the randomized Hadamard (native, ``output="restore"``)."""
    def build() -> torch.nn.Module:
        import normswap

        model = bqw.whisper_model(orig)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            normswap.patch(model, fold_gamma=True)
            normswap.rotate(model, "hadamard", output="restore", online=online)
        return model.eval()
    return build


def logprobs(model: torch.nn.Module, feats: np.ndarray, refs: list[list[int]], batch: int = 4) -> list:
    """Teacher-forced log-probs of every position (the step after the last token included), float32."""
    out = []
    p = len(bqw.SOT_NOTS)
    with torch.inference_mode():
        for i in range(0, len(feats), batch):
            chunk = refs[i:i + batch]
            n = max(map(len, chunk))
            ids = torch.full((len(chunk), p + n), bqw.EOT)
            for j, r in enumerate(chunk):
                ids[j, : p + len(r)] = torch.tensor(list(bqw.SOT_NOTS) + r)
            logits = model(input_features=torch.from_numpy(feats[i:i + batch]), decoder_input_ids=ids).logits
            for j, r in enumerate(chunk):
                out.append(torch.log_softmax(logits[j, p - 1: p + len(r)].double(), -1).float())
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--orig", type=Path, required=True)
    ap.add_argument("variants", nargs="*", help="name=DIR (native checkpoints written by normswap)")
    ap.add_argument("--speech", type=Path, nargs="+", required=True)
    ap.add_argument("--limit", type=int, default=64, help="first N clips")
    ap.add_argument("--settings", default="w8a4,w4a4", help="comma list of " + ", ".join(SETTINGS))
    ap.add_argument("--builtin", default="hadamard,hadamard+online",
                    help="comma list of the variants built here: hadamard, hadamard+online (or empty)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ref-cache", type=Path, help="file holding the float32 original's log-probs on these clips, "
                    "reused by a later run (another setting, another variant)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bqw.set_prompt(args.orig)
    from transformers import AutoTokenizer

    clips = [c for d in args.speech for c in load_clips(d)][: args.limit or None]
    feats = bqw.features(args.orig, clips)
    tok = AutoTokenizer.from_pretrained(args.orig)
    refs = [tok.encode(" " + t.strip(), add_special_tokens=False) for _, t in clips]
    builders: dict[str, Callable[[], torch.nn.Module]] = {"original": lambda: bqw.whisper_model(args.orig)}
    for name in filter(None, args.builtin.split(",")):
        builders[name] = rotated(args.orig, online=name == "hadamard+online")
    for v in args.variants:
        name, d = v.split("=", 1)
        builders[name] = lambda d=Path(d): bqw.whisper_model(d)
    t0 = time.time()
    key = {"clips": len(feats), "refs": refs, "speech": [str(d) for d in args.speech]}
    if args.ref_cache and args.ref_cache.exists() and (cache := torch.load(args.ref_cache))["key"] == key:
        ref = cache["logp"]
    else:
        ref = logprobs(builders["original"](), feats, refs)
        if args.ref_cache:
            torch.save({"key": key, "logp": ref}, args.ref_cache)
    print(f"{len(feats)} clips, {sum(map(len, refs)) + len(refs)} positions; float32 original {time.time() - t0:.0f} s",
          flush=True)
    rows: list[dict] = []
    checks = {}
    for name, build in builders.items():  # the float32 variants against the original (exact: rounding only)
        if name != "original":
            got = logprobs(build(), feats[:2], refs[:2])
            checks[name] = max(float((a.exp() - b.exp()).abs().max()) for a, b in zip(ref[:2], got, strict=True))
            print(f"{name}: float32, max |Δprob| against the original on 2 clips {checks[name]:.2e}", flush=True)
    for setting in args.settings.split(","):
        w_bits, a_bits = SETTINGS[setting]
        for name, build in builders.items():
            t1 = time.time()
            model = build()
            fake_quantize_(model, w_bits, a_bits)
            rows.append({"engine": f"RTN {setting.upper()}", "variant": name,
                         **bqw.compare(ref, logprobs(model, feats, refs)), "seconds": round(time.time() - t1, 1)})
            del model
            print({k: v for k, v in rows[-1].items() if not k.startswith("clip")}, flush=True)
            if args.json:
                args.json.write_text(json.dumps({"clips": len(feats), "float_check": checks, "rows": rows}))
    print(bqw.table(rows))


if __name__ == "__main__":
    main()
