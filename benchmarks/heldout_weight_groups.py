"""Which weights cost a converted model its per-channel weight quantization: one group of Linears at a time.

Weight-only int8 with one scale per output channel (optimum-quanto's ``qint8`` weights, simulated here:
symmetric absmax, round to nearest, activations in float32) quantizes each row of a weight on its own
grid. A centered writer's row ``i`` is ``λ_i W_i − m`` (``m``: the mean row over the λ-scaled rows, LayerScale
kept and rebalanced: ``balance_layer_scale``): on a model whose λ spans decades (DINOv2: 2e-4 to 11) the
rows with a small ``λ_i`` are dominated by ``m`` after centering, so their grid step, taken back through λ,
is ``max|λ_i W_i − m| / 127`` instead of ``λ_i max|W_i| / 127``. This script measures that two ways:

* **groups**: the error (``1 − cos`` against the float32 original, CLS and every token) when only one group
  of weights is quantized: ``writers`` (``attention.o_proj``, ``mlp.fc2``), ``readers`` (q, k, v, ``fc1``),
  ``patch`` (the patch embedding convolution, a writer too), ``all``;
* **noise**: per writer, the noise power that per-row rounding adds to the residual stream,
  ``Σ_i (λ_i · step_i)² · in_features / 12`` (uniform rounding error, unit-RMS inputs), converted over original.

    python benchmarks/heldout_weight_groups.py ORIGINAL_DIR native=CONVERTED_DIR --photos SKIMAGE/data \\
        --image 112 --images 32 --bits 8
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_engines import Outputs, per_image  # noqa: E402
from heldout_exactness import load  # noqa: E402

GROUPS = {"writers": r"\.(o_proj|fc2)$", "readers": r"\.(q_proj|k_proj|v_proj|fc1)$",
          "patch": r"patch_embeddings\.projection$", "linears": r"\.(o_proj|fc2|q_proj|k_proj|v_proj|fc1)$",
          "writers+patch": r"(\.(o_proj|fc2)|patch_embeddings\.projection)$",
          "readers+patch": r"(\.(q_proj|k_proj|v_proj|fc1)|patch_embeddings\.projection)$",
          "all": r"."}


def fake_quant_rows(weight: torch.Tensor, bits: int, group: int = 0, asymmetric: bool = False) -> torch.Tensor:
    """Round-to-nearest with one scale per output channel (row, or conv filter), or per ``group`` inputs of a
    row where the row's length divides into them. Symmetric absmax (quanto's int8), or ``asymmetric``:
    ``2^bits`` levels from the group's min to its max (quanto's int4: affine, a shift per group)."""
    flat = weight.detach().double().reshape(weight.shape[0], -1)
    if group and flat.shape[1] % group == 0:
        flat = flat.reshape(-1, group)
    if asymmetric:
        low, high = flat.amin(1, keepdim=True), flat.amax(1, keepdim=True)
        step = ((high - low) / (2 ** bits - 1)).clamp_min(1e-30)
        out = torch.round((flat - low) / step) * step + low
    else:
        step = flat.abs().amax(1, keepdim=True).clamp_min(1e-30) / (2 ** (bits - 1) - 1)
        out = torch.round(flat / step) * step
    return out.reshape(weight.shape).to(weight.dtype)


def quantized(model: torch.nn.Module, pattern: str, bits: int, group: int = 0,
              asymmetric: bool = False) -> torch.nn.Module:
    q = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in q.named_modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and re.search(pattern, name):
                module.weight.copy_(fake_quant_rows(module.weight, bits, group, asymmetric))
    return q


def layer_scales(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each writer's LayerScale λ (1 where there is none), keyed by the writer's module name."""
    out = {}
    for name, _ in model.named_modules():
        match = re.match(r"(.*encoder\.layer\.\d+)\.(attention\.o_proj|mlp\.fc2)$", name)
        if match:
            scale = "layer_scale1" if "o_proj" in name else "layer_scale2"
            lam = model.get_submodule(f"{match.group(1)}.{scale}").lambda1.detach().double()
            out[name] = lam
    return out


