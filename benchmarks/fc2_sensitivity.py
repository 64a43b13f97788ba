"""Why DINOv2-small's centered MLP writers (fc2) cost 1.13× at the output but only 1.05× in rounding energy at the
writer (issue 40, round 55; round 54 left it unexplained).

Hypothesis: the rounding error of the converted rows lands in channels the network downstream amplifies more (the
next norm's γ over the stream's rms, and the layers after it). Test: each layer's fc2 rounding error alone, the
original's rows against the default conversion's, pushed through the *same* network (the original, float64), so
only the rows differ (the round-54 hybrid ``hyb-mlp``: 1.166× in NNCF, LayerNorms kept).

Per layer ``l`` and rows (original ``λ ⊙ W``; converted: ``normswap.patch(beta_placement="keep")``'s fc2 weight and
its λ, centered and balanced), the error at the writer's output on the original's real fc2 inputs ``h``
(``--images`` photograph crops, 112 px; the forwards in ``--dtype``, float32 by default, the errors in float64)
is ``e = λ ⊙ ((Q(W) − W) h)``, ``Q`` NNCF's int8 grid (asymmetric per row, ``int8w_dinov2.fake_rows``). Four
measures of it, each summed over tokens and crops:

* ``energy``: ``‖e‖²`` (round 54's figure, summed over layers: 1.047);
* ``centered``: ``‖e − mean(e)‖²`` (what the next LayerNorm passes on);
* ``norm-out``: the error at the next LayerNorm's output to first order, ``γ ⊙ (c(e) − x̂ (x̂ᵀ c(e)) / d) / σ``
  (``x`` the stream there, ``x̂`` its normalised value, ``σ`` its standard deviation): the next norm's γ and the
  stream's scale, the hypothesis's weighting;
* ``output``: ``1 − cos`` of every output token against the float model with only this error added (a forward hook
  after layer ``l``'s LayerScale): everything downstream.

And ``output`` with every layer's error at once. Prints per layer and summed: converted / original for each.

``--draws K``: K exact re-roundings of the original's fc2 rows, all layers at once, as a null for that last figure:
each layer's rows ``λ_i W_i`` shifted by one shared random vector ``v`` (``row_i + v``: the same shift every row
gets from a centering, ``v = −m``, which the next LayerNorm removes), ``v`` uniform in ±1 per-row step (the
layer's median ``(max − min) / 255``): the same function, each row rounded anew. ``--draws-only``: those and the
original alone (no conversion, no per-layer figures). ``--paired``: each draw also for the centered rows
``row_i − m + v`` (the default conversion's fc2 rows up to a per-row scale, which a per-row grid ignores; ``v = 0``
is the shipped pair), so centered and original rows are compared over the same re-roundings.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/fc2_sensitivity.py DINOV2_SMALL --photos PHOTOS --images 72 \\
        --json fc2_sensitivity.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def next_norm(model: torch.nn.Module, i: int) -> torch.nn.Module:
    layers = model.encoder.layer
    return layers[i + 1].norm1 if i + 1 < len(layers) else model.layernorm


def drawn_rows(layer: torch.nn.Module, gen: torch.Generator | None, centered: bool = False) -> torch.Tensor:
    """A DINOv2 layer's fc2 rows with λ folded (``λ_i W_i``, float64), shifted by one shared vector ``v``: uniform
    in ±1 step of the original rows' int8 grid (the median ``(max − min) / 255`` over them); ``gen`` ``None``:
    ``v = 0``. With ``centered``, minus the mean row first (the default conversion's rows up to a per-row scale).
    Every such shift adds ``(vᵀh)·1`` to the stream, which the next LayerNorm removes: in the original's network
    the function is unchanged and only the rounding differs (an exact re-rounding)."""
    rows = layer.mlp.fc2.weight.detach().double() * layer.layer_scale2.lambda1.detach().double()[:, None]
    step = float(((rows.amax(1) - rows.amin(1)) / 255).median())  # the original rows' grid, for both kinds
    if centered:
        rows = rows - rows.mean(0)
    if gen is None:
        return rows
    return rows + step * (2 * torch.rand(rows.shape[1], generator=gen, dtype=torch.float64) - 1)


@torch.no_grad()
def output_error(model: torch.nn.Module, px: torch.Tensor, ref: torch.Tensor,
                 errors: dict[int, torch.Tensor]) -> torch.Tensor:
    """``1 − cos`` per (crop, token) of ``model`` with ``errors[l]`` added after layer ``l``'s ``layer_scale2``."""
    hooks = [model.encoder.layer[i].layer_scale2.register_forward_hook(lambda _m, _a, out, e=e: out + e.to(out.dtype))
             for i, e in errors.items()]
    try:
        out = model(pixel_values=px).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
    return 1 - torch.nn.functional.cosine_similarity(out.double(), ref.double(), dim=-1)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--photos", type=Path, required=True)
    ap.add_argument("--images", type=int, default=72)
    ap.add_argument("--calib-photos", default="motorcycle_right.png,gravel.png,brick.png")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                    help="the network's forwards (the errors themselves are computed in float64)")
    ap.add_argument("--draws", type=int, default=0, help="re-roundings of the original's rows (a null)")
    ap.add_argument("--draws-only", action="store_true")
    ap.add_argument("--paired", action="store_true", help="the draws for the centered rows too")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import transformers as tf
    from int8w_dinov2 import fake_rows
    from photo_crops import photo_crops

    import normswap

    torch.set_num_threads(1)
    original = tf.Dinov2Model.from_pretrained(args.model).eval()
    native = copy.deepcopy(original)
    if not args.draws_only:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            normswap.patch(native, beta_placement="keep")
    dtype = getattr(torch, args.dtype)
    original = original.to(dtype)
    px = photo_crops(args.photos, args.images, 112, seed=1, exclude=args.calib_photos.split(",")).to(dtype)
    layers = original.config.num_hidden_layers
    fc2_in: dict[int, torch.Tensor] = {}
    norm_in: dict[int, torch.Tensor] = {}
    hooks = [original.encoder.layer[i].mlp.fc2.register_forward_pre_hook(
        lambda _m, a, i=i: fc2_in.__setitem__(i, a[0].double())) for i in range(layers)]
    hooks += [next_norm(original, i).register_forward_pre_hook(lambda _m, a, i=i: norm_in.__setitem__(i, a[0].double()))
              for i in range(layers)]
    with torch.no_grad():
        ref = original(pixel_values=px).last_hidden_state
    for h in hooks:
        h.remove()
    errs: dict[str, dict[int, torch.Tensor]] = {"original": {}, "converted": {}}
    rows: list[dict[str, Any]] = []
    for i in range(0 if args.draws_only else layers):
        row: dict[str, Any] = {"layer": i}
        x = norm_in[i]
        mu, sigma = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True).add(1e-6).sqrt()
        xhat = (x - mu) / sigma
        gamma = next_norm(original, i).weight.detach().double()
        for name, model in (("original", original), ("converted", native)):
            layer = model.encoder.layer[i]
            w = layer.mlp.fc2.weight.detach().double()
            lam = layer.layer_scale2.lambda1.detach().double()
            e = (fc2_in[i] @ (fake_rows(w, False).double() - w).T) * lam
            errs[name][i] = e
            ce = e - e.mean(-1, keepdim=True)
            d = e.shape[-1]
            dn = gamma * (ce - xhat * (xhat * ce).sum(-1, keepdim=True) / d) / sigma
            row[name] = {"energy": float(e.pow(2).sum()), "centered": float(ce.pow(2).sum()),
                         "norm-out": float(dn.pow(2).sum()),
                         "output": float(output_error(original, px, ref, {i: e}).sum())}
        rows.append(row)
        r = {k: row["converted"][k] / row["original"][k] for k in row["original"]}
        print(f"layer {i:2d}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()) +
              f"  (original output share {row['original']['output']:.3e})", flush=True)
    if args.draws_only:
        del errs["converted"]
        for i in range(layers):
            w = original.encoder.layer[i].mlp.fc2.weight.detach().double()
            errs["original"][i] = (fc2_in[i] @ (fake_rows(w, False).double() - w).T) * \
                original.encoder.layer[i].layer_scale2.lambda1.detach().double()
    for k in range(-1 if args.paired else 0, args.draws):
        gen = torch.Generator().manual_seed(k)
        for centered in (False, True) if args.paired else (False,):
            name = ("centered-" if centered else "") + f"draw-{k}"
            errs[name] = {}
            for i in range(layers):
                layer = original.encoder.layer[i]
                shifted = drawn_rows(layer, gen if k >= 0 else None, centered)
                errs[name][i] = fc2_in[i] @ (fake_rows(shifted, False).double() - shifted).T
            gen = torch.Generator().manual_seed(k)  # the same v for the centered rows
    per_image = {name: output_error(original, px, ref, errs[name]).mean(-1).tolist() for name in errs}
    together = {name: float(sum(v)) for name, v in per_image.items()}
    summed: dict[str, float] = {}
    if rows:
        summed = {k: sum(r["converted"][k] for r in rows) / sum(r["original"][k] for r in rows)
                  for k in rows[0]["original"]}
        summed["output, all layers at once"] = together["converted"] / together["original"]
        print("summed over layers, converted / original: " + ", ".join(f"{k} {v:.3f}" for k, v in summed.items()))
        for name in ("original", "converted"):
            singles = sum(r[name]["output"] for r in rows) / ref.shape[1]  # per-image means, summed
            print(f"{name}: all layers at once / sum of single layers {together[name] / singles:.3f}")
    for name in errs:
        if "draw-" in name:
            print(f"{name} / original, all layers at once: {together[name] / together['original']:.3f}")
    if args.paired:
        keys = [k for k in together if k.startswith("draw-") and k != "draw--1"]
        ratios = [together["centered-" + k] / together[k] for k in keys]
        mean_c = sum(together["centered-" + k] for k in keys) / len(keys)
        mean_o = sum(together[k] for k in keys) / len(keys)
        print(f"paired over {len(keys)} draws: centered / original per draw {min(ratios):.3f}-{max(ratios):.3f}, "
              f"of the means {mean_c / mean_o:.3f}; the shipped pair (v = 0) "
              f"{together['centered-draw--1'] / together['draw--1']:.3f}")
    result = {"images": len(px), "rows": rows, "summed": summed, "together": together, "per_image": per_image}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
