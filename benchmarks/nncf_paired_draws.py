"""Is DINOv2-small's per-row int8 cost in OpenVINO NNCF a rounding draw? Paired exact re-roundings in NNCF itself
(issue 40, round 56).

Round 53/54 measured the default conversion at 1.128× the original's error in NNCF's int8 weights (INT8_ASYM, one
scale per output row), all of it the MLP writers' centered rows (``fc2``). Round 55 (``fc2_sensitivity.py``) showed in
a float simulation of NNCF's grid that the centered rows cost 1.008× (0.91-1.13) over 6 paired exact re-roundings.
This script asks the engine itself: the real ``nncf.compress_weights`` on the OpenVINO model of each re-rounded
network, run by OpenVINO's CPU plugin (``int8w_dinov2.engine_tokens``, the same path as rounds 50-54).

An *exact re-rounding* changes the weights a per-row grid rounds and not the function. Draw ``k`` (seed ``k``; draw
0 is the shipped model, nothing changed) applies the same random transforms to both models of a pair:

* ``qk``: per layer and head, one Haar-random orthogonal ``B`` (64 × 64): ``q' = B q``, ``k' = B k`` (the head's
  rows of ``q_proj`` / ``k_proj`` and their biases). ``q'ᵀk' = qᵀk``: exact in any network.
* ``vo``: per layer and head, another orthogonal ``A``: ``v' = A v`` (``v_proj``'s rows of the head and bias),
  ``o' = o Aᵀ`` (``o_proj``'s columns of the head). Exact in any network; every ``o_proj`` row is rounded anew.
* ``fc2``: each layer's fc2 rows with λ folded shifted by one shared vector ``v`` (``λ_i W_i + v``, uniform in ±1 step
  of the original rows' grid, round 55's ``--paired`` draw): adds ``(vᵀh)·1`` to the stream, which the next
  LayerNorm removes. Exact only in a LayerNorm network (not in the converted one, whose stream must stay zero-mean).
* ``perm``: each layer's MLP neurons permuted (``fc1`` rows, ``fc2`` columns): per-row weight grids see the same
  integers; what changes is which inputs share the CPU plugin's dynamic-quantization groups (32 consecutive input
  channels of ``fc2``), so it re-rounds the activation part only. ``--perm-check`` measures that alone.

Pairs (``--pairs``):

* ``a``: the default conversion (``normswap.patch(beta_placement="keep")``, what ``normswap convert`` writes) against
  the original, with ``qk`` + ``vo`` (the transforms exact in both; ``fc1``/``fc2`` and the patch convolution keep the
  shipped draw).
* ``c``: the fc2 hybrid against the original with ``qk`` + ``vo`` alone (fc2 keeps its shipped rounding, as in ``a``):
  what ``a``'s fixed fc2 draw does, in the network where ``b`` can re-draw it. The original's rows are ``a``'s.
* ``d``: ``writer_centering="auto"`` (``normswap.patch(beta_placement="keep", writer_centering="auto")``: the
  LayerScale-scaled writers keep the original's rows behind a centering op, what ``--quantizer pt2e-x86-dynamic``
  writes) against the original with ``qk`` + ``vo`` (round 62).
* ``e``: the attention-output hybrid (``hyb-attn``: the original with the default conversion's centered ``o_proj``
  rows and λ, LayerNorms kept) against the original with ``qk`` + ``vo`` (round 62; ``c``'s counterpart).
* ``b``: the fc2 hybrid (``int8w_dinov2``'s ``hyb-mlp``: the original with the default conversion's centered fc2 rows
  and λ, LayerNorms kept, exact in float) against the original, with ``qk`` + ``vo`` + ``fc2``: round 55's simulated
  claim tested in the engine.

Before any engine run, every re-rounded model (and the hybrid) is checked against the untransformed original in
float32 torch on 8 crops: ``‖Δ‖ / ‖ref‖`` over every output token must be ≤ 1e-5 (``max |Δ| / max |ref|`` is
recorded too: 1-3e-5 for some draws, float32's rounding of the transformed weights), and the draw's transforms alone
in float64 (the model and its re-rounded copy, both float64) ≤ 1e-9; the run stops otherwise.

Errors: ``1 − cos`` of every output token against the float32 original, mean per crop. The ratio over draws is
``Σ_k Σ_i conv[k, i] / Σ_k Σ_i orig[k, i]``; intervals: 95% paired bootstrap, draws and crops resampled
independently (two-way: ``K`` draws with replacement, then ``N`` crops with replacement, the same indices for both
models); also with photographs instead of crops (every crop of a drawn photograph), and over draws alone (crops
fixed). ``--json`` is rewritten after every (pair, draw, model).

    PYTHONPATH=OV:$PWD OMP_NUM_THREADS=1 python benchmarks/nncf_paired_draws.py DINOV2_SMALL --photos PHOTOS \\
        --images 288 --draws 8 --pairs a b --json nncf56_draws.json
    python benchmarks/nncf_paired_draws.py DINOV2_SMALL --photos PHOTOS --from-json nncf56_draws.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PAIRS = {"a": ("original", "native", ("qk", "vo")), "b": ("original", "hyb-mlp", ("qk", "vo", "fc2")),
         "c": ("original", "hyb-mlp", ("qk", "vo")), "d": ("original", "auto", ("qk", "vo")),
         "e": ("original", "hyb-attn", ("qk", "vo"))}
PT2E_BATCH = 8  # pt2e-dyn's batch: X86InductorQuantizer's dynamic scheme takes one activation scale per call


def haar(n: int, gen: torch.Generator) -> torch.Tensor:
    """A Haar-random ``n × n`` orthogonal matrix (float64): QR of a Gaussian matrix, signs fixed by ``R``'s diagonal."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


