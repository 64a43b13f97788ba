"""Where a rotation's 4-bit block-wise (``MatMulNBits`` RTN) cost comes from in a real DINOv2: one group of
Linears rounded at a time, the rest of the model float, rotated against unrotated, on the same crops.

Each Linear group is rounded as ONNX Runtime's ``MatMulNBitsQuantizer`` RTN rounds it (symmetric 4-bit, blocks
of 32 input features, scale = the block's signed maximum / −8: :func:`normswap.rotation.learn.fake_quant` with
``grid="full"``, the grid ``whisper_nbits_groups.py --check`` compared with ONNX Runtime's weights), in float32
torch; the error is ``1 − cos`` against the float original per image (every token, the CLS output, the patch
tokens), and each variant's error over the original's in the same group, with a 95% paired bootstrap over
images. Groups: all Linears, readers (``q/k/v_proj``, ``fc1``), writers (``o_proj``, ``fc2``), each kind alone,
and per layer readers / writers (``--per-layer``). The patch convolution is not a ``MatMul`` (``MatMulNBits``
leaves it in float) and is not rounded.

Variants (``--variants``):

* ``original``: the checkpoint as transformers loads it (LayerNorms with γ/β, LayerScale λ as its own multiply).
* ``folded``: ``patch(fold_gamma=True)`` then ``rotate`` by the identity, ``output="restore"``: every fold a
  rotation makes (γ into the readers' columns, λ into the writers' rows), no turn.
* ``hadamard``: ``patch(fold_gamma=True)`` then ``rotate("hadamard", output="restore")`` (the rot47 variant);
  ``hadamard@S``: the Hadamard's random signs drawn from seed ``S``.
* ``keep-K``: the same with a rotation (a user matrix) that leaves the ``K`` stream channels of largest mean
  energy in the norms' outputs on the calibration crops unturned (the massive channels) and turns the rest by
  a Hadamard (:func:`keep_matrix`).
* ``online``, ``online-bB`` (``@S``: sign seed): the checkpoint ``normswap convert`` writes (β kept) with
  ``rotate(model, "none", online=True, online_block=B)``: no stream turned, an online Hadamard at every Linear
  input (the ops float, only the Linears' weights rounded).
* ``smooth-A``: ``hadamard`` with ``rotate(smooth=A)`` on the calibration crops (scale migration after the turn);
  ``keep-K+smooth-A``: ``keep-K`` with it.

``--linears`` also prints, per Linear kind, the rounding's relative output error on that Linear's own float
inputs (``‖ΔW x‖ / ‖W x‖``, median over layers), its token-constant part (the mean over an image's tokens of
``ΔW x``, which attention's averaging passes whole), and the share of the input's energy in its top channels
(the massive channels a turn spreads over every input feature).

    python benchmarks/dinov2_rotation_groups.py --model /tmp/held46/dinov2-focus \
        --photos /tmp/held46/dl/skimage/skimage/data --images 64 --variants original folded hadamard keep-8
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from photo_crops import photo_crops, photographs  # noqa: E402

from normswap.rotation.learn import fake_quant  # noqa: E402

READERS = ("q_proj", "k_proj", "v_proj", "fc1")
WRITERS = ("o_proj", "fc2")
CALIB = ("motorcycle_right.png", "gravel.png", "brick.png")


GRID = {"grid": "full", "group_size": 32}  # --grid / --group-size: the weight grid every rounding uses


def rtn4(w: torch.Tensor) -> torch.Tensor:
    """``w`` (out, in) rounded to 4 bits in blocks along ``in``: by default as ``MatMulNBits`` RTN (symmetric,
    blocks of 32); ``--grid asymmetric --group-size 128`` is NNCF's int4 asymmetric g128 (min-max, a zero point)
    and HQQ's starting grid at ``--group-size 32``."""
    return fake_quant(w.detach(), 4, 1, GRID["group_size"], GRID["grid"])


