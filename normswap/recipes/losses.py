"""Distillation and language-modelling losses. All reduce to a mean over the selected tokens.

* ``kl_logits``: ``T² · KL(softmax(t/T) ‖ softmax(s/T))`` per token, summed over the vocabulary
  (Hinton et al.: the T² keeps gradient scale independent of the temperature).
* ``lm_ce``: cross-entropy on labels (next token for causal LMs, masked tokens for MLM).
* ``pooled_cosine``: ``1 − cos`` between pooled sentence embeddings.
* ``hidden_relative_mse``: ``‖s − t‖² / ‖t‖²`` per token (scale-free, so one weight fits any model).
* ``similarity_kl``: KL between the teacher's and the student's in-batch similarity distributions
  (each row: softmax over the cosine similarities of one sentence to the others, at temperature τ).
  It matches the *neighbour structure* a retrieval user sees, which ``1 − cos`` alone does not: two
  embeddings can each be 0.999 cosine to their originals and still swap their nearest neighbour.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def token_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Per-token ``KL(teacher ‖ student)`` at ``temperature`` (shape ``[..., ]``), computed in float32."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return (t.exp() * (t - s)).sum(-1)


def token_kl_exact(student_logits: torch.Tensor, teacher_logits: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """Per-token ``KL(teacher ‖ student)`` at T=1 in float64 (shape ``[..., ]``): the held-out figure.

    In float32 the KL of two near-equal distributions is rounding noise of either sign: its mean over
    a held-out split can round to 0 or below (then logged as 0.0), and ``eval.keep_best`` would rank
    steps by that noise. The float64 log-softmax of the same logits is exact to ~1e-16, so the figure
    is never negative and two steps that differ are told apart. Computed ``chunk`` logits at a time
    (a float64 copy of a few rows, not of the whole batch's vocabulary-wide logits).
    """
    shape, vocab = student_logits.shape[:-1], student_logits.shape[-1]
    s_rows, t_rows = student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab)
    device = s_rows.device if s_rows.device.type != "mps" else torch.device("cpu")  # MPS has no float64
    out = torch.empty(s_rows.shape[0], dtype=torch.float64, device=device)
    step = max(1, chunk // max(1, vocab))
    for i in range(0, s_rows.shape[0], step):
        s = F.log_softmax(s_rows[i : i + step].to(device, torch.float64), dim=-1)
        t = F.log_softmax(t_rows[i : i + step].to(device, torch.float64), dim=-1)
        out[i : i + step] = (t.exp() * (t - s)).sum(-1)
    return out.reshape(shape)  # on the logits' device (on CPU for MPS logits)


def kl_logits(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    return masked_mean(token_kl(student_logits, teacher_logits, temperature), mask) * temperature**2


def lm_ce(logits: torch.Tensor, labels: torch.Tensor, causal: bool) -> torch.Tensor:
    """Cross-entropy (mean over labelled tokens; ``-100`` ignored). Causal: predict token ``t+1``."""
    if causal:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, how: str) -> torch.Tensor:
    """Sentence embedding: mean over real tokens (sentence-transformers' default) or the first token."""
    if how == "cls":
        return hidden[:, 0]
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def pooled_cosine(
    student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, attention_mask: torch.Tensor, how: str
) -> torch.Tensor:
    s = pool(student_hidden.float(), attention_mask, how)
    t = pool(teacher_hidden.float(), attention_mask, how)
    return (1.0 - F.cosine_similarity(s, t, dim=-1)).mean()


def hidden_relative_mse(
    student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    s, t = student_hidden.float(), teacher_hidden.float()
    per_token = (s - t).pow(2).sum(-1) / t.pow(2).sum(-1).clamp_min(1e-12)
    return masked_mean(per_token, attention_mask)


def similarity_kl(
    student_pooled: torch.Tensor, teacher_pooled: torch.Tensor, temperature: float = 0.05
) -> torch.Tensor:
    """Mean over rows of ``KL(softmax(t_sim/τ) ‖ softmax(s_sim/τ))``, the diagonal excluded.

    ``t_sim``/``s_sim`` are the cosine-similarity matrices of the batch's pooled embeddings. A batch
    of fewer than 3 sentences has no neighbour structure to match: the loss is 0 then.
    """
    n = student_pooled.shape[0]
    if n < 3:
        return student_pooled.sum() * 0.0
    s = F.normalize(student_pooled.float(), dim=-1)
    t = F.normalize(teacher_pooled.float(), dim=-1)
    eye = torch.eye(n, dtype=torch.bool, device=s.device)
    s_sim = (s @ s.T / temperature).masked_fill(eye, float("-inf"))
    t_sim = (t @ t.T / temperature).masked_fill(eye, float("-inf"))
    log_s = F.log_softmax(s_sim, dim=-1).masked_fill(eye, 0.0)
    log_t = F.log_softmax(t_sim, dim=-1).masked_fill(eye, 0.0)
    return (log_t.exp() * (log_t - log_s)).sum(-1).mean()
