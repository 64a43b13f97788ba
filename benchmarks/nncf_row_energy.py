"""Where the default conversion's NNCF int8 rounding error goes, writer by writer (issue 40, round 54).

For each LayerScale writer of a real DINOv2 (``o_proj``, ``fc2``), the original's rows ``diag(λ)·W`` and the default
conversion's (centered, balanced back into λ) are rounded on NNCF's int8 grid (asymmetric per row, float32 here:
``int8w_dinov2.fake_rows``) and the error ``E`` (λ applied) is weighted by the writer's real inputs ``h`` (the
original's, on ``--images`` photograph crops): ``tr(E S Eᵀ)`` with ``S = E[h hᵀ]`` is the rounding energy at the
writer's output, and ``1ᵀ E S Eᵀ 1 / d`` its mean's part (what an RMSNorm passes on and a LayerNorm removes; ``1/d``
of the total for errors with no common part). Prints per writer: converted / original energy, and each one's mean
share.

    PYTHONPATH=$PWD python benchmarks/nncf_row_energy.py DINOV2_SMALL --photos PHOTOS --images 72
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PAIRS = (("attention.o_proj", "layer_scale1"), ("mlp.fc2", "layer_scale2"))


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--photos", type=Path, required=True)
    ap.add_argument("--images", type=int, default=72)
    ap.add_argument("--calib-photos", default="motorcycle_right.png,gravel.png,brick.png")
    args = ap.parse_args(argv)
    import transformers as tf
    from int8w_dinov2 import fake_rows
    from photo_crops import photo_crops

    import normswap

    torch.set_num_threads(1)
    original = tf.Dinov2Model.from_pretrained(args.model).eval()
    native = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(native, beta_placement="keep")
    px = photo_crops(args.photos, args.images, 112, seed=1, exclude=args.calib_photos.split(","))
    inputs: dict[tuple[int, str], list[torch.Tensor]] = {}
    hooks = [layer.get_submodule(lin).register_forward_pre_hook(
        lambda _m, a, key=(i, lin): inputs.setdefault(key, []).append(a[0].reshape(-1, a[0].shape[-1]).double()))
        for i, layer in enumerate(original.encoder.layer) for lin, _ in PAIRS]
    with torch.no_grad():
        original(pixel_values=px)
    for h in hooks:
        h.remove()
    totals: dict[str, list[float]] = {lin: [0.0, 0.0] for lin, _ in PAIRS}
    print("| writer | converted / original energy | mean share, original | mean share, converted |")
    print("|---|---|---|---|")
    for (i, lin), hs in inputs.items():
        h = torch.cat(hs)
        s = h.T @ h / len(h)
        scale = dict(PAIRS)[lin]
        shares, energy = [], []
        for model in (original, native):
            layer = model.encoder.layer[i]
            w = layer.get_submodule(lin).weight.detach().double()
            e = (fake_rows(w, False) - w) * layer.get_submodule(scale).lambda1.detach().double()[:, None]
            tot = float(torch.trace(e @ s @ e.T))
            one = torch.ones(e.shape[0], dtype=torch.float64)
            energy.append(tot)
            shares.append(float(one @ e @ s @ e.T @ one) / e.shape[0] / tot)
        totals[lin][0] += energy[0]
        totals[lin][1] += energy[1]
        print(f"| layer {i} {lin} | {energy[1] / energy[0]:.3f} | {shares[0]:.4f} | {shares[1]:.4f} |")
    for lin, (o, c) in totals.items():
        print(f"{lin}: summed over the layers, converted / original {c / o:.3f}")
    return totals


if __name__ == "__main__":
    main()