def build(model: torch.nn.Module, name: str, calib: torch.Tensor) -> torch.nn.Module:
    """``name``'s model (module docstring), native, in memory."""
    import normswap

    if name == "original":
        return model
    conv = copy.deepcopy(model)
    if name.split("@")[0].startswith("online"):  # online[-bB][+shift][+smooth-A|+awq-A][@S]
        spec, _, seed = name.partition("@")
        head, *extras = spec.split("+")
        block = int(head.rpartition("-b")[2]) if head.startswith("online-b") else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            normswap.patch(conv, beta_placement="keep")
            for extra in extras:  # exact edits of the norms and their readers before the ops go in
                migrate_(conv, extra, calib)
            normswap.rotate(conv, "none", online=True, seed=int(seed or 0), online_block=block)
        return conv.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(conv, fold_gamma=True)
        d = model.config.hidden_size
        if name == "folded":
            normswap.rotate(conv, torch.eye(d, dtype=torch.float64), output="restore")
        elif name.split("@")[0] == "hadamard":  # hadamard@S: the signs of seed S (default 0)
            normswap.rotate(conv, "hadamard", seed=int(name.partition("@")[2] or 0), output="restore")
        elif name.startswith("keep-"):  # keep-K or keep-K+smooth-A, optionally @S: the Hadamard's seed
            spec, _, seed = name.partition("@")
            keep, _, smooth = spec.partition("+smooth-")
            q = keep_matrix(conv, d, int(keep.split("-")[1]), calib, int(seed or 0))
            opts = {"smooth": float(smooth), "calibration": [{"pixel_values": b} for b in calib.split(8)]} \
                if smooth else {}
            normswap.rotate(conv, q, output="restore", **opts)
        elif name.startswith("smooth-"):
            normswap.rotate(conv, "hadamard", seed=0, output="restore", smooth=float(name.split("-")[1]),
                            calibration=[{"pixel_values": b} for b in calib.split(8)])
        else:
            raise SystemExit(f"unknown variant {name}")
    return conv.eval()


def norm_readers(conv: torch.nn.Module) -> dict[str, list[str]]:
    """Each encoder norm that only Linears read, with its readers (``norm1``: q, k, v; ``norm2``: ``fc1``)."""
    out = {}
    for i in range(conv.config.num_hidden_layers):
        pre = f"encoder.layer.{i}"
        out[f"{pre}.norm1"] = [f"{pre}.attention.{k}" for k in ("q_proj", "k_proj", "v_proj")]
        out[f"{pre}.norm2"] = [f"{pre}.mlp.fc1"]
    return out


