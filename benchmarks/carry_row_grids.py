"""The default's Post-LN cost in per-row int8 weight grids, split by weight group; a two-scale mean carry (r64).

A torch replica of NNCF's ``compress_weights`` default (INT8_ASYM: per output row of every ``Linear`` and per row
of every embedding table, ``[min(w, 0), max(w, 0)]`` in 255 steps of float32 ``scale`` with a whole zero point,
activations float; NNCF's ``calculate_integer_quantization_params`` / ``calculate_quantized_weight``) and, for the
engines that also round activations, of ONNX Runtime's ``quantize_dynamic`` (``benchmarks/carry_sources.py``'s
``quant_weight`` / ``quant_act``: symmetric int8 weights per tensor or per row, every ``Linear`` input on a
dynamic uint8 grid per tensor). Each row rounds one weight group (the rest float) in the original and in each
conversion, and prints the error ratio (1 − cosine of the mean-pooled embedding against the float32 original,
95% paired bootstrap over texts):

* groups: ``all``; ``qkv`` (the attention's query/key/value), ``ao`` (attention output), ``up`` (FFN input, the
  carry's widened rows), ``down`` (FFN output, the carry's columns), ``down-carry`` / ``down-real`` (``down``
  rounded per row as a whole, then only the carry's columns, or only the real ones, kept rounded), ``tables``
  (every ``nn.Embedding``);
* variants: ``original``; ``default`` (``normswap.patch`` with β kept: what ``normswap convert`` writes);
  ``twoscale`` (the default with each carry re-planned by :func:`two_scale`: since round 65 the default's own carry
  at ``--target asym --ratio 16``, other targets and ratios re-planned).

:func:`two_scale` (round 64; the product's carry since round 65, :class:`normswap.analysis.plan.MeanCarry`) is
exact in float: the carry's first pair keeps scale ``s`` but each row's column entry moves to
that row's own INT8_ASYM grid point nearest ``1/s`` (``c1``), and a second pair (the four padding neurons the
width's multiple of 8 leaves zero) with scale ``s2 = s/ratio`` takes the remainder, ``c2 = (1 − c1·s)/s2``, so
``c1·s + c2·s2 = 1`` in every row: per-row rounding keeps ``c1`` and moves ``c2`` by at most half a step, a leak
``ratio`` times smaller than ``1/s`` rounded.

    python benchmarks/carry_row_grids.py --model DIR --texts 256 --grids w8 --groups all qkv ao up down \\
        down-carry down-real tables --variants original default --json split.json
    python benchmarks/carry_row_grids.py --model DIR --texts 128 --grids w8 pt pc --groups all \\
        --variants original default twoscale --ratio 16 --json twoscale.json
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_encoders import bootstrap, embed_torch  # noqa: E402
from carry_sources import encoder_and_texts, quant_act, quant_weight  # noqa: E402

from normswap.analysis.plan import MeanCarry, int8_asym  # noqa: E402
from normswap.surgery.edits import carried  # noqa: E402

GROUPS = ("all", "qkv", "ao", "up", "down", "down-carry", "down-real", "tables",
          # on the ORT grids: ``down``'s weights alone, its input alone, its input with the carry's neurons kept float
          # (the grid still the whole input's), and only the carry's neurons rounded on that grid
          "down-w", "down-act", "down-act-real", "down-act-carry")
# NNCF int8 weights; ORT dynamic int8 per tensor / per channel (uint8 activations)
GRIDS = ("w8", "pt", "pc")
# the conversions (``normswap.patch`` options; every one keeps β, as ``normswap convert`` does): the default, the
# default with the two-scale carry, the default with a centering op before each Post-LN norm the carry does not make
# exact (the attention-output norms: their writers keep the original's rows), and the default with a centering op
# after each writer instead of its centered rows
VARIANTS = {"default": {}, "twoscale": {}, "pnc": {"per_norm_centering": True}, "wop": {"writer_centering": "op"},
            "pnc-twoscale": {"per_norm_centering": True}}


# NNCF's INT8_ASYM per row, dequantized: the product's (the carry's first entries sit on its grid since round 65)
nncf_int8_asym = int8_asym


def group_of(name: str, module: torch.nn.Module) -> str | None:
    """The weight group of a ``Linear`` / ``Embedding`` in a BERT- or MPNet-layout encoder (None: not rounded)."""
    if isinstance(module, torch.nn.Embedding):
        return "tables"
    if not isinstance(module, torch.nn.Linear) or "pooler" in name:
        return None
    if re.search(r"\.(q|k|v|query|key|value)$", name):
        return "qkv"
    if re.search(r"attention\.(attn\.o|output\.dense)$", name):
        return "ao"
    if name.endswith("intermediate.dense"):
        return "up"
    if re.search(r"layer\.\d+\.output\.dense$", name):
        return "down"
    return None


def quantized(model: torch.nn.Module, carries: list[Any], grid: str, group: str) -> torch.nn.Module:
    """A fake-quantized copy of ``model``: ``group``'s weights rounded on ``grid`` (the rest float); on the ORT
    grids every rounded ``Linear``'s input is rounded to uint8 too (``Embedding`` tables only under ``w8``)."""
    m = copy.deepcopy(model)
    wide = {c.down: c for c in carries}
    for name, mod in m.named_modules():
        g = group_of(name, mod)
        if g is None or (group != "all" and g != group.split("-")[0]):
            continue
        if grid != "w8" and g == "tables":
            continue
        w0 = mod.weight.detach().clone()
        c = wide.get(name)
        with torch.no_grad():
            if not group.startswith("down-act"):
                mod.weight.copy_(nncf_int8_asym(w0) if grid == "w8" else quant_weight(w0, grid == "pc"))
            if group in ("down-carry", "down-real"):
                carry = slice(c.hidden, c.hidden + c.added) if c is not None else slice(0, 0)
                if group == "down-carry":  # only the carry's columns keep their rounding
                    keep = mod.weight[:, carry].clone()
                    mod.weight.copy_(w0)
                    mod.weight[:, carry] = keep
                else:
                    mod.weight[:, carry] = w0[:, carry]
        if grid != "w8" and isinstance(mod, torch.nn.Linear) and group != "down-w":
            carry = slice(c.hidden, c.hidden + c.added) if c is not None else slice(0, 0)

            def hook(_m: torch.nn.Module, args: tuple, carry: slice = carry) -> tuple:
                q = quant_act(args[0])
                if group == "down-act-real":
                    q[..., carry] = args[0][..., carry]
                elif group == "down-act-carry":
                    q, q[..., carry] = args[0].clone(), q[..., carry]
                return (q,)

            mod.register_forward_pre_hook(hook)
    return m


