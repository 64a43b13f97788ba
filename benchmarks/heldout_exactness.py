"""Exactness of ``normswap convert``'s output on real inputs: a held-out check of a real vision checkpoint.

``normswap convert`` verifies on its own generated inputs; this measures the written checkpoint against
the original on crops of real photographs (``photo_crops.py``), in float64 (the math: both models cast
to float64, so only the conversion's own error remains) and in float32 (as deployed; the original's own
float32 error against its float64 self is printed beside it as the floor). Either format loads: native
through ``normswap.load``, compat through transformers' ``AutoModel``.

    python benchmarks/heldout_exactness.py ORIGINAL_DIR CONVERTED_DIR --photos SKIMAGE/data --images 32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def rel(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Relative RMS error of ``out`` against ``ref`` (over every element)."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def compare(original: torch.nn.Module, converted: torch.nn.Module, px: torch.Tensor, batch: int = 8) -> dict[str, Any]:
    """Errors of ``converted`` against ``original`` on ``px``: float64 and float32 ``last_hidden_state``,
    worst token, and ``1 − cos`` of the CLS token."""
    outs: dict[str, list[torch.Tensor]] = {k: [] for k in ("ref64", "conv64", "ref32", "conv32")}
    with torch.no_grad():
        for dtype, tag in ((torch.float64, "64"), (torch.float32, "32")):
            o, c = original.to(dtype), converted.to(dtype)
            for i in range(0, len(px), batch):
                x = px[i:i + batch].to(dtype)
                outs["ref" + tag].append(o(pixel_values=x).last_hidden_state)
                outs["conv" + tag].append(c(pixel_values=x).last_hidden_state)
    t = {k: torch.cat(v) for k, v in outs.items()}
    token_err = (t["conv64"] - t["ref64"]).norm(dim=-1) / t["ref64"].norm(dim=-1)
    cls = torch.nn.functional.cosine_similarity(t["ref64"][:, 0], t["conv32"][:, 0].double(), dim=-1)
    return {"inputs": len(px), "float64_rel": rel(t["ref64"], t["conv64"]),
            "float64_worst_token": float(token_err.max()),
            "float32_rel": rel(t["ref64"], t["conv32"]), "original_float32_rel": rel(t["ref64"], t["ref32"]),
            "cls_one_minus_cos_float32": float((1 - cls).mean())}


def load(path: Path) -> torch.nn.Module:
    import transformers as tf

    import normswap

    config = json.loads((path / "config.json").read_text())
    model = normswap.load(str(path)) if "normswap" in config else tf.AutoModel.from_pretrained(path)
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("original", type=Path)
    ap.add_argument("converted", type=Path, nargs="+")
    ap.add_argument("--photos", type=Path, required=True)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from photo_crops import photo_crops

    torch.set_num_threads(1)
    px = photo_crops(args.photos, args.images, args.size, seed=3)
    result = {}
    for path in args.converted:
        row = compare(load(args.original), load(path), px)
        result[str(path)] = row
        print(f"{path}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
