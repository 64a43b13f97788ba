"""A learned rotation on Whisper (a real Pre-LN checkpoint), written as a native checkpoint for
``bench_quant_whisper.py``.

``normswap.patch(model, fold_gamma=True)`` then ``normswap.rotate(model, "learned", output=...)`` on the
float32 checkpoint, learned on clips the measurement does not use (``--calib``: e.g. ``speech4``, a
re-spoken set), teacher-forced on each clip's spoken sentence (``<|startoftranscript|><|notimestamps|>``,
its tokens, end-of-text): the loss is the KL of the fake-quantized model's next-token distribution against the
float model's at every position. ``--output restore`` turns the encoder's stream too (its last norm's output
is the encoder's output, read by every cross-attention: one ``Qᵀ`` matmul before that norm, which the native
format holds and ``bench_quant_whisper.py --float-ops`` keeps in float). Prints the learning's time and
peak memory.

    python benchmarks/whisper_learned_rotation.py --orig tiny-orig --calib speech4 --clips 16 --batch 4 \
        --steps 100 --group-size 32 --grid full --output restore --out tiny-learned
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_whisper as bqw  # noqa: E402
from speech_samples import load_clips  # noqa: E402


def batches(orig: Path, calib: Path, clips: int, batch: int) -> list[dict]:
    """``clips`` clips of ``calib`` as ``{"input_features", "decoder_input_ids"}`` batches, each forced on its
    spoken sentence (padded with end-of-text)."""
    from transformers import AutoTokenizer

    bqw.set_prompt(orig)
    tok = AutoTokenizer.from_pretrained(orig)
    chosen = load_clips(calib)[:clips]
    feats = bqw.features(orig, chosen)
    refs = [tok(" " + text.strip(), add_special_tokens=False).input_ids + [bqw.EOT] for _, text in chosen]
    out = []
    for i in range(0, len(chosen), batch):
        feed = bqw.ort_feed(feats[i:i + batch], refs[i:i + batch])
        out.append({k: torch.from_numpy(v) for k, v in feed.items()})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--orig", type=Path, required=True)
    ap.add_argument("--calib", type=Path, required=True, help="clip directory (not one the measurement uses)")
    ap.add_argument("--clips", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=32, help="0: one scale per output channel")
    ap.add_argument("--grid", default="full", help="symmetric, full, asymmetric, or several joined by + "
                    "(full+asymmetric: one rotation for ONNX Runtime's RTN grid and HQQ's asymmetric one)")
    ap.add_argument("--act-bits", type=int, help="also round every Linear input per token to this many bits")
    ap.add_argument("--online", action="store_true", help="QuaRot's online Hadamards before the down projections")
    ap.add_argument("--scales", action="store_true", help="also learn per-channel norm scales")
    ap.add_argument("--output", default="restore", choices=("none", "restore"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import normswap

    cal = batches(args.orig, args.calib, args.clips, args.batch)
    model = bqw.whisper_model(args.orig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(model, fold_gamma=True)
        t0 = time.perf_counter()
        rot = normswap.rotate(model, "learned", output=None if args.output == "none" else args.output,
                              online=args.online, calibration=cal, bits=args.bits, act_bits=args.act_bits,
                              group_size=args.group_size or None, grid=args.grid, steps=args.steps, lr=args.lr,
                              scales=args.scales)
        seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(rot)
    print(f"learning: {seconds:.0f} s, peak RSS {peak:.0f} MB, {args.clips} clips in batches of {args.batch}")
    normswap.save(model, args.out)  # the benchmark reads the tokenizer and features from --orig


if __name__ == "__main__":
    main()
