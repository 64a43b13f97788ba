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

* ``w4-sim``: not quanto: its 4-bit grid simulated in float (``heldout_weight_groups.fake_quant_rows``: min/max
  per 128 inputs, 16 levels, round to nearest) on the same crops, to tell the grid from the crops.

``--groups`` quantizes one group of weights at a time THROUGH quanto (its ``include`` patterns; the groups of
``heldout_weight_groups.py``: ``writers`` = ``o_proj``/``fc2``, ``readers`` = q/k/v/``fc1``, ``patch`` = the
patch convolution, ``linears``, ``all``, and their unions); each setting is then reported as ``HOW:GROUP``.
``--grid-check`` compares quanto's own quantized weights (dequantized) with the float simulation tensor by
tensor (entries that land on another level, and the difference's norm over the rounding error's).

Variants: ``original`` (transformers' ``AutoModel``), each directory passed as ``NAME=DIR`` (native
outputs through ``normswap.load``, compat ones through ``AutoModel``), and the names ``native``,
``native-centerop``, ``native-keep``, ``native-keep-centerop`` and ``compat-keep`` without a directory: built
in memory from the original by ``bench_quant_engines.variant`` (``native``: the default ``normswap.patch``;
``native-centerop``: the stem centered by a mean op on the original convolution instead of by its weights;
``-keep``: ``beta_placement="keep"``, every β left in its norm, so the readers see the original's inputs;
``native-meanops``: ``native`` with a mean subtraction before every RMSNorm, a no-op in float: whether the
per-token mean of the edited writers' rounding error, which LayerNorm removed and RMSNorm passes on, is the cost;
``permuted-N``: a rounding draw, the original with its MLP hidden neurons reordered by seed N;
``reordered-N``: also its attention heads and each head's value dimensions, so ``o_proj`` rounds differently
too; ``BASE-permuted-N``, ``BASE-reordered-N``: the same reordering of a built variant BASE, e.g.
``native-reordered-3``, a draw of the conversion to set against the original's).
The error is ``1 − cos`` against the float32 original per image (CLS token, and the mean over every token),
and the ratio to the original's in the same setting with a 95% paired bootstrap interval over images
(``bench_quant_engines.ci_table``; typical image: the geometric mean of the per-image ratios).

    PYTHONPATH=QUANTO_DIR:$PWD python benchmarks/bench_quanto.py ORIGINAL_DIR native=CONVERTED_DIR \\
        --photos SKIMAGE/data --image 112 --images 256 --json quanto.json
    PYTHONPATH=QUANTO_DIR:$PWD python benchmarks/bench_quanto.py ORIGINAL_DIR native native-centerop \\
        --photos SKIMAGE/data --images 256 --quantizers w4 --groups writers readers patch linears all
    PYTHONPATH=QUANTO_DIR:$PWD python benchmarks/bench_quanto.py ORIGINAL_DIR reordered-{1..5} native \
        native-reordered-{1..5} --photos SKIMAGE/data --images 256 --quantizers w4   # draws of both, judged

With draws of the original and of a variant on the same crops, a last table sets the two means against each
other with an interval over draws and images (:func:`draw_ratio`): the verdict a single draw cannot give.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_engines import Outputs, ci_table, per_image, table, variant, weight_ranges  # noqa: E402
from heldout_exactness import load  # noqa: E402
from heldout_weight_groups import fake_quant_rows  # noqa: E402

QUANTIZERS = ("fp32", "w8", "w4", "w8a8", "w4-sim")
BUILT = ("native", "native-centerop", "native-keep", "native-keep-centerop", "native-meanops",
         "compat-keep", "permuted-1", "permuted-2")  # built in memory from the original
# a rounding draw: [BASE-]permuted-N (MLP neurons reordered) or [BASE-]reordered-N (MLP neurons, attention heads
# and the value dimensions inside each head reordered) of the original or of BASE (one of BUILT), seed N
DRAW = re.compile(r"^(?:(?P<base>.+)-)?(?P<how>permuted|reordered)-(?P<seed>\d+)$")
# heldout_weight_groups.GROUPS as quanto's include patterns (fnmatch on module names)
WRITERS, READERS = ["*.o_proj", "*.fc2"], ["*.q_proj", "*.k_proj", "*.v_proj", "*.fc1"]
PATCH = ["*patch_embeddings.projection"]
GROUPS = {"writers": WRITERS, "readers": READERS, "patch": PATCH, "linears": WRITERS + READERS,
          "writers+patch": WRITERS + PATCH, "readers+patch": READERS + PATCH, "all": ["*"]}


def quantized(model: torch.nn.Module, how: str, calib: torch.Tensor, group: str = "all") -> torch.nn.Module:
    """A quantized copy of ``model`` in quanto's setting ``how`` (frozen: integer weights stored), only the
    modules of ``group`` quantized (quanto's ``include``)."""
    from optimum import quanto

    if how == "fp32":
        return model
    q = copy.deepcopy(model)
    if how == "w4-sim":  # quanto's qint4 weight grid in float: min/max per 128 inputs, round to nearest
        with torch.no_grad():
            for name, module in q.named_modules():
                if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and \
                        any(fnmatch.fnmatch(name, p) for p in GROUPS[group]):
                    module.weight.copy_(fake_quant_rows(module.weight, 4, 128, asymmetric=True))
        return q.eval()
    weights = quanto.qint4 if how == "w4" else quanto.qint8
    activations = quanto.qint8 if how == "w8a8" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quanto.quantize(q, weights=weights, activations=activations,
                        include=None if group == "all" else GROUPS[group])
        if activations is not None:
            with torch.no_grad(), quanto.Calibration():
                for i in range(0, len(calib), 8):
                    q(pixel_values=calib[i:i + 8])
        quanto.freeze(q)
    return q.eval()


def built(original: torch.nn.Module, name: str, workdir: Path) -> tuple[torch.nn.Module, str]:
    """A variant built in memory from the original: ``bench_quant_engines.variant``'s, or
    ``native-keep-centerop`` (β kept in every norm, the stem centered by an op on the original convolution)."""
    draw = DRAW.match(name)
    if draw:
        base, note = (original, "the original") if draw["base"] in (None, "original") else \
            built(original, draw["base"], workdir)
        attention = draw["how"] == "reordered"
        what = "MLP neurons, heads and value dims" if attention else "MLP hidden neurons"
        return permuted(base, int(draw["seed"]), attention=attention), f"{note}; {what} reordered (exact)"
    if name == "native-meanops":
        return mean_ops(variant(original, "native", workdir)[0]), "native, every RMSNorm's input centered by an op"
    if name != "native-keep-centerop":
        return variant(original, name, workdir)
    from bench_quant_engines import centered_by_op

    import normswap

    conv = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(conv, beta_placement="keep", trade_constants=False)
    return centered_by_op(conv, original), "native, β kept in every norm, the stem centered by an op"


@torch.no_grad()
def permuted(model: torch.nn.Module, seed: int, attention: bool = False) -> torch.nn.Module:
    """A rounding draw of a grouped weight quantizer: ``model`` (a Dinov2Model, original or converted) with
    every MLP's hidden neurons in another order (``fc1``'s rows and bias, ``fc2``'s columns: the same function,
    the same weights), so ``fc2``'s groups of 128 inputs hold other entries and round differently.
    ``attention``: also the heads in another order (q/k/v rows and biases by head, ``o_proj``'s columns) and
    the value dimensions inside each head (``v_proj`` rows, ``o_proj`` columns), so ``o_proj``'s groups round
    differently too; q/k/v/``fc1`` rows keep their entries, so they round as before. The same seed gives the
    same reordering on any model of the same shape, so a converted model's draw N matches the original's.
    A row rescaling (``bench_quant_engines.jittered``) is no draw here: a group inside a row scales with it
    and rounds alike."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for layer in out.encoder.layer:
        reorder_mlp_(layer.mlp.fc1, layer.mlp.fc2, g)
        if attention:
            att = layer.attention
            reorder_heads_(att.q_proj, att.k_proj, att.v_proj, att.o_proj, out.config.num_attention_heads, g)
    return out


def reorder_mlp_(fc1: torch.nn.Linear, fc2: torch.nn.Linear, g: torch.Generator) -> None:
    """One MLP's hidden neurons in another order drawn from ``g`` (``fc1``'s rows and bias, ``fc2``'s columns):
    the same function, ``fc2``'s input groups holding other entries. In place; the draw of every model's
    rounding draws (:func:`permuted`, Whisper's in ``whisper_paired_draws``/``bench_heldout_engines``)."""
    p = torch.randperm(fc1.out_features, generator=g)
    with torch.no_grad():
        fc1.weight.copy_(fc1.weight[p])
        if fc1.bias is not None:
            fc1.bias.copy_(fc1.bias[p])
        fc2.weight.copy_(fc2.weight[:, p])


def reorder_heads_(q: torch.nn.Linear, k: torch.nn.Linear, v: torch.nn.Linear, o: torch.nn.Linear, heads: int,
                   g: torch.Generator) -> None:
    """One attention layer's heads in another order drawn from ``g`` (q/k/v rows and biases by head, dims kept
    for q·k), the value dims shuffled inside each head, and ``o``'s columns reading them back: the same attention,
    ``o``'s input groups holding other entries. In place."""
    width = v.out_features // heads
    order = torch.randperm(heads, generator=g)
    qk = (order[:, None] * width + torch.arange(width)).reshape(-1)  # heads moved, dims kept (q·k per head)
    vo = (order[:, None] * width + torch.stack([torch.randperm(width, generator=g) for _ in range(heads)]))
    vo = vo.reshape(-1)  # heads moved as q/k's, dims shuffled inside each head (o reads them back)
    with torch.no_grad():
        for proj, idx in ((q, qk), (k, qk), (v, vo)):
            proj.weight.copy_(proj.weight[idx])
            if proj.bias is not None:
                proj.bias.copy_(proj.bias[idx])
        o.weight.copy_(o.weight[:, vo])


def draw_ratio(orig: Any, conv: Any, boots: int = 2000, typical: bool = False, paired: bool = False,
               seed: int = 0) -> tuple[float, float, float]:
    """The converted model's error over the original's when both are rounding draws: ``orig`` ``[draws, images]``
    and ``conv`` ``[draws', images]`` per-image errors (the same images, in the same order). The point is the
    ratio of the means over draws and images (``typical``: the geometric mean of the per-image ratios of the
    draw-averaged errors); the 95% interval resamples the images (paired: the same ones for both) and the
    draws, so it holds both the image noise and the rounding draw, which a fixed model's image-only interval
    leaves out. ``paired``: row k of both is the same reordering (same seed), so the draws are resampled
    together, as pairs; else each side's apart."""
    import numpy as np

    orig, conv = np.asarray(orig, dtype=float), np.asarray(conv, dtype=float)
    rng = np.random.default_rng(seed)

    def ratio(o: Any, c: Any) -> Any:  # o, c: [..., draws, images] -> [...]
        if typical:
            return np.exp(np.log(c.mean(-2) / o.mean(-2)).mean(-1))
        return c.mean((-2, -1)) / o.mean((-2, -1))

    imgs = rng.integers(0, orig.shape[1], size=(boots, orig.shape[1]))
    do = rng.integers(0, len(orig), size=(boots, len(orig)))
    if paired and len(orig) != len(conv):
        raise ValueError(f"paired draws need as many of each, got {len(orig)} and {len(conv)}")
    dc = do if paired else rng.integers(0, len(conv), size=(boots, len(conv)))
    o = orig[do[:, :, None], imgs[:, None, :]]  # [boots, draws, images]
    c = conv[dc[:, :, None], imgs[:, None, :]]
    lo, hi = np.percentile(ratio(o, c), [2.5, 97.5])
    return float(ratio(orig, conv)), float(lo), float(hi)


def draw_sets(names: list[str]) -> dict[tuple[str, str], list[str]]:
    """The rows that are draws of one model by one kind of reordering, keyed ``(base, kind)``: ``original``
    with its ``permuted-N`` (kind ``permuted``) or its ``reordered-N``, and each ``BASE`` with its
    ``BASE-permuted-N`` or ``BASE-reordered-N``; the base itself (no reordering) is a draw of every kind, and
    a base with draws of both kinds also gets the set of them all (kind ``all``). Each set in seed order."""
    sets: dict[tuple[str, str], list[str]] = {}
    for name in names:
        draw = DRAW.match(name)
        if draw:
            sets.setdefault((draw["base"] or "original", draw["how"]), []).append(name)
    for base in dict.fromkeys(base for base, _ in sets):
        kinds = [kind for b, kind in sets if b == base]
        if len(kinds) > 1:
            sets[base, "all"] = [n for kind in sorted(kinds) for n in sets[base, kind]]
    return {(base, how): ([base] if base in names else []) + sorted(draws, key=_seeds)
            for (base, how), draws in sets.items()}


def _seeds(name: str) -> tuple[str, int]:
    """A draw's reordering, ``(kind, seed)`` (``("", 0)``: the model as it is): the same for a converted
    model's draw and the original's it pairs with."""
    m = DRAW.match(name)
    return (m["how"], int(m["seed"])) if m else ("", 0)


def draw_table(result: dict[str, Any], how: str = "w4") -> str:
    """Each set of draws (:func:`draw_sets`): its draws' mean error, their spread, and the ratio of its mean to
    the original's draws of the same kind, with :func:`draw_ratio`'s interval (over draws and images; the
    draws paired by seed where both sets have the same seeds)."""
    import numpy as np

    rows = result["rows"]
    sets = draw_sets([n for n in rows if how in rows[n]["per_image"]])
    lines = [f"rounding draws in {how}: 1 − cos; mean over draws (sd between draws, min-max); ratio of means to "
             "the original's draws of the same kind, 95% interval over draws and images", "",
             "| model | kind | draws | tok: mean (sd, min-max) | tok ratio | typical | CLS: mean (sd) | CLS ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for (base, kind), names in sets.items():
        if ("original", kind) not in sets:
            continue
        cells = []
        paired = [_seeds(n) for n in names] == [_seeds(n) for n in sets["original", kind]]
        for metric in ("tok", "cls"):
            mine = np.stack([np.array(rows[n]["per_image"][how][metric]) for n in names])
            orig = np.stack([np.array(rows[n]["per_image"][how][metric]) for n in sets["original", kind]])
            means = mine.mean(1)
            sd = means.std(ddof=1) if len(means) > 1 else float("nan")
            r = "{:.3f} ({:.3f}-{:.3f})".format(*draw_ratio(orig, mine, paired=paired))
            if metric == "tok":
                t = "{:.3f} ({:.3f}-{:.3f})".format(*draw_ratio(orig, mine, typical=True, paired=paired))
                cells += [f"{means.mean():.3e} ({sd:.1e}, {means.min():.3e}-{means.max():.3e})", r, t]
            else:
                cells += [f"{means.mean():.3e} ({sd:.1e})", r]
        lines.append(f"| {base} | {kind}{', paired' if paired else ''} | {len(names)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mean_ops(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with a mean subtraction before every ``normswap.RMSNorm`` (a forward pre-hook): a no-op in float,
    where the conversion made every stream zero-mean, but under quantization it removes the per-token mean of
    the rounding error the edited writers add, as the original's LayerNorms did (diagnosis only: it puts back
    the op the conversion removed)."""
    import normswap

    for module in model.modules():
        if isinstance(module, normswap.RMSNorm):
            module.register_forward_pre_hook(lambda _m, args: (args[0] - args[0].mean(-1, keepdim=True), *args[1:]))
    return model


def grid_check(model: torch.nn.Module) -> dict[str, float]:
    """quanto's own 4-bit weights, dequantized, against the float simulation of its grid, tensor by tensor:
    how many entries land on another level, and the worst tensor's ``‖quanto − simulation‖ / ‖quanto − w‖``."""
    from optimum import quanto

    q = copy.deepcopy(model)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        quanto.quantize(q, weights=quanto.qint4)
        quanto.freeze(q)
    other, total, worst, tensors = 0, 0, 0.0, 0
    for name, module in q.named_modules():
        if not hasattr(module, "weight_qtype") or module.weight_qtype is None:
            continue
        w = model.get_submodule(name).weight.detach().float()
        mine = module.weight.dequantize().detach().float()
        sim = fake_quant_rows(w, 4, 128, asymmetric=True).float()
        other += int(((mine - sim).abs() > 1e-6 * w.abs().max()).sum())
        total += w.numel()
        tensors += 1
        worst = max(worst, float((mine - sim).norm() / (mine - w).norm()))
    return {"tensors": tensors, "entries": total, "on_another_level": other, "worst_norm_ratio": worst}


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
    ap.add_argument("--quantizers", nargs="+", default=list(QUANTIZERS[:4]), choices=QUANTIZERS)
    ap.add_argument("--groups", nargs="+", default=["all"], choices=list(GROUPS),
                    help="quantize only this group of weights through quanto, one group at a time")
    ap.add_argument("--seed", type=int, default=1, help="the held-out crops' seed")
    ap.add_argument("--grid-check", action="store_true",
                    help="compare quanto's 4-bit weights with the float simulation, tensor by tensor")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from optimum import quanto  # fail early, with the import error, when quanto is not on the path
    from photo_crops import photo_crops, photographs

    torch.set_num_threads(1)
    held_out = args.calib_photos.split(",")
    px = photo_crops(args.photos, args.images, args.image, seed=args.seed, exclude=held_out)
    calib = photo_crops(n=args.calib, size=args.image, seed=2,
                        files=[p for p in photographs(args.photos) if p.name in held_out])
    original = load(args.original)
    ref_pool, ref_tok = run(original, px)
    dirs = {"original": args.original} | dict(v.split("=", 1) if "=" in v else (v, v) for v in args.variants)
    bad = [v for v, p in dirs.items() if v != "original" and p == v and v not in BUILT
           and not (DRAW.match(v) and DRAW.match(v)["base"] in (None, "original", *BUILT))]
    if bad:
        sys.exit(f"bench_quanto: {bad[0]!r} is neither NAME=DIR nor one of {', '.join(BUILT)}")
    workdir = Path(tempfile.mkdtemp(prefix="bench_quanto_"))
    result: dict[str, Any] = {"model": f"{args.original.name}, {args.image} px, optimum-quanto "
                              f"{getattr(quanto, '__version__', '?')}", "images": len(px), "rows": {}}
    for name, path in dirs.items():
        t0 = time.perf_counter()
        if name == "original":
            model = original
        elif path == name:  # built in memory from the original, as bench_quant_engines does
            model, path = built(original, name, workdir)
        else:
            model = load(Path(path))
        row: dict[str, Any] = {"note": str(path), "weights": weight_ranges(model), "errors": {}, "per_image": {}}
        if args.grid_check:
            row["grid_check"] = grid_check(model)
            print(f"{name:12s} grid check: {row['grid_check']}", flush=True)
        for how in args.quantizers:
            for group in ["all"] if how == "fp32" else args.groups:
                key = how if group == "all" else f"{how}:{group}"
                pool, tok = run(quantized(model, how, calib, group), px)
                row["errors"][key] = {"cls": float(per_image(ref_pool, pool).mean()),
                                      "tok": float(per_image(ref_tok, tok).mean())}
                row["per_image"][key] = {"cls": per_image(ref_pool, pool).tolist(),
                                         "tok": per_image(ref_tok, tok).tolist()}
                print(f"{name:16s} {key:18s} cls {row['errors'][key]['cls']:.3e} tok {row['errors'][key]['tok']:.3e}",
                      flush=True)
        row["seconds"] = time.perf_counter() - t0
        result["rows"][name] = row
    print(table(result, "tok") + "\n\n" + table(result, "cls"))
    if len(dirs) > 1:
        print("\n" + ci_table([result], "tok") + "\n\n" + ci_table([result], "cls"))
        print("\n" + ci_table([result], "tok", typical=True) + "\n\n" + ci_table([result], "cls", typical=True))
    if "w4" in args.quantizers and len(draw_sets(list(dirs))) > 0:
        print("\n" + draw_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
