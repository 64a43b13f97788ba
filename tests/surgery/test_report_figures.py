"""The figures a conversion reports mean what they say: a KL divergence is never negative, and a
figure that is not a max error (``dtype_error_ratio``, a ratio of RMS errors) is printed with what it is."""

from __future__ import annotations

import torch

from normswap.pipeline import Report
from normswap.surgery.verify import compare, figures, token_kl


def near_identical_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """Two float64 logit tensors whose textbook KL sum rounds below zero (checked below)."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 50, generator=g, dtype=torch.float64)
    return ref, ref + 1e-9 * torch.randn(4, 50, generator=g, dtype=torch.float64)


def test_kl_is_never_negative():
    ref, out = near_identical_logits()
    lr, lo = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    assert float((lr.exp() * (lr - lo)).sum(-1).mean()) < 0  # what the old formula reported
    assert (token_kl(ref, out) >= 0).all()
    assert figures(ref, out)["kl"] >= 0
    assert compare({"logits": ref}, {"logits": out})["kl"] >= 0
    far = torch.randn(4, 50, dtype=torch.float64)  # a real divergence is untouched
    lr, lf = torch.log_softmax(ref, -1), torch.log_softmax(far, -1)
    assert torch.allclose(token_kl(ref, far), (lr.exp() * (lr - lf)).sum(-1))


def test_recipe_kl_metric_is_never_negative():
    """The recipes' KL is float32: per token it is rounding noise of either sign for near-equal logits.
    The mean keeps that noise unbiased (a per-token clamp would inflate it), and is clamped at 0."""
    from normswap.recipes import tasks

    task = tasks.get("causal-lm")
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(2, 3, 50, generator=g)
    student = teacher + 1e-6 * torch.randn(2, 3, 50, generator=g)
    acc = dict.fromkeys(task.accumulators, 0.0)
    task._agreement(acc, student, teacher, torch.ones(2, 3, dtype=torch.bool))
    acc["n"] = 6.0  # the tokens counted (accumulate() adds them)
    assert acc["kl"] < 0  # the summed noise came out negative here
    assert task._with_teacher(acc, 1.0, 1.0)["kl"] == 0.0
    acc["kl"] = 3e-6  # a real divergence is reported as it is
    assert task._with_teacher(acc, 1.0, 1.0)["kl"] == 3e-6 / 6


def test_report_labels_the_ratio_of_rms_errors():
    ref, out = near_identical_logits()
    figs = {**compare({"logits": ref}, {"logits": out}), "in_model_dtype": 3e-3, "dtype_error_ratio": 1.07}
    text = str(Report(verification=figs))
    assert "kl=-" not in text and "kl=" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("verification:"))
    assert "dtype_error_ratio=1.07 (RMS error of the converted model over the original's" in line
    assert "in_model_dtype=0.003," in line  # the max errors stay as they were
