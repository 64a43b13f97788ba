"""A learned rotation on Whisper (a real Pre-LN checkpoint), written as a native checkpoint for
``bench_quant_whisper.py``.

``normswap.patch(model, fold_gamma=True)`` then ``normswap.rotate(model, "learned", output=...)`` on the
float32 checkpoint, learned on clips the measurement does not use (``--calib``: e.g. ``speech4``, a
re-spoken set), teacher-forced on each clip's spoken sentence (``<|startoftranscript|><|notimestamps|>``,
its tokens, end-of-text): the loss is the KL of the fake-quantized model's next-token distribution against the
float model's at every position. ``--output restore`` turns the encoder's stream too (its last norm's output
is the encoder's output, read by every cross-attention: one ``Qᵀ`` matmul before that norm, which the native
format holds and ``bench_quant_whisper.py --float-ops`` keeps in float). ``--output none`` leaves the encoder's
stream unturned (only the decoder's turns and learns); with ``--fold turned`` the conversion and rotation are one
``normswap.patch(model, rotate="learned", ...)``, which folds γ only into the stream that turns, so the
encoder's norms keep γ as ``convert --rotate`` writes them (its readers' columns are not widened by a fold
nothing undoes: what HQQ and RTN pay for on the encoder). ``--cache-encoder`` (with ``--output none``): the
calibration batches carry the float encoder's output (``encoder_outputs``) instead of the audio features, so
each step runs the decoder only: the encoder's stream is not turned, so nothing the learning moves reaches
its computation; the loss is then the decoder's own quantization error on the float encoder states (the
encoder's weights are not rounded in it); the encoder, most of a step's work on 30-second windows, runs once.
``--logit-top-k K``: the loss's KL on each batch's ``K`` likeliest tokens per position (of the float model) and
its forced tokens only, the 51,865-row head turned and rounded on those rows alone (``rotate(logit_top_k=K)``);
``--steps 0 --json F`` scores the Hadamard start and no rotation only (both losses in ``F``), which is how the
cheaper loss is checked against the full one. Prints the learning's time and peak memory, and each loss the
learning computes to stderr (with the time since the start).

    python benchmarks/whisper_learned_rotation.py --orig tiny-orig --calib speech4 --clips 16 --batch 4 \
        --steps 100 --group-size 32 --grid full --output restore --out tiny-learned
    # decoder only, γ folded where the stream turns, one rotation for RTN's and HQQ's grids
    python benchmarks/whisper_learned_rotation.py --orig tiny-orig --calib speech4 --clips 16 --batch 2 \
        --steps 100 --group-size 32 --grid full+asymmetric --output none --fold turned --cache-encoder \
        --out tiny-learned-dec
    # the same, the KL on the top 64 tokens (and the forced ones) per batch
    python benchmarks/whisper_learned_rotation.py ... --logit-top-k 64 --json learned.json --out tiny-learned-dec-k64
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_whisper as bqw  # noqa: E402
from speech_samples import load_clips  # noqa: E402


def batches(orig: Path, calib: Path, clips: int, batch: int, encoder: torch.nn.Module | None = None) -> list[dict]:
    """``clips`` clips of ``calib`` as ``{"input_features", "decoder_input_ids"}`` batches, each forced on its
    spoken sentence (padded with end-of-text); with ``encoder``, ``input_features`` replaced by
    ``encoder_outputs``, that encoder's float output on them."""
    from transformers import AutoTokenizer

    bqw.set_prompt(orig)
    tok = AutoTokenizer.from_pretrained(orig)
    chosen = load_clips(calib)[:clips]
    feats = bqw.features(orig, chosen)
    refs = [tok(" " + text.strip(), add_special_tokens=False).input_ids + [bqw.EOT] for _, text in chosen]
    out = []
    for i in range(0, len(chosen), batch):
        feed = bqw.ort_feed(feats[i:i + batch], refs[i:i + batch])
        one = {k: torch.from_numpy(v) for k, v in feed.items()}
        if encoder is not None:
            with torch.no_grad():
                one["encoder_outputs"] = (encoder(one.pop("input_features")).last_hidden_state,)
        out.append(one)
    return out


