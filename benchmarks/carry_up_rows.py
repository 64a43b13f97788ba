"""Which rounding of the mean carry costs the error in ONNX Runtime's per-tensor dynamic int8 (round 65; torch replica).

Every ``Linear`` but those matching ``--exclude`` gets its weight on ONNX Runtime's per-tensor (or, with ``pc``,
per-row) grid (``carry_gain_grids.ort_u8`` / ``ort_s8``: ``compute_scale_zp`` as ONNX Runtime computes it) and its
input on a dynamic uint8 grid (``carry_sources.quant_act``); error = 1 − cosine of the mean-pooled embedding
against the float32 original, ratio to the original's in the same replica with a 95% paired bootstrap over texts.
Variants: ``default`` (``normswap.patch``, β kept: what ``normswap convert`` writes, with the imported code's
carry scale); ``carryupfloat`` (the default, the carry's ``up`` rows kept float after the rest of ``up`` is
rounded on the whole tensor's grid); ``s=FILE`` (the default with each carry's scale replaced by a JSON list).

    python benchmarks/carry_up_rows.py --model DIR --texts 64 --grid u8 --exclude 'layer\\.\\d+\\.output\\.dense' \\
        --variants default carryupfloat
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_encoders import bootstrap, embed_torch  # noqa: E402
from carry_gain_grids import ort_s8, ort_u8  # noqa: E402
from carry_sources import encoder_and_texts, quant_act  # noqa: E402


def fake_quantized(model: torch.nn.Module, carries: list, grid: str, exclude: str | None,
                   float_carry_up: bool = False) -> torch.nn.Module:
    """A copy of ``model`` with the replica's weight and activation rounding (see the module docstring)."""
    m = copy.deepcopy(model)
    by_up = {c.up: c for c in carries}
    for name, mod in m.named_modules():
        if not isinstance(mod, torch.nn.Linear) or (exclude and re.search(exclude, name)):
            continue
        w0 = mod.weight.detach().clone()
        with torch.no_grad():
            mod.weight.copy_((ort_u8 if grid.startswith("u8") else ort_s8)(w0, grid.endswith("pc")))
            c = by_up.get(name)
            if c is not None and float_carry_up:
                mod.weight[c.hidden:] = w0[c.hidden:]
        mod.register_forward_pre_hook(lambda _m, a: (quant_act(a[0]),))
    return m


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--grid", default="u8", choices=("u8", "s8", "u8pc", "s8pc"))
    ap.add_argument("--exclude", help="regex of Linear names left float (e.g. the FFN output projections)")
    ap.add_argument("--variants", nargs="+", default=["default", "carryupfloat"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import normswap
    from normswap.surgery.edits import carried

    original, data, ref = encoder_and_texts(args.model, args.texts)

    def err(m: torch.nn.Module) -> torch.Tensor:
        return (1 - (ref * embed_torch(m, data)).sum(-1)).clamp(min=0).numpy()

    base = err(fake_quantized(original, [], args.grid, args.exclude))
    print(f"original {base.mean():.3e}", flush=True)
    conv = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        carries = normswap.patch(conv, tokenizer=str(args.model), beta_placement="keep").plan.mean_carries
    result = {"model": str(args.model), "texts": args.texts, "grid": args.grid, "exclude": args.exclude,
              "scales": [c.scale for c in carries], "cells": {"original": float(base.mean())}}
    for v in args.variants:
        if v.startswith("s="):
            m, cs = copy.deepcopy(conv), []
            for c, s in zip(carries, json.loads(Path(v[2:]).read_text()), strict=True):
                c2 = copy.copy(c)
                c2.scale = s
                cs.append(c2)
                up, dn = m.get_submodule(c.up), m.get_submodule(c.down)
                with torch.no_grad():
                    up.weight.copy_(carried(up.weight[:c.hidden].detach().clone(), c2, "up.weight"))
                    dn.weight.copy_(carried(dn.weight[:, :c.hidden].detach().clone(), c2, "down.weight"))
            e = err(fake_quantized(m, cs, args.grid, args.exclude))
        else:
            e = err(fake_quantized(conv, carries, args.grid, args.exclude, v == "carryupfloat"))
        lo, hi = bootstrap(e, base)
        result["cells"][v] = {"error": float(e.mean()), "ratio": float(e.mean() / base.mean()), "ci": [lo, hi]}
        print(f"{v}: {e.mean():.3e} ratio {e.mean() / base.mean():.3f} ({lo:.3f}-{hi:.3f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
