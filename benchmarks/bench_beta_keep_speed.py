"""What keeping every β in its norm (``beta_placement="keep"``) costs in ONNX Runtime, end to end.

A kept β is one more ``Add`` per norm in the native format (ONNX Runtime's fused
``SimplifiedLayerNormalization`` has no bias input, so the β is an ``Add`` after it); in the compat format
it costs nothing (the stock ``LayerNormalization`` takes β as its bias, exactly as the original's). The
readers keep their biases either way (a folded β only changes the values of a bias the reader has),
so the only difference between the placements is that ``Add``.

Model: GPT-2 small's body (12 layers, width 768, random weights, γ/β and biases randomised; built by
``bench_deploy_speed.build``), exported with ``torch.onnx.export(dynamo=True)``. Variants: the original,
the native conversion with ``beta_placement="rounding"`` (the default), ``"keep"`` and ``"fold"``. Per
variant the fused-op counts in ORT's optimised graph (every norm must fuse with its β kept), then
interleaved ABBA timing (one thread) of ``keep`` against ``fold`` (the extra ``Add`` alone) and against the
original, at batch 1 and 4, 32 and 128 tokens.

    python benchmarks/bench_beta_keep_speed.py [--budget 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_deploy_speed import Body, abba, build, export, inputs_for, ort_call, ort_session  # noqa: E402

import normswap  # noqa: E402
from normswap.integrations.onnx import fused_norm_ops  # noqa: E402

SHAPES = [(1, 32), (4, 32), (1, 128), (4, 128)]
PAIRS = [("keep", "fold"), ("keep", "rounding"), ("keep", "original"), ("rounding", "original")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--budget", type=float, default=20.0, help="seconds of ABBA quads per cell")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, keys = build("gpt2", layers=args.layers)
    example = inputs_for("gpt2", 1, 32)
    result: dict = {"ops": {}, "cells": []}
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {}
        for name in ("original", "rounding", "keep", "fold"):
            m = copy.deepcopy(model)
            if name != "original":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    report = normswap.patch(m, beta_placement=name)
                result.setdefault("kept", {})[name] = sum(1 for s in report.plan.sites if not s.fold_beta)
            path = Path(tmp) / f"{name}.onnx"
            export(Body(m, keys), example, path, None)
            result["ops"][name] = fused_norm_ops(path)
            sessions[name] = ort_session(path)
            print(name, result["ops"][name], flush=True)
        for batch, tokens in SHAPES:
            ex = inputs_for("gpt2", batch, tokens)
            for a, b in PAIRS:
                cell = abba(ort_call(sessions[b], ex), ort_call(sessions[a], ex), args.budget, 5)
                result["cells"].append({"batch": batch, "tokens": tokens, "variant": a, "against": b, **cell})
                print(result["cells"][-1], flush=True)
    print("\n| batch × tokens | " + " | ".join(f"{a} / {b}" for a, b in PAIRS) + " |")
    print("|---|" + "---|" * len(PAIRS))
    for batch, tokens in SHAPES:
        cells = [c for c in result["cells"] if (c["batch"], c["tokens"]) == (batch, tokens)]
        print(f"| {batch} × {tokens} | " + " | ".join(f"{c['ratio']:.3f} ({c['q1']:.2f}-{c['q3']:.2f})"
                                                     for c in cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