def progress() -> None:
    """Print each loss the learning computes to stderr, with the time since the start: the learning itself
    reports only at its end, and a run on a shared machine needs watching (``learn.output_error`` is
    called once per batch and grid, in the optimiser's steps and in each scoring pass)."""
    from normswap.rotation import learn

    t0, count, inner = time.perf_counter(), [0], learn.output_error

    def logged(*a, **k):
        value = inner(*a, **k)
        count[0] += 1
        print(f"[{time.perf_counter() - t0:7.0f} s] loss call {count[0]}: {float(value):.4g}", file=sys.stderr,
              flush=True)
        return value

    learn.output_error = logged


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
    ap.add_argument("--fold", default="all", choices=("all", "turned"),
                    help="all: patch(fold_gamma=True) then rotate; turned: one patch(rotate='learned'), γ folded "
                    "only into the streams that turn")
    ap.add_argument("--cache-encoder", action="store_true", help="with --output none: learn on the float "
                    "encoder's outputs (the decoder alone runs per step)")
    ap.add_argument("--kind", default="learned", choices=("learned", "hadamard"),
                    help="hadamard: no learning (the learned rotation's start), e.g. with --smooth")
    ap.add_argument("--smooth", type=float, help="SmoothQuant's α after the turn (rotate's smooth=), measured on "
                    "the --calib clips")
    ap.add_argument("--seed", type=int, default=0, help="the Hadamard start's random signs")
    ap.add_argument("--logit-top-k", type=int, help="the loss's KL on each batch's K likeliest tokens per position "
                    "(and its forced tokens) only (default: the whole vocabulary)")
    ap.add_argument("--heads", action="store_true", help="also learn SpinQuant's R2 (one head-size rotation per "
                    "attention layer)")
    ap.add_argument("--json", type=Path, help="write the learning's record, time and peak memory here")
    ap.add_argument("--out", type=Path, help="write the rotated model here (native checkpoint)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import normswap

    if args.cache_encoder and args.output != "none":
        ap.error("--cache-encoder needs --output none: a turned encoder stream moves with the learning")
    model = bqw.whisper_model(args.orig)
    cal = batches(args.orig, args.calib, args.clips, args.batch,
                  model.get_encoder().eval() if args.cache_encoder else None)
    output = None if args.output == "none" else args.output
    learn_settings = dict(bits=args.bits, act_bits=args.act_bits, group_size=args.group_size or None, grid=args.grid,
                          steps=args.steps, lr=args.lr, scales=args.scales, heads=args.heads,
                          logit_top_k=args.logit_top_k) if args.kind == "learned" else {}
    progress()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if args.fold == "turned":
            t0 = time.perf_counter()
            rot = normswap.patch(model, rotate=args.kind, rotate_output=output, rotate_seed=args.seed,
                                 online_hadamard=args.online, rotate_learn=learn_settings or None,
                                 rotate_smooth=args.smooth, calibration=cal).rotation
        else:
            normswap.patch(model, fold_gamma=True)
            t0 = time.perf_counter()
            rot = normswap.rotate(model, args.kind, seed=args.seed, output=output, online=args.online,
                                  smooth=args.smooth, calibration=cal, **learn_settings)
        seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(rot)
    print(f"{args.kind} rotation: {seconds:.0f} s, peak RSS {peak:.0f} MB, {args.clips} clips in batches of "
          f"{args.batch}")
    if args.json:
        record = rot.learned.record() if rot.learned is not None else {}
        args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                  for k, v in vars(args).items()},
                                         "learned": record, "seconds": seconds, "peak_mb": peak,
                                         "history": rot.learned.history if rot.learned is not None else []},
                                        indent=1))
    if args.out:
        normswap.save(model, args.out)  # the benchmark reads the tokenizer and features from --orig


if __name__ == "__main__":
    main()