@torch.no_grad()
def migrate_(conv: torch.nn.Module, how: str, calib: torch.Tensor) -> None:
    """An exact edit between each norm (γ and β kept, before any op) and its Linear readers, from ``calib``:

    * ``shift``: Outlier Suppression+'s shift: ``z`` = the norm output's mean per channel over the calibration
      tokens; the norm's β ``− z``, each reader's bias ``+ W z``, so its input is centred per channel and the
      rounding error's part that is the same for every token (``ΔW z``) is gone;
    * ``smooth-A``: SmoothQuant's migration, ``s_j = max|a_j|^A / max|W_:,j|^(1−A)`` (``normswap.rotation.smooth``),
      the norm's γ and β ``/ s``, the readers' columns ``× s``;
    * ``awq-A``: the same with ``s_j = mean|a_j|^A`` (AWQ's activation-aware scale, no weight term), normalised
      to geometric mean 1;
    * ``scales=PATH``: the scales ``dinov2_online_scales.py`` learned and saved (``{norm: s}``), applied as
      ``smooth-A``'s are.

    The online Hadamard then goes in after the norm, so the turned weight is ``W·diag(s)·D·H``: the columns of
    the channels that carry the most activation rounded finer, relative to their size, after the spread."""
    from normswap.rotation import smooth

    batches = [((), {"pixel_values": b}) for b in calib.split(8)]
    pairs = norm_readers(conv)
    lins = dict(conv.named_modules())
    if how == "shift":
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}

        def hook(name: str):
            def record(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
                flat = out.detach().double().reshape(-1, out.shape[-1])
                sums[name] = sums.get(name, 0) + flat.sum(0)
                counts[name] = counts.get(name, 0) + flat.shape[0]
            return record

        hs = [lins[n].register_forward_hook(hook(n)) for n in pairs]
        outputs(conv, calib)
        for h in hs:
            h.remove()
        for n, readers in pairs.items():
            z = sums[n] / counts[n]
            norm = lins[n]
            norm.bias.copy_((norm.bias.double() - z).to(norm.bias.dtype))
            for r in readers:
                lin = lins[r]
                lin.bias.copy_((lin.bias.double() + lin.weight.double() @ z).to(lin.bias.dtype))
        return
    if how.startswith("scales="):  # per-norm scales saved by dinov2_online_scales.py ({norm: t}), as they are
        saved = torch.load(how.partition("=")[2])
        for n, readers in pairs.items():
            smooth.apply_(conv, n, readers, saved[n])
        return
    kind, _, alpha = how.partition("-")
    if kind == "smooth":
        act = smooth.activation_maxima(conv, pairs, batches)
    elif kind == "awq":
        seen: dict[str, list[torch.Tensor]] = {n: [] for n in pairs}
        hs = [lins[n].register_forward_hook(
            lambda m, a, o, acc=seen[n]: acc.append(o.detach().double().abs().reshape(-1, o.shape[-1]).mean(0)))
            for n in pairs]
        outputs(conv, calib)
        for h in hs:
            h.remove()
        act = {n: torch.stack(v).mean(0) for n, v in seen.items()}
    else:
        raise SystemExit(f"unknown edit {how}")
    for n, readers in pairs.items():
        if kind == "smooth":
            s = smooth.scales(act[n], smooth.weight_maxima(conv, readers), float(alpha))
        else:
            s = act[n].clamp_min(1e-12).pow(float(alpha))
            s = s / s.log().mean().exp()
        smooth.apply_(conv, n, readers, s)


@torch.no_grad()
def keep_matrix(conv: torch.nn.Module, d: int, k: int, calib: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Identity on the ``k`` channels of largest mean energy in the norms' outputs, Hadamard on the rest."""
    from normswap.nn.rmsnorm import RMSNorm
    from normswap.rotation.rotate import rotation_matrix

    energy = torch.zeros(d, dtype=torch.float64)
    def record(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        energy.add_(out.detach().double().pow(2).reshape(-1, d).mean(0))

    hooks = [m.register_forward_hook(record) for m in conv.modules() if isinstance(m, RMSNorm)]
    outputs(conv, calib)
    for h in hooks:
        h.remove()
    kept = energy.topk(k).indices
    print(f"  kept channels {sorted(kept.tolist())}", flush=True)
    rest = torch.tensor([i for i in range(d) if i not in set(kept.tolist())])
    q = torch.eye(d, dtype=torch.float64)
    q[rest[:, None], rest[None, :]] = rotation_matrix(len(rest), "hadamard", seed)[0]
    return q


def linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The encoder's q/k/v/o/fc1/fc2 Linears by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layer." in n
            and n.rsplit(".", 1)[-1] in READERS + WRITERS}


def group_names(layers: int, per_layer: bool) -> list[str]:
    out = ["all", "readers", "writers", *READERS, *WRITERS]
    if per_layer:
        out += [f"L{i}.{role}" for i in range(layers) for role in ("readers", "writers")]
    return out


def in_group(name: str, group: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    role = "readers" if leaf in READERS else "writers"
    if group == "all":
        return True
    if group in ("readers", "writers"):
        return role == group
    if group.startswith("L"):
        layer, want = group[1:].split(".")
        return f".layer.{layer}." in name and role == want
    return leaf == group


@torch.no_grad()
def outputs(model: torch.nn.Module, px: torch.Tensor, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    pooled, tokens = [], []
    for i in range(0, len(px), batch):
        out = model(pixel_values=px[i:i + batch])
        pooled.append(out.pooler_output)
        tokens.append(out.last_hidden_state)
    return torch.cat(pooled), torch.cat(tokens)


def errors(ref: tuple[torch.Tensor, torch.Tensor], out: tuple[torch.Tensor, torch.Tensor]) -> dict[str, list[float]]:
    """``1 − cos`` per image: CLS output, every token (mean), patch tokens only (mean)."""
    def cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return 1 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)

    tok = cos(ref[1], out[1])
    return {"cls": cos(ref[0], out[0]).tolist(), "tok": tok.mean(-1).tolist(), "patch": tok[:, 1:].mean(-1).tolist()}


@torch.no_grad()
def group_errors(model: torch.nn.Module, px: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor],
                 groups: list[str]) -> dict[str, dict[str, list[float]]]:
    lins = linears(model)
    result = {}
    for g in groups:
        saved = {n: m.weight.detach().clone() for n, m in lins.items() if in_group(n, g)}
        for n in saved:
            lins[n].weight.copy_(rtn4(saved[n]))
        result[g] = errors(ref, outputs(model, px))
        for n, w in saved.items():
            lins[n].weight.copy_(w)
        print(f"  {g:12s} tok {statistics.fmean(result[g]['tok']):.3e} cls {statistics.fmean(result[g]['cls']):.3e}",
              flush=True)
    return result


def ratio_ci(num: list[float], den: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """mean(num) / mean(den) with a 95% paired bootstrap over images."""
    a, b = torch.tensor(num, dtype=torch.float64), torch.tensor(den, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, len(a), (draws, len(a)), generator=gen)
    r = a[idx].mean(1) / b[idx].mean(1)
    return float(a.mean() / b.mean()), float(r.quantile(0.025)), float(r.quantile(0.975))


@torch.no_grad()
def linear_errors(model: torch.nn.Module, px: torch.Tensor, top: int = 8) -> dict[str, Any]:
    """Per Linear: ``‖ΔW x‖ / ‖W x‖`` on its own float inputs, and the share of ``‖x‖²`` in ``x``'s ``top``
    channels of largest mean energy (readers: the norm's output, the channels a turn spreads)."""
    lins = linears(model)
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.setdefault(n, []).append(args[0].detach()))
             for n, m in lins.items()]
    outputs(model, px)
    for h in hooks:
        h.remove()
    out: dict[str, Any] = {}
    for n, m in lins.items():
        xs = torch.cat(seen[n]).double()  # [images, tokens, in]
        x = xs.reshape(-1, xs.shape[-1])
        w = m.weight.double()
        dw = rtn4(m.weight).double() - w
        energy = x.pow(2).mean(0)
        err = xs @ dw.T
        # the token-constant part of the error (its mean over each image's tokens), which attention's
        # averaging passes whole, against the output's typical token norm
        coherent = float(err.mean(1).norm(dim=-1).mean() / (xs @ w.T).norm(dim=-1).mean())
        out[n] = {"rel": float((x @ dw.T).norm() / (x @ w.T).norm()), "coherent": coherent,
                  "top_share": float(energy.topk(top).values.sum() / energy.sum())}
    return out


@torch.no_grad()
def block_grids(model: torch.nn.Module, group: int = 128) -> dict[str, list[float]]:
    """Per Linear kind, medians over layers of: ``‖ΔW‖/‖W‖`` on the asymmetric 4-bit grid (NNCF's int4 asym, groups
    of ``group`` inputs), the same on the symmetric ``full`` grid, and the share of each block's energy in its
    mean (what a zero point could absorb as an offset)."""
    rows: dict[str, list[tuple[float, float, float]]] = {}
    for n, lin in linears(model).items():
        w = lin.weight.detach().double()
        blocks = w.reshape(w.shape[0], -1, group)
        share = float((blocks.mean(-1) ** 2).sum() / (blocks ** 2).mean(-1).sum())
        ea = float((fake_quant(w, 4, 1, group, "asymmetric") - w).norm() / w.norm())
        es = float((fake_quant(w, 4, 1, group, "full") - w).norm() / w.norm())
        rows.setdefault(n.rsplit(".", 1)[-1], []).append((ea, es, share))
    return {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in rows.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import transformers as tf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a Dinov2Model directory")
    ap.add_argument("--photos", type=Path, required=True, help="scikit-image's skimage/data")
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--calib", type=int, default=32, help="crops (of the calibration photographs) keep-K ranks on")
    ap.add_argument("--variants", nargs="+", default=["original", "folded", "hadamard"])
    ap.add_argument("--per-layer", action="store_true")
    ap.add_argument("--linears", action="store_true")
    ap.add_argument("--groups", nargs="+", help="only these groups (default: all, readers, writers, each kind)")
    ap.add_argument("--select-seeds", type=int, default=0, help="instead: the Hadamard signs of seeds 0..N-1, each "
                    "model with every Linear rounded, scored on the calibration crops (a rotation chosen from data)")
    ap.add_argument("--grid", default="full", choices=("full", "symmetric", "asymmetric"),
                    help="the 4-bit weight grid (full: MatMulNBits RTN; asymmetric: NNCF int4 asym, HQQ's start)")
    ap.add_argument("--group-size", type=int, default=32, help="weights per scale along the input features")
    ap.add_argument("--block-grids", action="store_true", help="instead: per Linear kind, the weights' rounding "
                    "error on the asymmetric and the symmetric 4-bit grid in groups of --group-size (block_grids)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    GRID.update(grid=args.grid, group_size=args.group_size)
    torch.set_num_threads(1)
    model = tf.Dinov2Model.from_pretrained(args.model).eval()
    px = photo_crops(args.photos, args.images, args.image, seed=1, exclude=CALIB)
    calib = photo_crops(n=args.calib, size=args.image, seed=3,
                        files=[p for p in photographs(args.photos) if p.name in CALIB])
    if args.select_seeds:
        cref = outputs(model, calib)
        for seed in range(args.select_seeds):
            m = build(model, f"hadamard@{seed}", calib)
            e = group_errors(m, calib, cref, ["all"])["all"]
            print(f"seed {seed}: calibration tok {statistics.fmean(e['tok']):.4e} cls {statistics.fmean(e['cls']):.4e}",
                  flush=True)
        return {}
    if args.block_grids:
        print(f"| kind | variant | asym g{args.group_size} ‖ΔW‖/‖W‖ | sym | asym / sym | block-mean energy share |")
        print("|---|---|---|---|---|---|")
        found = {name: block_grids(build(model, name, calib), args.group_size) for name in args.variants}
        for kind in READERS + WRITERS:
            for name, kinds in found.items():
                ea, es, share = kinds[kind]
                print(f"| {kind} | {name} | {ea:.4f} | {es:.4f} | {ea / es:.3f} | {share:.4f} |")
        return {"block_grids": found}
    ref = outputs(model, px)
    groups = args.groups or group_names(model.config.num_hidden_layers, args.per_layer)
    result: dict[str, Any] = {"images": args.images, "groups": groups, "rows": {}, "linears": {}}
    for name in args.variants:
        print(name, flush=True)
        m = build(model, name, calib)
        float_err = errors(ref, outputs(m, px))
        print(f"  float: tok {statistics.fmean(float_err['tok']):.1e} (exactness)", flush=True)
        result["rows"][name] = group_errors(m, px, ref, groups)
        if args.linears:
            result["linears"][name] = linear_errors(m, px[:16])
        if m is not model:
            del m
    base = result["rows"].get("original")
    if base:
        for metric in ("tok", "cls", "patch"):
            names = [n for n in args.variants if n != "original"]
            print(f"\n{metric}: ratio to the original, only that group rounded (95% CI over images)\n")
            print("| group | original 1 − cos | " + " | ".join(names) + " |")
            print("|---|---|" + "---|" * len(names))
            for g in groups:
                cells = []
                for n in names:
                    r, lo, hi = ratio_ci(result["rows"][n][g][metric], base[g][metric])
                    cells.append(f"{r:.3f} ({lo:.2f}-{hi:.2f})")
                print(f"| {g} | {statistics.fmean(base[g][metric]):.2e} | " + " | ".join(cells) + " |")
    if args.linears and len(result["linears"]) > 1:
        names = list(result["linears"])
        print("\nper Linear kind, median over layers: ‖ΔW x‖/‖W x‖, its token-mean part (‖mean_t ΔW x‖ / ‖W x‖) "
              "and the top-8 channel energy share of x\n")
        print("| kind | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for kind in READERS + WRITERS:
            cells = []
            for n in names:
                vals = [v for k, v in result["linears"][n].items() if k.endswith(kind)]
                cells.append(f"{statistics.median(v['rel'] for v in vals):.4f} / "
                             f"{statistics.median(v['coherent'] for v in vals):.4f} "
                             f"({statistics.median(v['top_share'] for v in vals):.2f})")
            print(f"| {kind} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
