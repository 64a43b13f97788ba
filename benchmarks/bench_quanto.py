"""A held-out quantization engine: optimum-quanto on a real vision checkpoint and what ``normswap convert``
wrote for it.

optimum-quanto (Hugging Face's PyTorch quantization library) swaps a model's ``nn.Linear`` for its
``QLinear`` (and ``nn.LayerNorm`` for ``QLayerNorm`` when activations are quantized) and runs on CPU. It
was not among the engines issue 40 names (ONNX Runtime, CTranslate2, torchao; OpenVINO came as the first
held-out one), so it checks the conversion's quantization behaviour on an engine nobody tuned for.
Settings (``--quantizers``):

* ``w8``: ``quantize(model, weights=qint8)``: int8 weights, one scale per output channel, float activations;
* ``w4``: ``weights=qint4``: 4-bit weights in groups along the input (quanto's default group size, 128);
* ``w8a8``: ``weights=qint8, activations=qint8``, calibrated (``Calibration()``, quanto's running absmax)
  on crops of other photographs than the held-out ones; every Linear's input and output, and each
  LayerNorm's output, on a per-tensor int8 grid.

Variants: ``original`` (transformers' ``AutoModel``), and each directory passed as ``NAME=DIR`` (native
outputs through ``normswap.load``, compat ones through ``AutoModel``). The error is ``1 − cos`` against the
float32 original per image (CLS token, and the mean over every token), and the ratio to the original's
in the same setting with a 95% paired bootstrap interval over images (``bench_quant_engines.ci_table``).

    PYTHONPATH=QUANTO_DIR:$PWD python benchmarks/bench_quanto.py ORIGINAL_DIR native=CONVERTED_DIR \\
        --photos SKIMAGE/data --image 112 --images 256 --json quanto.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_engines import Outputs, ci_table, per_image, table, weight_ranges  # noqa: E402
from heldout_exactness import load  # noqa: E402

QUANTIZERS = ("fp32", "w8", "w4", "w8a8")


def quantized(model: torch.nn.Module, how: str, calib: torch.Tensor) -> torch.nn.Module:
    """A quantized copy of ``model`` in quanto's setting ``how`` (frozen: integer weights stored)."""
    from optimum import quanto

    if how == "fp32":
        return model
    q = copy.deepcopy(model)
    weights = quanto.qint4 if how == "w4" else quanto.qint8
    activations = quanto.qint8 if how == "w8a8" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quanto.quantize(q, weights=weights, activations=activations)
        if activations is not None:
            with torch.no_grad(), quanto.Calibration():
                for i in range(0, len(calib), 8):
                    q(pixel_values=calib[i:i + 8])
        quanto.freeze(q)
    return q.eval()


def run(model: torch.nn.Module, px: torch.Tensor, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    pooled, tokens = [], []
    with torch.no_grad():
        for i in range(0, len(px), batch):
            p, t = Outputs(model)(px[i:i + batch])
            pooled.append(p.float())
            tokens.append(t.float())
    return torch.cat(pooled), torch.cat(tokens)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("original", type=Path)
    ap.add_argument("variants", nargs="+", help="NAME=DIR: normswap convert outputs (native or compat)")
    ap.add_argument("--photos", type=Path, required=True)
    ap.add_argument("--calib-photos", default="motorcycle_right.png,gravel.png,brick.png")
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--quantizers", nargs="+", default=list(QUANTIZERS), choices=QUANTIZERS)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from optimum import quanto  # fail early, with the import error, when quanto is not on the path
    from photo_crops import photo_crops, photographs

    torch.set_num_threads(1)
    held_out = args.calib_photos.split(",")
    px = photo_crops(args.photos, args.images, args.image, seed=1, exclude=held_out)
    calib = photo_crops(n=args.calib, size=args.image, seed=2,
                        files=[p for p in photographs(args.photos) if p.name in held_out])
    original = load(args.original)
    ref_pool, ref_tok = run(original, px)
    dirs = {"original": args.original} | dict(v.split("=", 1) for v in args.variants)
    result: dict[str, Any] = {"model": f"{args.original.name}, {args.image} px, optimum-quanto "
                              f"{getattr(quanto, '__version__', '?')}", "images": len(px), "rows": {}}
    for name, path in dirs.items():
        t0 = time.perf_counter()
        model = original if name == "original" else load(Path(path))
        row: dict[str, Any] = {"note": str(path), "weights": weight_ranges(model), "errors": {}, "per_image": {}}
        for how in args.quantizers:
            pool, tok = run(quantized(model, how, calib), px)
            row["errors"][how] = {"cls": float(per_image(ref_pool, pool).mean()),
                                  "tok": float(per_image(ref_tok, tok).mean())}
            row["per_image"][how] = {"cls": per_image(ref_pool, pool).tolist(), "tok": per_image(ref_tok, tok).tolist()}
            print(f"{name:12s} {how:5s} cls {row['errors'][how]['cls']:.3e} tok {row['errors'][how]['tok']:.3e}",
                  flush=True)
        row["seconds"] = time.perf_counter() - t0
        result["rows"][name] = row
    print(table(result, "tok") + "\n\n" + table(result, "cls"))
    if len(dirs) > 1:
        print("\n" + ci_table([result], "tok") + "\n\n" + ci_table([result], "cls"))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
