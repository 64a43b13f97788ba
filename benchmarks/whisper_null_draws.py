"""Null draws for a 4-bit comparison: the original Whisper re-written so that it computes the same function
but its weights round differently.

Every reader of a Whisper stream (encoder and decoder) goes through a LayerNorm, which discards the stream's
per-token mean. Shifting every row of a writer (``out_proj``, ``fc2``) by the same vector ``v`` adds
``(v · x)`` to every feature of the stream, a per-token constant that every LayerNorm removes: the model is
unchanged (float64: ~1e-12), but a block-wise quantizer rounds new numbers. The default conversion does
exactly this with ``v`` = the writer's mean row (centring), whose norm is ~1% of a row's; a null draw uses a
random ``v`` of the same norm. The spread of the nulls' 4-bit error around the original's is the noise of
"which weights happen to round which way", which a bootstrap over clips does not see.

    python benchmarks/whisper_null_draws.py ORIG OUT_DIR --seed 1 [--alpha A | --signs] [--check SPEECH_DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_whisper as bq  # noqa: E402


def writers(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and n.rsplit(".", 1)[-1] in ("out_proj", "fc2") and (".encoder." in n or ".decoder." in n)}


def shift(model: torch.nn.Module, seed: int, alpha: float | None = None, signs: bool = False) -> int:
    """Every writer's rows shifted by a random vector as long as its mean row (the centring's shift); with
    ``alpha``, by ``alpha`` × the mean row instead (1: the conversion's centring; −1: its mirror image); with
    ``signs``, by the mean row with each entry's sign drawn at random (the columns the centring moves most,
    moved as much)."""
    g = torch.Generator().manual_seed(seed)
    found = writers(model)
    with torch.no_grad():
        for mod in found.values():
            w = mod.weight
            mean = w.double().mean(0)
            if signs:  # the centring's shift per column, each with a random sign
                v = mean * (torch.randint(0, 2, mean.shape, generator=g, dtype=torch.float64) * 2 - 1)
            elif alpha is None:
                v = torch.randn(w.shape[1], generator=g, dtype=torch.float64)
                v = v * (mean.norm() / v.norm())
            else:
                v = alpha * mean
            w.copy_((w.double() - v).to(w.dtype))
    return len(found)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("orig", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--alpha", type=float, help="shift by ALPHA × each writer's mean row instead of a random vector")
    ap.add_argument("--signs", action="store_true", help="shift by each writer's mean row with random signs")
    ap.add_argument("--check", type=Path, help="a clip directory: float64 logits of one clip, null vs original")
    args = ap.parse_args(argv)
    model = bq.whisper_model(args.orig)
    n = shift(model, args.seed, args.alpha, args.signs)
    if args.check:
        from speech_samples import load_clips

        bq.set_prompt(args.orig)
        feats = torch.from_numpy(bq.features(args.orig, load_clips(args.check)[:1])).double()
        ids = torch.tensor([[*bq.SOT_NOTS, bq.EOT]])
        ref = bq.whisper_model(args.orig).double()
        with torch.inference_mode():
            a = ref(input_features=feats, decoder_input_ids=ids).logits
            b = model.double()(input_features=feats, decoder_input_ids=ids).logits
        print(f"float64 logits, null against original: max rel error {float((a - b).abs().max() / a.abs().max()):.1e}")
        model.float()
    model.save_pretrained(args.out)
    for f in args.orig.iterdir():  # tokenizer and feature extractor files, as the original's directory has them
        if f.is_file() and not (args.out / f.name).exists() and f.suffix != ".safetensors":
            shutil.copy(f, args.out / f.name)
    how = (f"alpha {args.alpha:g} × the mean row" if args.alpha is not None
           else f"the mean row, random signs, seed {args.seed}" if args.signs else f"seed {args.seed}")
    print(f"{n} writers shifted ({how}) → {args.out}")


if __name__ == "__main__":
    main()
