"""Distillation and language-modelling losses. All reduce to a mean over the selected tokens.

* ``kl_logits``: ``T² · KL(softmax(t/T) ‖ softmax(s/T))`` per token, summed over the vocabulary
  (Hinton et al.: the T² keeps gradient scale independent of the temperature).
* ``lm_ce``: cross-entropy on labels (next token for causal LMs, masked tokens for MLM).
* ``pooled_cosine``: ``1 − cos`` between pooled sentence embeddings.
* ``hidden_relative_mse``: ``‖s − t‖² / ‖t‖²`` per token (scale-free, so one weight fits any model).
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