def row_entries(w: torch.Tensor, n: int, s: float, ratio: float, target: str) -> torch.Tensor:
    """Each row's first-pair column entry ``c1`` near ``1/s`` for :func:`two_scale` (float32, ``[d]``), from the
    row's real columns ``w[:, :n]``:

    * ``asym``: the nearest point of the row's INT8_ASYM grid (NNCF's int8 weights: multiples of
      ``(max(w,0) − min(w,0))/255``);
    * ``sym``: the nearest point of the row's symmetric per-channel grid (multiples of ``max|w|/127``: ONNX
      Runtime's per-channel dynamic int8, NNCF's static int8 weights);
    * ``asym-in``: ``asym``, but no further out than the row's range on both signs (rows whose range does not
      hold ``±1/s`` take the grid point inside it; :func:`two_scale` then lowers the carry's ratio until the second
      pair fits those rows' ranges too);
    * ``multi``: a whole number of ``down``'s per-tensor steps (``max|w|/127`` over the tensor: ONNX Runtime's
      per-tensor default), chosen within the window the second pair can take up (``|1/s − c1| ≤ 0.9·min(max(w),
      −min(w))/ratio`` per row) as the one furthest inside both per-row grids (smallest worst distance, in each
      grid's own steps).
    """
    real = w[:, :n].float()
    lo = torch.clamp(real.amin(1), max=0)
    hi = torch.clamp(real.amax(1), min=0)
    a_step = (hi - lo) / 255
    s_step = real.abs().amax(1) / 127
    inv = torch.tensor(1.0 / s, dtype=torch.float32)
    if target == "asym":  # the product's (MeanCarry.columns)
        return MeanCarry.columns(real, s, ratio)[0].float()
    if target == "asym-in":  # and inside the row's range on both signs (else it would set the range)
        room = torch.minimum(hi, -lo)
        return torch.minimum(torch.round(inv / a_step), torch.floor(room / a_step)) * a_step
    if target == "sym":
        return torch.round(inv / s_step) * s_step
    pt = float(real.abs().max()) / 127
    window = 0.9 * torch.minimum(hi, -lo) / ratio
    out = torch.empty_like(hi)
    for i in range(real.shape[0]):
        n_lo = max(1, int(np.ceil((1.0 / s - float(window[i])) / pt)))
        n_hi = max(n_lo, int(np.floor((1.0 / s + float(window[i])) / pt)))
        cand = torch.arange(n_lo, n_hi + 1, dtype=torch.float32) * pt
        da = (cand / a_step[i] - torch.round(cand / a_step[i])).abs()
        ds = (cand / s_step[i] - torch.round(cand / s_step[i])).abs()
        out[i] = cand[torch.argmin(torch.maximum(da, ds))]
    return out


