"""The figures a conversion reports mean what they say: a KL divergence is never negative, and a
figure that is not a max error (``dtype_error_ratio``, a ratio of RMS errors) is printed with what it is."""

from __future__ import annotations

import pytest
import torch

from normswap.pipeline import Report
from normswap.surgery.verify import compare, figures, max_rel_error, rel_rms_error, token_kl


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


def test_kl_ignores_classes_masked_out_in_both():
    """Grounding DINO masks padded text positions with -inf logits: KL was NaN there (0 · (-inf + inf));
    a class the reference gives probability 0 adds nothing, one only the converted model drops is inf."""
    ref, out = near_identical_logits()
    ref[:, 40:], out[:, 40:] = float("-inf"), float("-inf")
    kl = token_kl(ref, out)
    assert torch.isfinite(kl).all()
    assert torch.allclose(kl, token_kl(ref[:, :40], out[:, :40]))
    out[0, 3] = float("-inf")
    assert token_kl(ref, out)[0] == float("inf")


def test_error_figures_of_masked_outputs_are_numbers_that_can_fail():
    """-inf in both (masked logits) is no difference; a NaN or an infinity only one side has is an
    infinite one. The errors were NaN before, and NaN is never above a tolerance."""
    ref, out = near_identical_logits()
    ref[:, 40:], out[:, 40:] = float("-inf"), float("-inf")
    got = figures(ref, out)
    finite = figures(ref[:, :40], out[:, :40])
    for key in ("max_abs_error", "max_rel_error", "rel_rms_error"):
        assert got[key] == pytest.approx(finite[key], rel=1e-12), key
    assert max_rel_error(ref, out) == pytest.approx(finite["max_rel_error"], rel=1e-12)
    assert rel_rms_error(ref, out) == pytest.approx(finite["rel_rms_error"], rel=1e-12)
    broken = out.clone()
    broken[1, 2] = float("nan")
    assert figures(ref, broken)["max_rel_error"] == float("inf") and max_rel_error(ref, broken) == float("inf")
    broken = out.clone()
    broken[0, 45] = 0.0  # a masked class that came back
    assert figures(ref, broken)["max_rel_error"] == float("inf")


def test_recipe_kl_metric_is_never_negative():
    """The recipes' held-out KL is summed in float64 from the logits: for near-equal logits, where a
    float32 sum is rounding noise of either sign (it came out negative here, then clamped to 0), it is
    the small positive divergence there is. A negative mean is still clamped at 0."""
    from normswap.recipes import tasks

    task = tasks.get("causal-lm")
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(2, 3, 50, generator=g)
    student = teacher + 1e-6 * torch.randn(2, 3, 50, generator=g)
    lt, ls = torch.log_softmax(teacher.double(), -1), torch.log_softmax(student.double(), -1)
    want = float((lt.exp() * (lt - ls)).sum(-1).sum())
    lt32, ls32 = torch.log_softmax(teacher, -1), torch.log_softmax(student, -1)
    assert float((lt32.exp() * (lt32 - ls32)).sum(-1).sum()) < 0  # what float32 said
    acc = dict.fromkeys(task.accumulators, 0.0)
    task._agreement(acc, student, teacher, torch.ones(2, 3, dtype=torch.bool))
    acc["n"] = 6.0  # the tokens counted (accumulate() adds them)
    assert acc["kl"] > 0 and acc["kl"] == pytest.approx(want, rel=1e-9)
    assert task._with_teacher(acc, 1.0, 1.0)["kl"] == pytest.approx(want / 6, rel=1e-9)
    acc["kl"] = -1e-18  # a negative mean (float64 rounding at worst) is reported as 0
    assert task._with_teacher(acc, 1.0, 1.0)["kl"] == 0.0


def test_report_labels_the_ratio_of_rms_errors():
    ref, out = near_identical_logits()
    figs = {**compare({"logits": ref}, {"logits": out}), "in_model_dtype": 3e-3, "dtype_error_ratio": 1.07}
    text = str(Report(verification=figs))
    assert "kl=-" not in text and "kl=" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("verification:"))
    assert "dtype_error_ratio=1.07 (RMS error of the converted model over the original's" in line
    assert "in_model_dtype=0.003," in line  # the max errors stay as they were
