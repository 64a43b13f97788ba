"""Which rounding of the mean carry costs a converted Post-LN encoder its int8 accuracy (a markdown table).

A float64-free, torch-only replica of ONNX Runtime's ``quantize_dynamic`` (symmetric int8 weights per tensor
or per output channel, every MatMul input rounded to a dynamic asymmetric uint8 grid per tensor) runs the
original and the converted model on the same texts. The converted model's carry (two neurons per widened
MLP, :class:`normswap.analysis.plan.MeanCarry`) meets three roundings: its ``up`` rows ``±s/d`` on ``up``'s
grid, its ``down`` columns ``∓1/s`` on ``down``'s grid, and its two activations on the intermediate's uint8
grid. Each row of the table keeps some of them in float (the rest of the model quantized as usual) and
reports the error ratio to the original's (1 − cosine of the mean-pooled embedding, against the float32
original): how much of the converted model's excess each source, and each layer's carry, explains.
``--construction`` rewrites the carries after converting (``CONSTRUCTIONS``: the carry before it was widened,
rescaled ones, range-setting spare neurons); every one is exact in float (the printed float error).

    python benchmarks/carry_sources.py --model /tmp/carry40/mpnet --texts 64 --grids pc --per-layer
    python benchmarks/carry_sources.py --model /tmp/carry40/mpnet --texts 64 --grids w8 --per-layer  # NNCF int8 weights
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_encoders import batches, bootstrap, embed_torch, english  # noqa: E402

SOURCES = ("up", "down", "act")


def quant_weight(w: torch.Tensor, per_channel: bool, asymmetric: bool = False) -> torch.Tensor:
    """Symmetric int8, step ``max|w|/127`` per tensor or per output row (ORT's ``quantize_dynamic``); with
    ``asymmetric``, per output row on ``[min, max]`` in 255 steps with a whole zero point (NNCF's
    ``compress_weights`` default, INT8_ASYM)."""
    if asymmetric:
        lo = torch.clamp(w.amin(dim=1, keepdim=True), max=0)
        hi = torch.clamp(w.amax(dim=1, keepdim=True), min=0)
        step = torch.clamp((hi - lo) / 255, min=1e-30)
        zero = torch.clamp(torch.round(-lo / step), 0, 255)
        return (torch.clamp(torch.round(w / step) + zero, 0, 255) - zero) * step
    peak = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max()
    step = torch.clamp(peak / 127, min=1e-30)
    return torch.round(w / step).clamp(-127, 127) * step


def quant_act(x: torch.Tensor) -> torch.Tensor:
    """Asymmetric uint8 over the tensor's range widened to hold 0 (ORT's ``DynamicQuantizeLinear``)."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    step = (hi - lo) / 255 if hi > lo else 1.0
    zero = round(-lo / step)
    return (torch.clamp(torch.round(x / step) + zero, 0, 255) - zero) * step


def quantized(model: torch.nn.Module, carries: list[Any], per_channel: bool,
              exact: dict[str, set[str]], weights_only: bool = False) -> torch.nn.Module:
    """A fake-quantized copy; ``exact[source]`` names the carries (by ``down``) whose ``source`` stays float.
    ``weights_only``: NNCF's int8 weight compression instead (asymmetric per output row, activations float)."""
    m = copy.deepcopy(model)
    by_up = {c.up: c for c in carries}
    by_down = {c.down: c for c in carries}
    for name, mod in m.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        w0 = mod.weight.detach().clone()
        with torch.no_grad():
            mod.weight.copy_(quant_weight(w0, per_channel, asymmetric=weights_only))
            c = by_up.get(name)
            if c is not None and c.down in exact["up"]:
                mod.weight[c.hidden:c.hidden + 2] = w0[c.hidden:c.hidden + 2]
            c = by_down.get(name)
            if c is not None and c.down in exact["down"]:
                mod.weight[:, c.hidden:c.hidden + 2] = w0[:, c.hidden:c.hidden + 2]
        c = by_down.get(name)
        keep = slice(c.hidden, c.hidden + 2) if c is not None and c.down in exact["act"] else None

        def hook(_mod: torch.nn.Module, args: tuple, keep: slice | None = keep) -> tuple:
            q = quant_act(args[0])
            if keep is not None:  # the grid is still the whole tensor's (its range includes the carry)
                q[..., keep] = args[0][..., keep]
            return (q,)

        if not weights_only:
            mod.register_forward_pre_hook(hook)
    return m