def two_scale(model: torch.nn.Module, carries: list[Any], ratio: float, target: str = "asym") -> list[str]:
    """Re-plan each carry of ``model`` (converted, float) as two pairs of pairs; see the module docstring and
    :func:`row_entries` (``target``: which grid the first pair's entries sit on). Since round 65 the product's
    default carry *is* the ``asym`` one at ``ratio`` 16 (:class:`normswap.analysis.plan.MeanCarry`, written by
    ``normswap.surgery.edits.carried``): there the model is left as the product wrote it (the lines report its
    entries); other targets and ratios rewrite the first pairs' columns and the second pairs (neurons 4-7 of the
    carry's eight). Returns one line per carry."""
    lines = []
    for c in carries:
        if c.added < 8:
            raise ValueError(f"{c.down}: {c.added} added neurons, the two-scale carry needs 8")
        up, down = model.get_submodule(c.up), model.get_submodule(c.down)
        n, d, s = c.hidden, c.features, float(c.scale)
        w = down.weight.detach().float()
        real = w[:, :n]
        lo = torch.clamp(real.amin(1), max=0)
        hi = torch.clamp(real.amax(1), min=0)
        c1 = row_entries(w, n, s, ratio, target)
        if target == "asym-in":  # the largest ratio (at most the one asked) whose c2 fits every row's range
            gap = (1.0 / s - c1.double()).abs().clamp(min=1e-30)
            ratio = max(1.0, min(ratio, float((0.95 * torch.minimum(hi, -lo).double() / gap).min())))
        s2 = s / ratio
        c2 = (1 - c1.double() * s) / s2
        product = target == "asym" and ratio == MeanCarry.SECOND_RATIO and MeanCarry.NEURONS == 8
        if product:  # the product's own carry: what carried() writes from these rows
            _, c2 = MeanCarry.columns(real, s)
            expected = carried(down.weight.detach()[:, :n], c, "down.weight")[:, n:n + 8]
            if not torch.equal(expected, down.weight.detach()[:, n:n + 8]):
                raise ValueError(f"{c.down}: the carry is not the product's two-scale one (converted by older code?)")
        else:
            with torch.no_grad():
                for pair, first in enumerate((0, 1)):
                    up.weight[n + 4 + 2 * pair] = 0
                    up.weight[n + 4 + 2 * pair + 1] = 0
                    up.weight[n + 4 + 2 * pair, first::2] = s2 / d
                    up.weight[n + 4 + 2 * pair + 1, first::2] = -s2 / d
                    if up.bias is not None:
                        up.bias[n + 4 + 2 * pair: n + 4 + 2 * pair + 2] = 0
                    down.weight[:, n + 2 * pair] = -c1.to(down.weight.dtype)
                    down.weight[:, n + 2 * pair + 1] = c1.to(down.weight.dtype)
                    down.weight[:, n + 4 + 2 * pair] = -c2.to(down.weight.dtype)
                    down.weight[:, n + 4 + 2 * pair + 1] = c2.to(down.weight.dtype)
        inside = int(((c1 <= hi) & (-c1 >= lo) & (c2.abs().float() <= torch.minimum(hi, -lo))).sum())
        moved = float((c1.double() * s - 1).abs().max())
        lines.append(f"{c.down}: s {s:.3f}, s2 {s2:.4f} (s/s2 {ratio:.1f}), |c1·s − 1| at most {moved:.3f}, "
                     f"carry entries inside the row's range in {inside}/{len(c1)} rows"
                     + (" (the product's carry, unchanged)" if product else ""))
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--grids", nargs="+", default=["w8"], choices=GRIDS)
    ap.add_argument("--groups", nargs="+", default=["all"], choices=GROUPS)
    ap.add_argument("--variants", nargs="+", default=["original", "default"],
                    choices=("original", *VARIANTS))
    ap.add_argument("--ratio", type=float, default=16.0, help="twoscale: s/s2")
    ap.add_argument("--target", default="asym", choices=("asym", "asym-in", "sym", "multi"),
                    help="twoscale: the grid the "
                    "first pair's entries sit on (row_entries)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import normswap

    original, data, ref = encoder_and_texts(args.model, args.texts)
    models: dict[str, tuple[torch.nn.Module, list[Any]]] = {"original": (original, [])}
    result: dict[str, Any] = {"model": str(args.model), "texts": args.texts, "ratio": args.ratio,
                              "target": args.target, "notes": {},
                              "cells": {}, "per_text": {}}
    for name in args.variants:
        if name == "original":
            continue
        model = copy.deepcopy(original)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = normswap.patch(model, tokenizer=str(args.model), beta_placement="keep", **VARIANTS[name])
        carries = report.plan.mean_carries
        result["notes"].setdefault(name, []).append(report.plan.summary())
        if name.endswith("twoscale"):
            result["notes"][name] += two_scale(model, carries, args.ratio, args.target)
        print("\n".join(result["notes"][name]), flush=True)
        models[name] = (model, carries)
        err = float((1 - (ref * embed_torch(model, data)).sum(-1)).mean())
        print(f"{name}: {len(carries)} carries, float error {err:.2e}", flush=True)
        result["cells"][f"{name}/fp32"] = err

    def errors(model: torch.nn.Module) -> np.ndarray:
        return (1 - (ref * embed_torch(model, data)).sum(-1)).clamp(min=0).numpy()

    t0 = time.time()
    print("| grid | rounded group | original | " + " | ".join(v for v in args.variants if v != "original")
          + " |\n|---|---|---|" + "---|" * (len(args.variants) - 1), flush=True)
    for grid in args.grids:
        for group in args.groups:
            base_group = "down" if group.startswith("down-") else group
            if grid != "w8" and group == "tables":
                continue
            base = errors(quantized(original, [], grid, base_group))
            result["per_text"][f"original/{grid}/{base_group}"] = base.tolist()
            cells = [f"{base.mean():.3e}"]
            for name, (model, carries) in models.items():
                if name == "original":
                    continue
                e = errors(quantized(model, carries, grid, group))
                lo, hi = bootstrap(e, base)
                result["cells"][f"{name}/{grid}/{group}"] = {"error": float(e.mean()), "base": float(base.mean()),
                                                             "ratio": float(e.mean() / base.mean()), "ci": [lo, hi]}
                result["per_text"][f"{name}/{grid}/{group}"] = e.tolist()
                cells.append(f"{e.mean() / base.mean():.3f} ({lo:.3f}–{hi:.3f})")
            print(f"| {grid} | {group} | " + " | ".join(cells) + f" |  <!-- {time.time() - t0:.0f} s -->", flush=True)
            if args.json:  # after every row: a long run stopped early keeps what it measured
                args.json.write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
