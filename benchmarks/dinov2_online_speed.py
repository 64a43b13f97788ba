"""ONNX Runtime float32 latency of a DINOv2 with online Hadamards alone against the original, side by side.

Three ONNX files from one checkpoint: the original, the checkpoint ``normswap convert`` writes (β kept) and the
same with ``normswap.rotate(model, "none", online=True)``; one-thread sessions timed in ABBA rounds (the
original, the online model, the native one, the original, ...), each ratio against the original's runs around
it, and the original against itself (the machine's noise). Prints the median and range over the rounds.

    python benchmarks/dinov2_online_speed.py --model /tmp/held46/dinov2-focus --batch 8 --image 112 --rounds 8
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_engines import export  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    import onnxruntime as ort
    import transformers as tf

    import normswap

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a Dinov2Model directory")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = tf.Dinov2Model.from_pretrained(args.model).eval()
    x = torch.randn(args.batch, 3, args.image, args.image)
    native = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(native, beta_placement="keep")
        online = copy.deepcopy(native)
        normswap.rotate(online, "none", online=True)
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    feed = {"pixel_values": x.numpy()}
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {}
        for name, m in (("original", model), ("native", native), ("online", online)):
            path = Path(tmp) / f"{name}.onnx"
            export(m, x, path)
            sessions[name] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

        def seconds(name: str, reps: int = 5) -> float:
            t0 = time.perf_counter()
            for _ in range(reps):
                sessions[name].run(None, feed)
            return (time.perf_counter() - t0) / reps

        for name in sessions:  # warm-up
            seconds(name, 2)
        ratios: dict[str, list[float]] = {"online": [], "native": [], "original (A/A)": []}
        for _ in range(args.rounds):
            a1, b1, c1, a2 = seconds("original"), seconds("online"), seconds("native"), seconds("original")
            c2, b2, a3 = seconds("native"), seconds("online"), seconds("original")
            ratios["online"].append((b1 + b2) / (a1 + a2))
            ratios["native"].append((c1 + c2) / (a2 + a3))
            ratios["original (A/A)"].append(a3 / a1)
    for name, r in ratios.items():
        print(f"{name}: median {statistics.median(r):.3f}, range {min(r):.3f}-{max(r):.3f}", flush=True)
    return ratios


if __name__ == "__main__":
    main()