@torch.no_grad()
def redraw(model: torch.nn.Module, original: torch.nn.Module, seed: int, kinds: tuple[str, ...]) -> torch.nn.Module:
    """A copy of ``model`` (a Dinov2Model, original or converted) re-rounded by draw ``seed``'s ``kinds`` (module
    docstring). The random numbers are drawn in one fixed order from ``seed`` whatever the model, so two models get
    the same transforms (paired); ``original`` gives the fc2 grid step both use. Seed 0: ``model`` unchanged."""
    out = copy.deepcopy(model)
    if seed == 0:
        return out
    gen = torch.Generator().manual_seed(seed)
    heads = out.config.num_attention_heads
    for mine, theirs in zip(out.encoder.layer, original.encoder.layer, strict=True):
        att = mine.attention
        d = att.q_proj.out_features // heads
        for h in range(heads):
            rows = slice(h * d, (h + 1) * d)
            b, a = haar(d, gen), haar(d, gen)  # drawn always, used by kind: the same stream for every model
            if "qk" in kinds:
                for lin in (att.q_proj, att.k_proj):
                    lin.weight[rows] = (b @ lin.weight[rows].double()).to(lin.weight.dtype)
                    lin.bias[rows] = (b @ lin.bias[rows].double()).to(lin.bias.dtype)
            if "vo" in kinds:
                att.v_proj.weight[rows] = (a @ att.v_proj.weight[rows].double()).to(att.v_proj.weight.dtype)
                att.v_proj.bias[rows] = (a @ att.v_proj.bias[rows].double()).to(att.v_proj.bias.dtype)
                att.o_proj.weight[:, rows] = (att.o_proj.weight[:, rows].double() @ a.T).to(att.o_proj.weight.dtype)
        lam0 = theirs.layer_scale2.lambda1.double()
        ref = theirs.mlp.fc2.weight.double() * lam0[:, None]
        step = float(((ref.amax(1) - ref.amin(1)) / 255).median())
        v = step * (2 * torch.rand(ref.shape[1], generator=gen, dtype=torch.float64) - 1)
        perm = torch.randperm(mine.mlp.fc1.out_features, generator=gen)
        if "fc2" in kinds:
            lam = mine.layer_scale2.lambda1.double()
            w = mine.mlp.fc2.weight
            w.copy_((w.double() + v[None, :] / lam[:, None]).to(w.dtype))
        if "perm" in kinds:
            mlp = mine.mlp
            mlp.fc1.weight.copy_(mlp.fc1.weight[perm])
            mlp.fc1.bias.copy_(mlp.fc1.bias[perm])
            mlp.fc2.weight.copy_(mlp.fc2.weight[:, perm])
    return out


