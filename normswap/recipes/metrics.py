"""Held-out metrics (student vs teacher), the ``metrics.jsonl`` log, and the loss/metric plot.

Metrics per task (all on the held-out split, eval mode, no grad):

* causal-lm: ``kl`` (mean per-token KL(teacher ‖ student) at T=1), ``top1_agreement``,
  ``top5_agreement`` (the teacher's top-1 token is among the student's top 5), ``ppl`` (student
  perplexity on next tokens), ``teacher_ppl`` and ``ppl_ratio`` (student / teacher).
* masked-lm: ``kl``, ``top1_agreement`` and ``top5_agreement`` over every real token, ``kl`` and
  ``top1_agreement`` over the masked positions only (``*_masked``), masked-token ``ppl`` /
  ``teacher_ppl`` / ``ppl_ratio``.
* encoder: ``cosine`` (mean cosine similarity of pooled sentence embeddings), ``hidden_rel_mse``
  (per-token ``‖s − t‖² / ‖t‖²`` of the final hidden states) and what a retrieval user sees, over
  the held-out sentences as one collection: ``top1_neighbour_agreement`` (each sentence's nearest
  other sentence is the same as with the teacher), ``recall_at_10`` (share of the teacher's 10
  nearest neighbours among the student's) and ``similarity_spearman`` (rank correlation of all
  pairwise similarities). Under data parallelism these three are computed on each process's share
  and averaged.

Without a teacher only the student's ``ppl`` is reported.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.calibrate import neighbour_figures
from normswap.recipes import losses

MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k in MODEL_KEYS}


def logits_of(out: Any) -> torch.Tensor:
    """The logits of a model output (``.logits`` or the first element)."""
    return out.logits if hasattr(out, "logits") else out[0]


def hidden_of(out: Any) -> torch.Tensor:
    """The final hidden states of a model output (``.last_hidden_state`` or the first element)."""
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


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
    was_training = student.training
    student.eval()
    names = {
        "causal-lm": ["kl", "agree", "agree5", "n", "ce", "tce", "n_ce"],
        "masked-lm": ["kl", "agree", "agree5", "n", "kl_m", "agree_m", "n_m", "ce", "tce"],
        "encoder": ["cos", "n_seq", "mse", "n", "top1_nb", "recall10", "spearman", "n_proc"],
    }[task]
    acc = dict.fromkeys(names, 0.0)
    pooled_s: list[torch.Tensor] = []
    pooled_t: list[torch.Tensor] = []
    ctx = autocast if autocast is not None else _null
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()} if device is not None else batch
        inputs = model_inputs(batch)
        mask = batch["attention_mask"].bool()
        with ctx():
            s_out = student(**inputs)
            t_out = teacher(**inputs) if teacher is not None else None
        if task == "encoder":
            s_h, t_h = hidden_of(s_out).float(), hidden_of(t_out).float()
            s_p, t_p = (
                losses.pool(s_h, batch["attention_mask"], pooling),
                losses.pool(t_h, batch["attention_mask"], pooling),
            )
            acc["cos"] += float(torch.nn.functional.cosine_similarity(s_p, t_p, dim=-1).sum())
            acc["n_seq"] += s_p.shape[0]
            pooled_s.append(s_p.double().cpu())
            pooled_t.append(t_p.double().cpu())
            per_tok = (s_h - t_h).pow(2).sum(-1) / t_h.pow(2).sum(-1).clamp_min(1e-12)
            acc["mse"] += float(per_tok[mask].sum())
            acc["n"] += float(mask.sum())
            continue
        s_log = logits_of(s_out).float()
        t_log = logits_of(t_out).float() if t_out is not None else None
        labels = batch.get("labels")
        if task == "causal-lm":
            sel = mask
            if t_log is not None:
                acc["kl"] += float(losses.token_kl(s_log, t_log)[sel].sum())
                acc["agree"] += float((s_log.argmax(-1) == t_log.argmax(-1))[sel].sum())
                acc["agree5"] += float(_in_top5(s_log, t_log)[sel].sum())
            acc["n"] += float(sel.sum())
            ce_labels = labels[:, 1:].reshape(-1)
            acc["ce"] += float(
                torch.nn.functional.cross_entropy(
                    s_log[:, :-1].reshape(-1, s_log.shape[-1]), ce_labels, ignore_index=-100, reduction="sum"
                )
            )
            if t_log is not None:
                acc["tce"] += float(
                    torch.nn.functional.cross_entropy(
                        t_log[:, :-1].reshape(-1, t_log.shape[-1]),
                        ce_labels,
                        ignore_index=-100,
                        reduction="sum",
                    )
                )
            acc["n_ce"] += float((ce_labels != -100).sum())
        else:
            masked = labels != -100
            if t_log is not None:
                kl = losses.token_kl(s_log, t_log)
                agree = s_log.argmax(-1) == t_log.argmax(-1)
                acc["kl"] += float(kl[mask].sum())
                acc["agree"] += float(agree[mask].sum())
                acc["agree5"] += float(_in_top5(s_log, t_log)[mask].sum())
                acc["kl_m"] += float(kl[masked].sum())
                acc["agree_m"] += float(agree[masked].sum())
                acc["tce"] += float(
                    torch.nn.functional.cross_entropy(
                        t_log.reshape(-1, t_log.shape[-1]),
                        labels.reshape(-1),
                        ignore_index=-100,
                        reduction="sum",
                    )
                )
            acc["n"] += float(mask.sum())
            acc["n_m"] += float(masked.sum())
            acc["ce"] += float(
                torch.nn.functional.cross_entropy(
                    s_log.reshape(-1, s_log.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
                )
            )
    student.train(was_training)
    if task == "encoder" and pooled_t:
        nb = neighbour_figures(torch.cat(pooled_t), torch.cat(pooled_s))
        if nb:
            acc["top1_nb"], acc["recall10"] = nb["top1_neighbour_agreement"], nb["recall_at_10"]
            acc["spearman"], acc["n_proc"] = nb["similarity_spearman"], 1.0
    vec = torch.tensor([acc[k] for k in names], dtype=torch.float64, device=device)
    if reduce is not None:
        vec = reduce(vec)
    acc = dict(zip(names, vec.tolist(), strict=True))
    return _finish(acc, task, teacher is not None)


def _finish(acc: dict[str, float], task: str, has_teacher: bool) -> dict[str, float]:
    def div(a: float, b: float) -> float:
        return a / b if b else float("nan")

    def ppl(ce: float, n: float) -> float:
        return math.exp(min(div(ce, n), 50.0)) if n else float("nan")

    if task == "encoder":
        out = {"cosine": div(acc["cos"], acc["n_seq"]), "hidden_rel_mse": div(acc["mse"], acc["n"])}
        if acc.get("n_proc"):
            out.update({"top1_neighbour_agreement": div(acc["top1_nb"], acc["n_proc"]),
                        "recall_at_10": div(acc["recall10"], acc["n_proc"]),
                        "similarity_spearman": div(acc["spearman"], acc["n_proc"])})
        return out
    if task == "causal-lm":
        out = {"ppl": ppl(acc["ce"], acc["n_ce"])}
        if has_teacher:
            out = {
                "kl": div(acc["kl"], acc["n"]),
                "top1_agreement": div(acc["agree"], acc["n"]),
                "top5_agreement": div(acc["agree5"], acc["n"]),
                **out,
                "teacher_ppl": ppl(acc["tce"], acc["n_ce"]),
            }
            out["ppl_ratio"] = div(out["ppl"], out["teacher_ppl"])
        return out
    out = {"ppl": ppl(acc["ce"], acc["n_m"])}
    if has_teacher:
        out = {
            "kl": div(acc["kl"], acc["n"]),
            "top1_agreement": div(acc["agree"], acc["n"]),
            "top5_agreement": div(acc["agree5"], acc["n"]),
            "kl_masked": div(acc["kl_m"], acc["n_m"]),
            "top1_agreement_masked": div(acc["agree_m"], acc["n_m"]),
            **out,
            "teacher_ppl": ppl(acc["tce"], acc["n_m"]),
        }
        out["ppl_ratio"] = div(out["ppl"], out["teacher_ppl"])
    return out


def _in_top5(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Per position: the teacher's top-1 token is among the student's top 5."""
    k = min(5, student_logits.shape[-1])
    top = student_logits.topk(k, dim=-1).indices
    return (top == teacher_logits.argmax(-1, keepdim=True)).any(-1)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


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
