"""Half-precision error of a Whisper-style model before and after conversion.

    python benchmarks/bench_cast_fidelity.py [--seeds 6] [--d 32]

Whisper runs float32 weights on float16 activations: its LayerNorm computes in float32 and returns the
input dtype, its Linear casts the weight to the input dtype. ``patch`` replaces those norms with
``normswap.RMSNorm`` (float32 arithmetic for half inputs, one rounding to the input dtype). For each
random model (norm γ/β randomised, both attention paths: SDPA and Whisper's eager float32 softmax) this
prints the relative RMS error of the original and of the converted model, run on float16, bfloat16 and
float32 activations, against the model's exact function (float64 weights and inputs, its casts held at
float64), and the ratio converted / original.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from pathlib import Path

import torch

import normswap
from normswap.analysis import precision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.custom_models_cast import WAttention, WhisperStyle  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--d", type=int, default=32)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    ratios: dict[str, list[float]] = {}
    for sdpa in (True, False):
        WAttention.use_sdpa = sdpa
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            model = WhisperStyle(d=args.d).eval()
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() == 1:
                        p.add_(0.3 * torch.randn_like(p))
            mel, tokens = torch.randn(4, 8, 12), torch.randint(0, 40, (4, 10))
            with torch.no_grad(), precision.holding(torch.float64):
                ref = copy.deepcopy(model).double()(mel.double(), tokens)
            converted = copy.deepcopy(model)
            normswap.patch(converted, (mel, tokens))
            row: dict[str, object] = {"attention": "sdpa" if sdpa else "eager", "seed": seed}
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                name = str(dtype).removeprefix("torch.")
                with torch.no_grad():
                    before, after = (float((m(mel.to(dtype), tokens).double() - ref).norm() / ref.norm())
                                     for m in (model, converted))
                row[name] = {"original": before, "converted": after, "ratio": after / before}
                ratios.setdefault(name, []).append(after / before)
            print(json.dumps(row))
    print(json.dumps({k: {"min_ratio": min(v), "max_ratio": max(v)} for k, v in ratios.items()}))


if __name__ == "__main__":
    main()
