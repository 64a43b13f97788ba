"""OpenVINO time of the default conversion against the original, each also against a second compiled copy of itself.

Round 55's ``ov_writer_ops_speed.py`` puts the original at both ends of every round, and calls in the middle of a
round ran faster on that machine, so its default-against-original ratio was biased. Here a round times four
compiled models, ``A B B' A'`` or ``B A A' B'`` alternately (``A``/``A'``: two compiled copies of the original,
``B``/``B'``: of the converted model), each a few calls, thread CPU time, so position and drift cancel; the A/A
ratio (``A'`` over ``A``) is the noise floor of the same run. Inputs: two ONNX exports of DINOv2-small at
``--px`` px (the original and ``normswap convert``'s default, as ``ov_writer_ops_speed.py --onnx-dir`` writes
them), float32 (``INFERENCE_PRECISION_HINT=f32``) and NNCF int8 weights (``nncf.compress_weights`` defaults), one
inference thread, one stream.

    PYTHONPATH=OV python benchmarks/ov_default_vs_original.py ONNX_DIR --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path


def spread(values: list[float]) -> dict[str, float]:
    """Median and the second-lowest / second-highest value."""
    v = sorted(values)
    return {"median": statistics.median(v), "low": v[1], "high": v[-2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("onnx_dir", type=Path, help="holds original-PX.onnx and native-PX.onnx")
    ap.add_argument("--px", type=int, default=112)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import nncf
    import numpy as np
    import openvino as ov

    nncf.set_log_level(logging.ERROR)
    core = ov.Core()
    config = {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": "f32"}
    models = {k: core.read_model(args.onnx_dir / f"{k}-{args.px}.onnx") for k in ("original", "native")}
    result = {"openvino": ov.__version__, "nncf": nncf.__version__, "cells": {}}
    for precision in ("f32", "w8"):
        prepared = {k: nncf.compress_weights(m.clone()) if precision == "w8" else m for k, m in models.items()}
        for batch in args.batches:
            x = np.random.default_rng(0).standard_normal((batch, 3, args.px, args.px)).astype(np.float32)
            requests = {(k, c): core.compile_model(prepared[k], "CPU", config).create_infer_request()
                        for k in ("original", "native") for c in (0, 1)}
            for r in requests.values():
                r.infer([x])
            calls = 8 if batch == 1 else 3

            def timed(request, x=x, calls=calls) -> float:
                t0 = time.thread_time()
                for _ in range(calls):
                    request.infer([x])
                return (time.thread_time() - t0) / calls
            ratios, floor = [], []
            a, a2, b, b2 = ("original", 0), ("original", 1), ("native", 0), ("native", 1)
            for r in range(args.rounds):
                order = [a, b, b2, a2] if r % 2 == 0 else [b, a, a2, b2]
                t = {key: timed(requests[key]) for key in order}
                ratios.append((t[b] + t[b2]) / (t[a] + t[a2]))
                floor.append(t[a2] / t[a])
            cell = {"default / original": spread(ratios), "A/A (original)": spread(floor)}
            result["cells"][f"{precision}, batch {batch}"] = cell
            print(f"{precision}, batch {batch}: default / original {cell['default / original']['median']:.3f} "
                  f"({cell['default / original']['low']:.3f}-{cell['default / original']['high']:.3f}); "
                  f"A/A {cell['A/A (original)']['median']:.3f}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
