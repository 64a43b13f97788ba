"""``eval.keep_best`` ranks steps by float64 held-out figures, and breaks ties on purpose.

In float32 the KL of a student to a teacher it nearly matches is rounding noise of either sign: the
logged mean came out exactly 0.0 (clipped) for several steps while ``kl_masked`` was positive, and the
kept step was whichever noise favoured. The held-out KL is now summed in float64 from the same logits.
"""

from __future__ import annotations

import torch
from torch import nn

from normswap.recipes import losses
from normswap.recipes.runner import _Best


def test_held_out_kl_is_float64_exact_and_never_negative():
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(4, 16, 3000, generator=g) * 4
    student = teacher + 1e-6 * torch.randn(teacher.shape, generator=g)  # a near-perfect student
    reference = torch.nn.functional.kl_div(
        torch.log_softmax(student.double(), -1), torch.log_softmax(teacher.double(), -1), log_target=True,
        reduction="none").sum(-1)
    exact = losses.token_kl_exact(student, teacher)
    assert exact.dtype == torch.float64 and exact.shape == (4, 16)
    torch.testing.assert_close(exact, reference, rtol=1e-9, atol=1e-15)
    assert (exact >= 0).all() and exact.mean() > 0
    # float32 cannot tell this student from the teacher: its per-token values are noise of both signs
    noisy = losses.token_kl(student, teacher)
    assert (noisy < 0).any() and (noisy - reference).abs().max() > 100 * reference.abs().max()
    # computed a few rows at a time: the same values whatever the chunk
    torch.testing.assert_close(losses.token_kl_exact(student, teacher, chunk=3000 * 5), exact, rtol=0, atol=0)


def _offer(best: _Best, step: int, **metrics: float) -> None:
    best.consider(step, metrics, nn.Linear(2, 2))


def test_keep_best_ranks_by_the_metric_then_a_second_figure_then_the_earlier_step():
    best = _Best("kl", maximize=False, enabled=True)
    _offer(best, 0, kl=2e-4, top1_agreement=0.97)
    _offer(best, 10, kl=5e-5, top1_agreement=0.98)
    assert best.step == 10
    _offer(best, 20, kl=5e-5, top1_agreement=0.99)  # the same KL, better agreement: kept
    assert best.step == 20
    _offer(best, 30, kl=5e-5, top1_agreement=0.99)  # a full tie: the earlier step stays
    assert best.step == 20
    _offer(best, 40, kl=6e-5, top1_agreement=1.0)  # a worse KL is worse, whatever the agreement
    assert best.step == 20 and best.metrics["top1_agreement"] == 0.99

    best = _Best("top1_agreement", maximize=True, enabled=True)
    _offer(best, 0, kl=3e-4, top1_agreement=0.97)
    _offer(best, 5, kl=1e-4, top1_agreement=0.97)  # tie on agreement: the smaller KL
    _offer(best, 9, kl=2e-4, top1_agreement=0.96)
    assert best.step == 5
    _offer(best, 12, top1_agreement=float("nan"))  # no figure: not a candidate
    assert best.step == 5
