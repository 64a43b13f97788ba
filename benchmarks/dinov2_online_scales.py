"""Per-channel scales between each norm and its readers, learned against the 4-bit rounding, on top of the online
Hadamards (DINOv2-small, a benchmark experiment; nothing here is in the product).

Round 51 left the readers' rounding as what remains of DINOv2-small's 4-bit error once the online ops are in
(``rotate(model, "none", online=True, smooth=0.5)``): SmoothQuant's formula picks each norm's scale ``s`` from
activation and weight maxima alone. Here a further scale ``t`` per norm channel (geometric mean 1) is learned on
the calibration crops against the model's output error with every Linear's weight rounded as ONNX Runtime's
``MatMulNBits`` RTN rounds it (4 bits, blocks of 32, the ``full`` grid; straight-through estimator): the norm's γ
and β ``/ t``, its readers' input columns ``× t`` before the op, i.e. with the op ``M`` in place the reader's
weight ``W' Mᵀ diag(t) M``. Exact for any ``t`` (the float model is unchanged); the scales are saved per norm
(``torch.save``), and ``bench_quant_engines.py --online-edits smooth-0.5 scales=PATH`` builds the same model
(the edit applied before the ops, which is the same function and the same weights).

The start is ``dinov2_rotation_groups.build(model, START)`` (default ``online+smooth-0.5``); the loss is
``1 − cos`` of every token's output against the float model, mean over the batch. The held-out check is the
float simulation of the same rounding (every Linear) on ``--images`` crops of the held-out photographs, start
and learned, as a ratio to the original's.

    python benchmarks/dinov2_online_scales.py --model DINOV2_SMALL --photos SKIMAGE/data --steps 100 \
        --out scales.pt --json learn.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dinov2_rotation_groups as drg  # noqa: E402
from photo_crops import photo_crops, photographs  # noqa: E402

from normswap.rotation.learn import fake_quant  # noqa: E402


def op_matrix(conv: torch.nn.Module, norm: str, readers: list[str]) -> torch.Tensor:
    """The online op after ``norm`` as a matrix ``M`` (row vectors: ``u = z M``), float64: the op applied to the
    identity, from the norm's output hook or, where each reader has its own op, the first reader's pre-hook."""
    for path, hooks in ((norm, "_forward_hooks"), (readers[0], "_forward_pre_hooks")):
        module = conv.get_submodule(path)
        handle = getattr(module, "_normswap_online", None)
        if handle is not None:
            hook = getattr(module, hooks)[handle.id]
            n = module.weight.shape[-1] if hooks == "_forward_pre_hooks" else module.weight.shape[0]
            with torch.no_grad():
                return hook.transform(module, torch.eye(n, dtype=torch.float64))
    raise SystemExit(f"no online op after {norm}")


def main(argv: list[str] | None = None) -> None:
    import transformers as tf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--photos", type=Path, required=True)
    ap.add_argument("--start", default="online+smooth-0.5", help="dinov2_rotation_groups variant to start from")
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--images", type=int, default=64, help="held-out crops of the simulated check")
    ap.add_argument("--calib", type=int, default=32, help="calibration crops (the smoothing's and the learning's)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--grid", default="full", help="fake_quant grid(s), joined by + (full+asymmetric: both)")
    ap.add_argument("--out", type=Path, required=True, help="the learned scales, {norm: t} (torch.save)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tf.Dinov2Model.from_pretrained(args.model).eval()
    calib = photo_crops(n=args.calib, size=args.image, seed=3,
                        files=[p for p in photographs(args.photos) if p.name in drg.CALIB])
    px = photo_crops(args.photos, args.images, args.image, seed=1, exclude=drg.CALIB)
    conv = drg.build(model, args.start, calib)
    for p in conv.parameters():
        p.requires_grad_(False)
    pairs = drg.norm_readers(conv)
    mats = {n: op_matrix(conv, n, rd) for n, rd in pairs.items()}
    state = dict(conv.named_parameters())
    base = {r: (state[f"{r}.weight"].double() @ mats[n].T).float() for n, rd in pairs.items() for r in rd}
    mats32 = {n: m.float() for n, m in mats.items()}
    lins = [n for n, m in conv.named_modules() if isinstance(m, torch.nn.Linear)]
    logs = {n: torch.zeros(mats[n].shape[0], requires_grad=True) for n in pairs}
    opt = torch.optim.Adam(list(logs.values()), lr=args.lr)
    grids = args.grid.split("+")
    with torch.no_grad():
        refs = [drg.outputs(model, b)[1] for b in calib.split(args.batch)]

    def params(grid: str) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for n, rd in pairs.items():
            t = (logs[n] - logs[n].mean()).exp()
            out[f"{n}.weight"] = state[f"{n}.weight"] / t
            out[f"{n}.bias"] = state[f"{n}.bias"] / t
            for r in rd:
                out[f"{r}.weight"] = (base[r] * t) @ mats32[n]
        for name in lins:
            w = out.get(f"{name}.weight", state[f"{name}.weight"])
            out[f"{name}.weight"] = fake_quant(w, 4, 1, 32, grid)
        return out

    def loss_on(i: int, grid: str) -> torch.Tensor:
        got = torch.func.functional_call(conv, params(grid), (), {"pixel_values": calib.split(args.batch)[i]})
        return (1 - torch.nn.functional.cosine_similarity(got.last_hidden_state, refs[i], dim=-1)).mean()

    batches = len(refs)
    with torch.no_grad():
        start = statistics.fmean(float(loss_on(i, g)) for i in range(batches) for g in grids)
    print(f"start: calibration loss {start:.4e}", flush=True)
    t0 = time.time()
    history = []
    for step in range(args.steps):
        opt.zero_grad()
        loss = sum(loss_on(step % batches, g) for g in grids) / len(grids)
        loss.backward()
        opt.step()
        history.append(float(loss))
        if step % 10 == 9:
            print(f"step {step + 1}: loss {statistics.fmean(history[-10:]):.4e} ({time.time() - t0:.0f} s)", flush=True)
    with torch.no_grad():
        end = statistics.fmean(float(loss_on(i, g)) for i in range(batches) for g in grids)
    print(f"learned: calibration loss {end:.4e} ({end / start:.3f} of the start)", flush=True)
    scales = {n: (v - v.mean()).exp().detach().double() for n, v in logs.items()}
    torch.save(scales, args.out)
    spread = [float(s.max() / s.min()) for s in scales.values()]
    print(f"scales: max/min per norm, median {statistics.median(spread):.2f}, max {max(spread):.2f}", flush=True)
    # the held-out check: simulated RTN of every Linear, original / start / learned
    drg.GRID.update(grid=grids[0], group_size=32)
    ref = drg.outputs(model, px)
    learned = drg.build(model, args.start, calib)
    for n, rd in pairs.items():  # the same edit the product-side replay makes: before the ops, t on γ, β, columns
        apply_after_ops_(learned, n, rd, scales[n], mats[n])
    check = drg.errors(ref, drg.outputs(learned, px))
    print(f"learned model, float: tok {statistics.fmean(check['tok']):.1e} (exactness)", flush=True)
    rows = {}
    for name, m in (("original", model), ("start", drg.build(model, args.start, calib)), ("learned", learned)):
        rows[name] = drg.group_errors(m, px, ref, ["all"])["all"]
    result = {"start": args.start, "steps": args.steps, "lr": args.lr, "grid": args.grid,
              "calibration_loss": [start, end], "history": history, "rows": rows}
    for name in ("start", "learned"):
        for metric in ("tok", "cls"):
            r = drg.ratio_ci(rows[name][metric], rows["original"][metric])
            result[f"{name}_{metric}"] = r
            print(f"{name:8s} {metric}: {r[0]:.3f} ({r[1]:.2f}-{r[2]:.2f}) of the original", flush=True)
    r = drg.ratio_ci(rows["learned"]["tok"], rows["start"]["tok"])
    result["learned_over_start_tok"] = r
    print(f"learned / start, tok: {r[0]:.3f} ({r[1]:.2f}-{r[2]:.2f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result))


@torch.no_grad()
def apply_after_ops_(conv: torch.nn.Module, norm: str, readers: list[str], t: torch.Tensor, m: torch.Tensor) -> None:
    """``t`` between ``norm`` and its readers with the op ``m`` in place: γ and β ``/ t``, each reader's weight
    ``W Mᵀ diag(t) M`` (float64, cast back once)."""
    module = conv.get_submodule(norm)
    for p in (module.weight, module.bias):
        p.copy_((p.double() / t).to(p.dtype))
    for r in readers:
        w = conv.get_submodule(r).weight
        w.copy_((((w.double() @ m.T) * t) @ m).to(w.dtype))


if __name__ == "__main__":
    main()