def stream_noise(model: torch.nn.Module, bits: int) -> dict[str, float]:
    """Per writer: ``Σ_i (λ_i · step_i)²`` × ``in_features / 12``: the variance per token that per-row rounding of
    its weight adds to the residual stream for unit-RMS inputs."""
    levels = 2 ** (bits - 1) - 1
    out = {}
    for name, lam in layer_scales(model).items():
        w = model.get_submodule(name).weight.detach().double()
        step = w.abs().amax(1) / levels
        out[name] = float(((lam * step) ** 2).sum() * w.shape[1] / 12)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("original", type=Path)
    ap.add_argument("variants", nargs="+", help="NAME=DIR")
    ap.add_argument("--photos", type=Path, required=True)
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--group", type=int, default=0, help="inputs per scale (0: one scale per row; quanto's int4: 128)")
    ap.add_argument("--asymmetric", action="store_true", help="min/max grid with a shift (quanto's int4)")
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import numpy as np
    from photo_crops import photo_crops

    torch.set_num_threads(1)
    px = photo_crops(args.photos, args.images, args.image, seed=1)
    original = load(args.original)
    with torch.no_grad():
        ref = Outputs(original)(px)
    models = {"original": original} | {n: load(Path(p)) for n, p in (v.split("=", 1) for v in args.variants)}
    errors: dict[str, dict[str, dict[str, list[float]]]] = {}
    for name, model in models.items():
        errors[name] = {}
        for group in args.groups:
            with torch.no_grad():
                out = Outputs(quantized(model, GROUPS[group], args.bits, args.group, args.asymmetric))(px)
            errors[name][group] = {m: per_image(r, o).tolist() for m, r, o in zip(("cls", "tok"), ref, out,
                                                                                   strict=True)}
            print(f"{name:10s} {group:8s} cls {np.mean(errors[name][group]['cls']):.3e} "
                  f"tok {np.mean(errors[name][group]['tok']):.3e}", flush=True)
    rng = np.random.default_rng(0)
    grid = f"groups of {args.group}" if args.group else "per output channel"
    grid += ", asymmetric" if args.asymmetric else ""
    lines = [f"\nint{args.bits} {grid}, weights only; error / original's, 95% interval over "
             f"{len(px)} images", "", "| variant | group | CLS | every token |", "|---|---|---|---|"]
    for name in models:
        if name == "original":
            continue
        for group in args.groups:
            cells = []
            for metric in ("cls", "tok"):
                a, b = np.array(errors[name][group][metric]), np.array(errors["original"][group][metric])
                idx = rng.integers(0, len(a), (2000, len(a)))
                lo, hi = np.percentile(a[idx].mean(1) / b[idx].mean(1), [2.5, 97.5])
                cells.append(f"{a.mean() / b.mean():.2f} ({lo:.2f}-{hi:.2f})")
            lines.append(f"| {name} | {group} | " + " | ".join(cells) + " |")
    base = stream_noise(original, args.bits)
    lines += ["", "stream noise of per-row rounding, converted / original, per writer (median over layers; "
              "worst layer)", "", "| variant | o_proj | fc2 |", "|---|---|---|"]
    for name, model in models.items():
        if name == "original":
            continue
        noise = stream_noise(model, args.bits)
        cells = []
        for kind in ("o_proj", "fc2"):
            ratios = {k: noise[k] / base[k] for k in base if k.endswith(kind)}
            worst = max(ratios, key=ratios.get)
            cells.append(f"{statistics.median(ratios.values()):.2f} (layer {worst.split('.')[2]}: "
                         f"{ratios[worst]:.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    result = {"images": len(px), "image": args.image, "bits": args.bits, "errors": errors,
              "noise": {n: stream_noise(m, args.bits) for n, m in models.items()}}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
