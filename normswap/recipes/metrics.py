"""Held-out evaluation (student vs teacher), the ``metrics.jsonl`` log, and the loss/metric plot.

Which metrics a task reports, and how each is computed, is the task's business
(:mod:`normswap.recipes.tasks`, where the definitions are listed); this module runs the batches,
sums across processes, and records and draws the results.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.recipes import tasks


@torch.no_grad()
def evaluate(
    student: nn.Module,
    teacher: nn.Module | None,
    batches: list[dict[str, torch.Tensor]],
    task: str,
    pooling: str = "mean",
    device: torch.device | None = None,
    reduce: Any = None,
    autocast: Any = None,
) -> dict[str, float]:
    """Metrics of ``student`` (vs ``teacher``) over ``batches``; ``reduce`` sums across processes."""
    spec = tasks.get(task)
    was_training = student.training
    student.eval()
    acc = dict.fromkeys(spec.accumulators, 0.0)
    ctx = autocast if autocast is not None else contextlib.nullcontext
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()} if device is not None else batch
        inputs = tasks.model_inputs(batch)
        with ctx():
            s_out = student(**inputs)
            t_out = teacher(**inputs) if teacher is not None else None
        spec.accumulate(acc, s_out, t_out, batch, pooling)
    student.train(was_training)
    spec.close(acc)
    vec = torch.tensor([acc[k] for k in spec.accumulators], dtype=torch.float64, device=device)
    if reduce is not None:
        vec = reduce(vec)
    return spec.finish(dict(zip(spec.accumulators, vec.tolist(), strict=True)), teacher is not None)


def headline(metrics: dict[str, float]) -> str:
    """A short one-line rendering for the console."""
    keys = [k for k in ("kl", "top1_agreement", "top5_agreement", "cosine", "top1_neighbour_agreement",
                        "recall_at_10", "hidden_rel_mse", "ppl", "ppl_ratio") if k in metrics]
    return ", ".join(f"{k}={metrics[k]:.4g}" for k in keys)


class MetricsLog:
    """Append-only ``metrics.jsonl``; one JSON object per line with ``step`` and ``split``."""

    def __init__(self, path: str | Path, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write(json.dumps(record, default=float) + "\n")

    def truncate_after(self, step: int) -> None:
        """On resume: drop records written after the checkpoint (they will be written again)."""
        if not self.enabled or not self.path.is_file():
            return
        keep = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        self.path.write_text("".join(line + "\n" for line in keep))

    def records(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def plot(records: list[dict[str, Any]], out: str | Path, title: str = "") -> str | None:
    """Loss and metric curves to a PNG; returns the path, or None (with the reason logged) if skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("normswap: matplotlib is not installed; skipping the plot (pip install matplotlib)")
        return None
    train = [r for r in records if r.get("split") == "train" and "loss" in r]
    evals = [r for r in records if r.get("split") == "eval"]
    panels: list[tuple[str, list[str], bool]] = [("training loss", ["loss"], True)]
    keys = [k for k in ("kl", "kl_masked", "hidden_rel_mse") if any(k in r for r in evals)]
    if keys:
        panels.append(("held-out divergence from teacher", keys, True))
    ppls = [k for k in ("ppl", "teacher_ppl") if any(k in r for r in evals)]
    if ppls:
        panels.append(("held-out perplexity", ppls, False))
    sims = [k for k in ("top1_agreement", "top1_agreement_masked", "cosine") if any(k in r for r in evals)]
    if sims:
        panels.append(("held-out agreement with teacher", sims, False))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False)
    for ax, (name, ks, logy) in zip(axes[0], panels, strict=True):
        src = train if name == "training loss" else evals
        for k in ks:
            pts = [(r["step"], r[k]) for r in src if k in r and r[k] == r[k] and r[k] is not None]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="." if len(pts) < 60 else None, label=k)
        if logy and any(ax.get_lines()):
            ys = [y for line in ax.get_lines() for y in line.get_ydata()]
            if min(ys) > 0:
                ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(str(out), dpi=110)
    plt.close(fig)
    return str(out)