def encoder_and_texts(model_dir: Path, texts: int
                      ) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]], torch.Tensor]:
    """The float32 sentence encoder at ``model_dir`` in eval mode, ``texts`` of the built-in English paragraphs as its
    tokenizer's batches (128 tokens), and its pooled float embeddings of them: what each replica run measures
    against."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    original = AutoModel.from_pretrained(model_dir).float().eval()
    names = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in tok.model_input_names]
    data = batches(tok, english(texts), 128, names)
    return original, data, embed_torch(original, data)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--grids", default="pt,pc", help="pt (per tensor), pc (per channel) and/or w8 (weights only, "
                    "int8 asymmetric per channel: NNCF's compress_weights default)")
    ap.add_argument("--per-layer", action="store_true", help="also one row per layer: that layer's carry in float")
    ap.add_argument("--quick", action="store_true", help="only the row with every rounding")
    ap.add_argument("--construction", default="default", help="default | a name from CONSTRUCTIONS")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import normswap

    original, data, ref = encoder_and_texts(args.model, args.texts)
    converted = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        carries = normswap.patch(converted, tokenizer=str(args.model)).plan.mean_carries
    downs = [c.down for c in carries]
    if CONSTRUCTIONS[args.construction] is not None:
        how, *params = CONSTRUCTIONS[args.construction]
        print("\n".join(how(converted, carries, *params)), flush=True)
    float_err = float((1 - (ref * embed_torch(converted, data)).sum(-1)).mean())
    print(f"{args.model.name}: {len(carries)} carries, construction {args.construction}, "
          f"float error {float_err:.2e}, scales {[round(c.scale, 3) for c in carries]}", flush=True)

    def err(model: torch.nn.Module) -> np.ndarray:
        return (1 - (ref * embed_torch(model, data)).sum(-1)).clamp(min=0).numpy()

    rows: list[tuple[str, dict[str, set[str]]]] = [("all rounded", {s: set() for s in SOURCES})]
    if not args.quick:
        rows += [(f"`{s}` in float", {t: set(downs) if t == s else set() for t in SOURCES}) for s in SOURCES]
        rows += [("carry in float", {s: set(downs) for s in SOURCES})]
    if args.per_layer:
        rows += [(f"layer {i} carry in float", {s: {d} for s in SOURCES}) for i, d in enumerate(downs)]
    t0 = time.time()
    print("| grid | carry rounding | original | converted | ratio (95% CI) |\n|---|---|---|---|---|")
    for grid in args.grids.split(","):
        pc, w8 = grid in ("pc", "w8"), grid == "w8"
        base = err(quantized(original, [], pc, {s: set() for s in SOURCES}, w8))
        for label, exact in rows:
            e = err(quantized(converted, carries, pc, exact, w8))
            lo, hi = bootstrap(e, base)
            print(f"| {grid} | {label} | {base.mean():.4e} | {e.mean():.4e} | {e.mean() / base.mean():.3f} "
                  f"({lo:.3f}–{hi:.3f}) |  <!-- {time.time() - t0:.0f} s -->", flush=True)


def setter(model: torch.nn.Module, carries: list[Any], which: str, most: float) -> list[str]:
    """Make each carry's per-tensor gain exact with a range-setting spare neuron (float output unchanged).

    After per-tensor rounding the carry's gain is ``j·k/P`` (``j``, ``k`` whole steps of ``up`` and ``down``,
    ``P = 1/(d·step_down·step_up)``). A spare padding neuron whose ``up`` row is zero (activation ``act(0) = 0``)
    and whose ``down`` column holds one entry ``R > max|down|`` (``which="down"``), or whose ``down`` column is
    zero and whose ``up`` row holds one entry ``R > max|up|`` (``which="up"``, on the feature with the smallest
    norm output), moves that tensor's step so that ``P`` becomes the whole number ``floor(P)``; taken only where
    that coarsens the tensor's grid by at most ``most`` and today's gain is 5% or more off. One line per layer.
    """
    lines = []
    for c in carries:
        up, down = model.get_submodule(c.up).weight, model.get_submodule(c.down).weight
        n, d = c.hidden, c.features
        if c.added < 3:
            continue
        real_d, real_u = down[:, :n].detach().double(), up[:n].detach().double()
        md, mu = float(real_d.abs().max().float()), float(real_u.abs().max().float())
        p = 127 * 127 / (d * md * mu)
        target = math.floor(p)
        x = c.scale * md / 127  # s in steps of down
        off = abs(round(p * x) * round(1 / x) / p - 1)  # today's per-tensor gain error
        if target < 1 or p / target > most or off < 0.05:
            lines.append(f"{c.down}: P {p:.3f}, gain error {off:.3f}, left")
            continue
        with torch.no_grad():
            if which == "down":
                md = md * p / target
                row = int(real_d.abs().amax(1).argmax())
                down[:, n + 2:] = 0
                down[row, n + 2] = md
            else:
                mu = mu * p / target
                col = int(real_u.abs().amax(0).argmin())
                up[n + 2:] = 0
                up[n + 2, col] = mu
            step_d, step_u = md / 127, mu / 127
            # the fewest down steps k whose j = target/k is whole and whose carry row stays inside the range
            longest = float(real_u.norm(dim=1).max())
            k = next(k for k in range(1, target + 1) if target % k == 0
                     and 1 / (k * step_d) / math.sqrt(d) <= 0.5 * longest or k == target)
            s = 1 / (k * step_d)
            up[n] = s / d
            up[n + 1] = -s / d
            down[:, n] = -1 / s
            down[:, n + 1] = 1 / s
        lines.append(f"{c.down}: P {p:.3f} -> {target}, {which} {p / target:.3f}x coarser, k {k}, "
                     f"s/d {s / d / step_u:.4f} up steps")
    return lines


def rescale(model: torch.nn.Module, carries: list[Any], times: float) -> list[str]:
    """Scale each carry's ``s`` by ``times`` (``times=0``: the largest ``s`` whose row is at most half the longest
    real ``up`` row): exact in float for any ``s``; finer for the activations, off ``down``'s per-tensor grid."""
    lines = []
    for c in carries:
        up, down = model.get_submodule(c.up).weight, model.get_submodule(c.down).weight
        n, d = c.hidden, c.features
        longest = float(up[:n].detach().double().norm(dim=1).max())
        s = times * c.scale if times else 0.5 * longest * math.sqrt(d)
        with torch.no_grad():
            up[n], up[n + 1] = s / d, -s / d
            down[:, n], down[:, n + 1] = -1 / s, 1 / s
        lines.append(f"{c.down}: s {c.scale:.3f} -> {s:.3f}")
    return lines