class Tokens(torch.nn.Module):
    """Every output token of a Dinov2Model (ExecuTorch's programs take and return plain tensors)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, px: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=px).last_hidden_state


def et_tokens(model: torch.nn.Module, px: torch.Tensor) -> torch.Tensor:
    """``model`` through ExecuTorch's XNNPACK dynamic int8 (``executorch_dinov2.lower``'s ``dyn`` scheme: the
    XNNPACKQuantizer's per-channel symmetric int8 weights, int8 activations at run time), one crop per call, as
    round 55 ran it; every token returned, ``[images, tokens, hidden]``."""
    from executorch_dinov2 import lower

    method, _ = lower(Tokens(model).eval(), px[:1], "dyn", px[:1])  # one forward sets the weight observers
    return torch.cat([method.execute([px[i:i + 1]])[0] for i in range(len(px))]).float()


def pt2e_tokens(model: torch.nn.Module, px: torch.Tensor, compiled: bool = False) -> torch.Tensor:
    """``model`` through PyTorch's PT2E ``X86InductorQuantizer`` dynamic scheme (``x86_inductor_int8.quantize``'s
    ``dyn``: int8 weights symmetric per output channel, activations quantized per tensor at run time), batches of
    :data:`PT2E_BATCH` crops as round 59 ran it; every token returned, ``[images, tokens, hidden]``. Without
    ``compiled`` the converted program runs eagerly: the same integers (weights and activations quantized by the same
    ops), the products summed in float32 instead of oneDNN's int32 (``engine pt2e-dyn``); ``compiled``: Inductor's
    oneDNN int8 kernels (``pt2e-dyn-compiled``, minutes per compile on a loaded core)."""
    from x86_inductor_int8 import quantize

    b = PT2E_BATCH
    program, _ = quantize(Tokens(model).eval(), (px[:b],), "dyn", [(px[:b],)])
    if compiled:
        program = torch.compile(program)
    with torch.inference_mode():
        return torch.cat([program(px[i:i + b]) for i in range(0, len(px), b)]).float()


def build(name: str, original: torch.nn.Module) -> torch.nn.Module:
    """``original``, ``native`` (the default conversion, in memory), ``auto`` (the same with
    ``writer_centering="auto"``) or ``hyb-mlp`` / ``hyb-attn`` (the original with the converted fc2 / attention output
    rows and λ: the default conversion's weight, bias and layer scale as ``--format compat`` writes them, the
    LayerNorms kept)."""
    import normswap

    if name == "original":
        return original
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv = copy.deepcopy(original)
        normswap.patch(conv, beta_placement="keep", **({"writer_centering": "auto"} if name == "auto" else {}))
        if name in ("native", "auto"):
            return conv
        import transformers as tf
        from int8w_dinov2 import HYBRIDS, hybrid

        with tempfile.TemporaryDirectory() as tmp:
            normswap.save(conv, Path(tmp) / "compat", format="compat", overwrite=True)
            compat = tf.Dinov2Model.from_pretrained(Path(tmp) / "compat").eval()
        return hybrid(original, compat, HYBRIDS[name.removeprefix("hyb-")])


@torch.no_grad()
def check_exact(model: torch.nn.Module, ref: torch.Tensor, px: torch.Tensor, label: str, tol: float = 1e-5,
                base: torch.nn.Module | None = None, redo: Any = None) -> dict[str, float]:
    """``model``'s outputs against ``ref`` (the float32 original's) on ``px``: ``‖Δ‖ / ‖ref‖`` over every output token
    in float32 must be ≤ ``tol`` (the run stops otherwise; ``max`` is ``max |Δ| / max |ref|``, recorded). With
    ``base`` and ``redo`` (``redo(m)`` re-applies the draw's transforms to ``m``), the transforms alone are also
    checked in float64: ``redo(base.double())`` against ``base.double()``, ≤ 1e-9 (float32 rounds the transformed
    weights, which is the 1e-6 noise of the first check; float64 shows the transform itself is exact)."""
    out = model(pixel_values=px).last_hidden_state
    rel = float((out - ref).norm() / ref.norm())
    found = {"rel": rel, "max": float((out - ref).abs().max() / ref.abs().max())}
    if not rel <= tol:
        raise SystemExit(f"{label}: not exact, ‖Δ‖ / ‖ref‖ = {rel:.2e} > {tol:g}")
    if base is not None:
        b64 = copy.deepcopy(base).double()
        a = b64(pixel_values=px.double()).last_hidden_state
        b = redo(b64)(pixel_values=px.double()).last_hidden_state
        found["rel64"] = float((b - a).norm() / a.norm())
        if not found["rel64"] <= 1e-9:
            raise SystemExit(f"{label}: the transform is not exact in float64, ‖Δ‖ / ‖ref‖ = {found['rel64']:.2e}")
    return found


def bootstrap(conv: Any, orig: Any, photo: list[str] | None, draws: int = 4000, mode: str = "crops",
              seed: int = 0) -> tuple[float, float, float]:
    """``Σ conv / Σ orig`` over ``[K draws, N crops]`` arrays with a 95% paired two-way bootstrap: draws resampled
    with replacement and, independently, crops (``mode="crops"``), whole photographs (``"photos"``, ``photo`` the
    crops' photograph names) or nothing (``"draws"``); the same indices for both models."""
    import numpy as np

    conv, orig = np.asarray(conv), np.asarray(orig)
    k, n = conv.shape
    rng = np.random.default_rng(seed)
    groups = None
    if mode == "photos":
        names = sorted(set(photo))
        groups = [np.flatnonzero(np.array(photo) == p) for p in names]
    ratios = np.empty(draws)
    for t in range(draws):
        kk = rng.integers(0, k, k)
        if mode == "crops":
            ii = rng.integers(0, n, n)
        elif mode == "photos":
            ii = np.concatenate([groups[j] for j in rng.integers(0, len(groups), len(groups))])
        else:
            ii = np.arange(n)
        ratios[t] = conv[np.ix_(kk, ii)].sum() / orig[np.ix_(kk, ii)].sum()
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(conv.sum() / orig.sum()), float(lo), float(hi)


def draw_rows(done: list[int], o: Any, c: Any) -> list[str]:
    """A Markdown table, one row per draw: both models' mean errors (``o``, ``c``: ``[draws, inputs]``), their
    ratio, and the original's error against its first listed (shipped) draw. Shared with
    ``nncf_encoder_draws.py``."""
    lines = ["| draw | original's error | converted's error | ratio | original / its shipped draw |",
             "|---|---|---|---|---|"]
    for j, k in enumerate(done):
        lines.append(f"| {k} | {o[j].mean():.4e} | {c[j].mean():.4e} | {c[j].mean() / o[j].mean():.3f} | "
                     f"{o[j].mean() / o[0].mean():.3f} |")
    return lines


def report(result: dict[str, Any], metric: str = "tok") -> str:
    """Per pair: each draw's errors and ratio, and the ratio over draws with its intervals."""
    import numpy as np

    lines = [f"{result['images']} crops at {result['image']} px, engine {result['engine']}, 1 − cos ({metric})"]
    for pair, (base, other, kinds) in PAIRS.items():
        rows = result["pairs"].get(pair, {})
        done = sorted(int(k) for k in rows if base in rows[k] and other in rows[k])
        if not done:
            continue
        o = np.array([rows[str(k)][base][metric] for k in done])
        c = np.array([rows[str(k)][other][metric] for k in done])
        lines += ["", f"pair {pair}: {other} / {base}, re-rounded by {' + '.join(kinds)}; draws {done}", "",
                  *draw_rows(done, o, c)]
        per = c.mean(1) / o.mean(1)
        for label, sel in (("every draw", slice(None)), ("re-roundings only (draw 0 left out)", slice(1, None))):
            cc, oo = c[sel], o[sel]
            if len(cc) < 2:
                continue
            r, lo, hi = bootstrap(cc, oo, result.get("photo"), mode="crops")
            _, plo, phi = bootstrap(cc, oo, result.get("photo"), mode="photos")
            _, dlo, dhi = bootstrap(cc, oo, result.get("photo"), mode="draws")
            lines.append(f"\n- {label} ({len(cc)}): ratio {r:.3f}; draws × crops resampled {lo:.3f}-{hi:.3f}; "
                         f"draws × photographs {plo:.3f}-{phi:.3f}; draws alone {dlo:.3f}-{dhi:.3f}; geometric mean "
                         f"of per-draw ratios {np.exp(np.log(per[sel]).mean()):.3f}; per draw "
                         f"{per[sel].min():.3f}-{per[sel].max():.3f}; original's draws / its mean "
                         f"{(oo.mean(1) / oo.mean()).min():.3f}-{(oo.mean(1) / oo.mean()).max():.3f}; "
                         f"converted's {(cc.mean(1) / oo.mean()).min():.3f}-{(cc.mean(1) / oo.mean()).max():.3f} "
                         "of the original's mean")
    checks = [v for v in result.get("exactness", {}).values() if isinstance(v, dict)]
    if checks:
        lines.append(f"\nexactness before compression ({len(checks)} models, 8 crops, float32 against the original): "
                     f"‖Δ‖/‖ref‖ ≤ {max(c['rel'] for c in checks):.1e}, max |Δ| / max |ref| ≤ "
                     f"{max(c['max'] for c in checks):.1e}; the transforms alone in float64 ≤ "
                     f"{max(c.get('rel64', 0.0) for c in checks):.1e}")
    if result.get("perm"):
        p = result["perm"]
        a, b = np.array(p["shipped"][metric]), np.array(p["permuted"][metric])
        lines.append(f"\nMLP neurons permuted ({p['variant']}, seed {p['seed']}): {b.mean():.4e} against "
                     f"{a.mean():.4e} shipped, ratio {b.mean() / a.mean():.4f}; per-crop max |Δ| / value "
                     f"{np.max(np.abs(b - a) / a):.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="the original Dinov2Model directory")
    ap.add_argument("--photos", type=Path, required=True)
    ap.add_argument("--calib-photos", default="motorcycle_right.png,gravel.png,brick.png")
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--images", type=int, default=288)
    ap.add_argument("--draws", type=int, default=8, help="re-roundings K (seeds 1..K); draw 0, the shipped pair, too")
    ap.add_argument("--first", type=int, default=0, help="the first draw (to run the draws in two processes)")
    ap.add_argument("--pairs", nargs="+", default=["a", "b"], choices=tuple(PAIRS))
    ap.add_argument("--resume", type=Path, help="start from this --json file's rows (another run's: what it measured "
                    "is not measured again)")
    ap.add_argument("--engine", default="ov-w8", help="int8w_dinov2's engine names (ov-w8, ov-w8-noact, "
                    "sim-asym8h), et-dyn: ExecuTorch's XNNPACK dynamic int8 (:func:`et_tokens`), or pt2e-dyn / "
                    "pt2e-dyn-compiled: PT2E X86InductorQuantizer's dynamic int8 (:func:`pt2e_tokens`)")
    ap.add_argument("--perm-check", metavar="VARIANT", help="instead: VARIANT shipped and with its MLP neurons "
                    "permuted (seed 1), through the engine")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--from-json", type=Path, nargs="+", help="no measuring: the report of earlier runs "
                    "(merged; with --json, written there merged)")
    args = ap.parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json[0].read_text())
        for extra in args.from_json[1:]:
            more = json.loads(extra.read_text())
            for pair, draws in more.get("pairs", {}).items():
                for k, row in draws.items():
                    result["pairs"].setdefault(pair, {}).setdefault(k, {}).update(row)
            result["perm"] = result.get("perm") or more.get("perm")
            result["exactness"].update(more.get("exactness", {}))
        if args.json:  # the runs merged into one file
            args.json.write_text(json.dumps(result))
        print(report(result, "tok") + "\n\n" + report(result, "cls"))
        return result
    import transformers as tf
    from int8w_dinov2 import engine_tokens, errors, tokens_out
    from photo_crops import photo_crops, photographs

    torch.set_num_threads(1)
    held_out = args.calib_photos.split(",")
    px = photo_crops(args.photos, args.images, args.image, seed=1, exclude=held_out)
    files = photographs(args.photos, held_out)
    photo = [files[i].name for i, _ in enumerate(files)
             for _ in range(args.images // len(files) + (1 if i < args.images % len(files) else 0))]
    original = tf.Dinov2Model.from_pretrained(args.model).eval()
    ref = tokens_out(original, px)
    with torch.no_grad():
        ref8 = original(pixel_values=px[:8]).last_hidden_state
    result: dict[str, Any] = {"model": str(args.model), "image": args.image, "images": len(px), "photo": photo,
                              "engine": args.engine, "pairs": {}, "exactness": {}}
    start = args.resume or args.json
    if start and start.exists():  # resume: keep what an earlier run measured
        result = json.loads(start.read_text())
        if (result["engine"], result["images"], result["image"]) != (args.engine, len(px), args.image):
            raise SystemExit(f"{start}: measured with other settings ({result['engine']}, {result['images']} crops)")
    bases = {name: build(name, original) for name in {n for p in args.pairs for n in PAIRS[p][:2]}}
    for name, model in bases.items():
        result["exactness"][f"{name}|0"] = check_exact(model, ref8, px[:8], name)

    def measure(model: torch.nn.Module, work: Path) -> dict[str, list[float]]:
        if args.engine == "et-dyn":
            out = et_tokens(model, px)
        elif args.engine.startswith("pt2e-dyn"):
            out = pt2e_tokens(model, px, compiled=args.engine == "pt2e-dyn-compiled")
        else:
            out = engine_tokens(model, args.engine, px, work)
        err = errors(ref, out)
        return {"tok": [float(f"{v:.5g}") for v in err.mean(1)], "cls": [float(f"{v:.5g}") for v in err[:, 0]]}

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.perm_check:
            model = bases.get(args.perm_check) or build(args.perm_check, original)
            permuted = redraw(model, original, 1, ("perm",))
            result["exactness"][f"{args.perm_check}|perm"] = check_exact(
                permuted, ref8, px[:8], "perm", base=model, redo=lambda m: redraw(m, original, 1, ("perm",)))
            result["perm"] = {"variant": args.perm_check, "seed": 1, "shipped": measure(model, work),
                              "permuted": measure(permuted, work)}
            if args.json:
                args.json.write_text(json.dumps(result))
            print(report(result))
            return result
        for k in range(args.first, args.draws + 1):
            for pair in args.pairs:
                base, other, kinds = PAIRS[pair]
                row = result["pairs"].setdefault(pair, {}).setdefault(str(k), {})
                for name in (base, other):
                    if name in row:
                        continue
                    shared = [r[str(k)][name] for q, r in result["pairs"].items() if q != pair
                              and (k == 0 or PAIRS[q][2] == kinds) and name in r.get(str(k), {})]
                    if shared:  # the same model re-rounded the same way in another pair (draw 0: shipped): once
                        row[name] = shared[0]
                        continue
                    t0 = time.perf_counter()
                    model = redraw(bases[name], original, k, kinds)
                    result["exactness"][f"{pair}|{name}|{k}"] = check_exact(
                        model, ref8, px[:8], f"{name} draw {k}", base=bases[name],
                        redo=lambda m, k=k, kinds=kinds: redraw(m, original, k, kinds))
                    row[name] = measure(model, work)
                    print(f"pair {pair} draw {k} {name:8s} tok {sum(row[name]['tok']) / len(px):.4e} "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)
                    if args.json:
                        args.json.write_text(json.dumps(result))
    print(report(result))
    return result


if __name__ == "__main__":
    main()
