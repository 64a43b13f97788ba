"""Per-Linear int8 error of a converted Whisper against its original, as torchao's int8 dynamic scheme sees it.

torchao's ``Int8DynamicActivationInt8WeightConfig`` quantizes every ``nn.Linear``'s input per token and its
weight per output row (symmetric int8). This script simulates exactly that for each Linear on its own, in
float64, on a few clips, and prints the relative output error in the original and in the variant, before
and after removing each token's mean (what the next LayerNorm of the stream discards of a writer's error),
with both models' per-row weight range (absmax / rms) and per-token input range. A Linear whose error
ratio is far from 1 is where a conversion changes what the quantizer sees.

    python benchmarks/whisper_int8_linears.py ORIG VARIANT SPEECH_DIR [--clips 2]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_whisper as bq  # noqa: E402
from speech_samples import load_clips  # noqa: E402


def int8(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 along the last dimension (one scale per row), dequantized."""
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return (x / s).round().clamp(-128, 127) * s


def linear_errors(model_dir: Path, feats: torch.Tensor, ids: torch.Tensor) -> dict[str, dict]:
    """For every Linear: summed squared output error of int8 input × int8 weight (and of its per-token
    centred part), the squared reference, and the median per-row / per-token ranges."""
    model = bq.whisper_model(model_dir).double()
    out: dict[str, dict] = {}

    def hook(name: str, mod: torch.nn.Linear):
        def record(_mod, inputs, _y) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            ref = x @ mod.weight.T
            err = int8(x) @ int8(mod.weight).T - ref
            r = out.setdefault(name, {"err": 0.0, "ref": 0.0, "err_c": 0.0, "ref_c": 0.0, "x_range": []})
            r["err"] += float(err.pow(2).sum())
            r["ref"] += float(ref.pow(2).sum())
            r["err_c"] += float((err - err.mean(-1, keepdim=True)).pow(2).sum())
            r["ref_c"] += float((ref - ref.mean(-1, keepdim=True)).pow(2).sum())
            r["x_range"].append(float((x.abs().amax(-1) / x.pow(2).mean(-1).sqrt().clamp_min(1e-12)).median()))
            r["w_range"] = float((mod.weight.abs().amax(-1) / mod.weight.pow(2).mean(-1).sqrt()).median())
        return record

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_hook(hook(name, mod))
    with torch.inference_mode():
        model(input_features=feats.double(), decoder_input_ids=ids)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("orig", type=Path)
    ap.add_argument("variant", type=Path)
    ap.add_argument("speech", type=Path)
    ap.add_argument("--clips", type=int, default=2)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    bq.set_prompt(args.orig)
    clips = load_clips(args.speech)[: args.clips]
    feats = torch.from_numpy(bq.features(args.orig, clips))
    tok = AutoTokenizer.from_pretrained(args.orig)
    ids = torch.from_numpy(bq.ort_feed(feats.numpy(), [tok.encode(" " + t.strip(), add_special_tokens=False)
                                                       for _, t in clips])["decoder_input_ids"])
    a, b = linear_errors(args.orig, feats, ids), linear_errors(args.variant, feats, ids)
    print("| Linear | rel. error, original | variant | ratio | centred: original | variant | ratio | "
          "row range o / v | token range o / v |")
    print("|---|---|---|---|---|---|---|---|---|")
    changed = []
    for name, o in a.items():
        v = b[name]
        e_o, e_v = math.sqrt(o["err"] / o["ref"]), math.sqrt(v["err"] / v["ref"])
        c_o, c_v = math.sqrt(o["err_c"] / o["ref_c"]), math.sqrt(v["err_c"] / v["ref_c"])
        if abs(c_v / c_o - 1) > 1e-3:
            changed.append(c_v / c_o)
        print(f"| {name} | {e_o:.3e} | {e_v:.3e} | {e_v / e_o:.3f} | {c_o:.3e} | {c_v:.3e} | {c_v / c_o:.3f} | "
              f"{o['w_range']:.1f} / {v['w_range']:.1f} | {np.median(o['x_range']):.1f} / "
              f"{np.median(v['x_range']):.1f} |")
    if changed:
        print(f"\n{len(changed)} of {len(a)} Linears differ (centred error ratio ≠ 1 by > 0.1%): "
              f"{min(changed):.3f}-{max(changed):.3f}, geometric mean "
              f"{math.exp(sum(map(math.log, changed)) / len(changed)):.3f}")
    else:
        print(f"\nnone of the {len(a)} Linears differs")


if __name__ == "__main__":
    main()