def fewest(model: torch.nn.Module, carries: list[Any]) -> list[str]:
    """The carry before it was widened: ``1/s`` the fewest whole per-tensor steps of ``down`` the row bound allows."""
    from normswap.analysis.plan import MeanCarry

    widest = MeanCarry._widest
    MeanCarry._widest = staticmethod(lambda x0, x_row, inv_p: x0)
    try:
        lines = []
        for c in carries:
            up, down = model.get_submodule(c.up).weight, model.get_submodule(c.down).weight
            n, d = c.hidden, c.features
            s = MeanCarry.scale_for(down[:, :n].detach().double(), up[:n].detach().double())
            with torch.no_grad():
                up[n], up[n + 1] = s / d, -s / d
                down[:, n], down[:, n + 1] = -1 / s, 1 / s
            lines.append(f"{c.down}: s {c.scale:.3f} -> {s:.3f}")
        return lines
    finally:
        MeanCarry._widest = widest


CONSTRUCTIONS: dict[str, Any] = {"default": None, "fewest": (fewest,), "rescale-2": (rescale, 2.0),
                                 "rescale-4": (rescale, 4.0), "row-limit": (rescale, 0.0),
                                 "setter-down": (setter, "down", 1.25), "setter-up": (setter, "up", 1.25)}

if __name__ == "__main__":
    main()
