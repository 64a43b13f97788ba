"""Learn a rotation for 4-bit block-wise weights on a real DINOv2, from a chosen Hadamard start, saving as it goes.

``normswap.patch(model, fold_gamma=True)`` then ``normswap.rotate(model, "learned", seed=S, output="restore",
bits=4, group_size=32, grid=G, ...)`` on crops of the calibration photographs (``motorcycle_right``, ``gravel``,
``brick``; no held-out crop of ``bench_quant_engines.py --photos`` comes from them). The learning starts from the
better, on those crops, of the Hadamard with signs of seed ``S`` and no turn; ``--select-seeds N`` first scores
the Hadamards of seeds ``0..N-1`` with the learning's own loss (every Linear rounded on the grid) and starts
from the best.

A learning run on a shared CPU takes tens of minutes, so every check (a tenth of the run) writes the best
matrix so far to ``OUT/q.pt`` (a float64 ``d × d`` tensor: ``x → x @ Q``, a user ``q`` for ``normswap.rotate``)
and the losses to ``OUT/progress.json``; an interrupted run keeps its best so far. Measure a saved matrix in
ONNX Runtime with ``bench_quant_engines.py --q-files NAME=OUT/q.pt``.

    python benchmarks/dinov2_learned_rotation.py --model /tmp/held46/dinov2-focus \\
        --photos /tmp/held46/dl/skimage/skimage/data --seed 2 --grid full --steps 100 --out learned-rtn
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from photo_crops import photo_crops, photographs  # noqa: E402

CALIB = ("motorcycle_right.png", "gravel.png", "brick.png")


def calibration(photos: Path, n: int, size: int, batch: int) -> list[dict[str, torch.Tensor]]:
    """``n`` crops of the calibration photographs (seed 3, as ``bench_quant_engines.py``'s learning crops)."""
    shots = photo_crops(n=n, size=size, seed=3, files=[p for p in photographs(photos) if p.name in CALIB])
    return [{"pixel_values": b} for b in shots.split(batch)]


def learn(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], out: Path, seed: int, grid: str,
          steps: int, lr: float) -> dict[str, Any]:
    """The learned rotation from the seed-``seed`` Hadamard (or no turn, whichever the loss prefers), its best
    matrix written to ``out/q.pt`` at every check."""
    import normswap

    out.mkdir(parents=True, exist_ok=True)
    conv = copy.deepcopy(model)
    log: dict[str, Any] = {"seed": seed, "grid": grid, "steps": steps, "lr": lr, "checks": []}

    def save(p: Any) -> None:
        (q,) = p.best.values()  # one stream: the backbone's
        torch.save(q, out / "q.pt")
        log["start"] = p.start
        log["checks"].append({"step": p.step, "score": p.score, "best": p.best_loss, "seconds": p.seconds})
        log["history"] = p.history
        (out / "progress.json").write_text(json.dumps(log, indent=1))
        print(f"  step {p.step}/{p.steps} ({p.start} start): score {p.score:.4e}, best {p.best_loss:.4e}, "
              f"{p.seconds:.0f} s", flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(conv, fold_gamma=True)
        r = normswap.rotate(conv, "learned", seed=seed, output="restore", calibration=batches, bits=4, group_size=32,
                            grid=grid, steps=steps, lr=lr, progress=save)
    (q,) = r.matrices.values()
    torch.save(q, out / "q.pt")
    log["learned"] = r.learned.record()
    log["headline"] = r.learned.headline()
    log["history"] = r.learned.history
    (out / "progress.json").write_text(json.dumps(log, indent=1))
    print(r.learned.headline(), flush=True)
    return log


@torch.no_grad()
def seed_scores(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], seeds: int, grid: str) -> list[float]:
    """The learning's loss (every Linear rounded on ``grid``, relative squared output error) for the Hadamards of
    seeds ``0..seeds-1`` and, last, for no turn: what the learned rotation would start from."""
    import normswap
    from normswap.rotation.learn import fake_quant, output_error

    refs = [model(**b).last_hidden_state for b in batches]
    d = model.config.hidden_size
    scores = []
    for seed in [*range(seeds), None]:
        conv = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            normswap.patch(conv, fold_gamma=True)
            q = torch.eye(d, dtype=torch.float64) if seed is None else "hadamard"
            normswap.rotate(conv, q, seed=seed or 0, output="restore")
        for m in conv.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(fake_quant(m.weight, 4, 1, 32, grid))
        loss = sum(float(output_error(conv(**b).last_hidden_state, ref, False, None))
                   for b, ref in zip(batches, refs, strict=True)) / len(batches)
        print(f"  {'no turn' if seed is None else f'seed {seed}'}: {loss:.4e}", flush=True)
        scores.append(loss)
    return scores


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import transformers as tf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a Dinov2Model directory")
    ap.add_argument("--photos", type=Path, required=True, help="scikit-image's skimage/data")
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--learn-images", type=int, default=16, help="calibration crops (of the calibration photographs)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=2, help="the start Hadamard's signs")
    ap.add_argument("--select-seeds", type=int, default=0, help="score the Hadamards of seeds 0..N-1 on the "
                    "learning's loss first and start from the best (--seed is then ignored)")
    ap.add_argument("--grid", default="full", help="full (MatMulNBits RTN), asymmetric (HQQ's start), or joined by +")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--out", type=Path, required=True, help="folder for q.pt and progress.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = tf.Dinov2Model.from_pretrained(args.model).eval()
    batches = calibration(args.photos, args.learn_images, args.image, args.batch)
    seed = args.seed
    t0 = time.perf_counter()
    if args.select_seeds:
        scores = seed_scores(model, batches, args.select_seeds, args.grid.split("+")[0])
        seed = min(range(args.select_seeds), key=scores.__getitem__)
        print(f"start: seed {seed}", flush=True)
    log = learn(model, batches, args.out, seed, args.grid, args.steps, args.lr)
    log["total_seconds"] = time.perf_counter() - t0
    (args.out / "progress.json").write_text(json.dumps(log, indent=1))
    return log


if __name__ == "__main__":
    main()
