"""The recipes' tasks, each in one place: what differs between causal-LM, masked-LM and encoder runs.

A :class:`Task` says which transformers class loads the model, how sequences are tokenised and
labelled, what the training loss is, which held-out metrics it reports, and which configurations
make sense for it. The config validation, the data pipeline, the runner and the metrics ask the
task (``tasks.get(cfg.task)``); none of them branches on a task name. A new task is one subclass
here and one entry in :data:`TASKS`.

Held-out metrics (all student vs teacher, eval mode, no grad):

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

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from normswap.errors import NormswapError
from normswap.recipes import losses
from normswap.surgery.calibrate import neighbour_figures

Batch = dict[str, torch.Tensor]
MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids")
NEIGHBOUR_METRICS = frozenset({"top1_neighbour_agreement", "recall_at_10", "similarity_spearman"})
NEIGHBOUR_MIN_EXAMPLES = 3  # calibrate.neighbour_figures measures nothing on fewer sentences
SIMILARITY_MIN_BATCH = 3  # losses.similarity_kl is 0 on fewer sentences per batch
HIGHER_IS_BETTER = frozenset({"cosine", "top1_agreement", "top1_agreement_masked", "top5_agreement",
                              "top1_neighbour_agreement", "recall_at_10", "similarity_spearman"})


def model_inputs(batch: Batch) -> Batch:
    """The tensors of a batch that the model's ``forward`` takes (labels left out)."""
    return {k: v for k, v in batch.items() if k in MODEL_KEYS}


@torch.no_grad()
def sentence_embeddings(model: nn.Module, batches: Iterable[Batch], pooling: str, device: torch.device,
                        autocast: Callable[[], Any] = contextlib.nullcontext) -> torch.Tensor:
    """Pooled sentence embeddings (float32, on the CPU) of ``model`` for every row of ``batches``."""
    pooled = []
    for batch in batches:
        batch = {k: v.to(device) for k, v in model_inputs(batch).items()}
        with autocast():
            hidden = hidden_of(model(**batch))
        pooled.append(losses.pool(hidden.float(), batch["attention_mask"], pooling).cpu())
    return torch.cat(pooled)


def logits_of(out: Any) -> torch.Tensor:
    """The logits of a model output (``.logits`` or the first element)."""
    return out.logits if hasattr(out, "logits") else out[0]


def hidden_of(out: Any) -> torch.Tensor:
    """The final hidden states of a model output (``.last_hidden_state`` or the first element)."""
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _in_top5(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    k = min(5, student_logits.shape[-1])
    top = student_logits.topk(k, dim=-1).indices
    return (top == teacher_logits.argmax(-1, keepdim=True)).any(-1)


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                 ignore_index=-100, reduction="sum"))


def _div(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _mean_kl(total: float, n: float) -> float:
    """Mean per-token KL, never below 0: float32 KL of two near-equal distributions is rounding noise
    of either sign per token; the mean keeps that noise unbiased, and a divergence is not negative."""
    mean = _div(total, n)
    return 0.0 if mean < 0 else mean


def _ppl(ce: float, n: float) -> float:
    return math.exp(min(_div(ce, n), 50.0)) if n else float("nan")


class MaskingPolicy:
    """BERT-style MLM corruption: ``probability`` of real, non-special tokens get a label;
    of those 80% become [MASK], 10% a random token, 10% stay. Deterministic given the generator."""

    def __init__(self, tokenizer: Any, probability: float) -> None:
        self.mask_id = getattr(tokenizer, "mask_token_id", None)
        if self.mask_id is None:
            raise NormswapError("config key `task`: masked-lm needs a tokenizer with a mask token")
        self.special = torch.tensor(
            sorted(set(getattr(tokenizer, "all_special_ids", []) or [])), dtype=torch.long
        )
        self.vocab = len(tokenizer)
        self.probability = probability

    def __call__(self, batch: Batch, gen: torch.Generator) -> Batch:
        ids = batch["input_ids"].clone()
        candidates = batch["attention_mask"].bool() & ~torch.isin(ids, self.special)
        chosen = (torch.rand(ids.shape, generator=gen) < self.probability) & candidates
        # guarantee at least one prediction per row that has a candidate
        for row in range(ids.shape[0]):
            if not chosen[row].any() and candidates[row].any():
                first = int(candidates[row].nonzero()[0])
                chosen[row, first] = True
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        roll = torch.rand(ids.shape, generator=gen)
        random_ids = torch.randint(0, self.vocab, ids.shape, generator=gen)
        ids = torch.where(chosen & (roll < 0.8), torch.full_like(ids, self.mask_id), ids)
        ids = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, ids)
        return {**batch, "input_ids": ids, "labels": labels}


class Task:
    """What one task needs. Subclasses set the class attributes and implement the methods."""

    name: ClassVar[str]
    auto_class: ClassVar[str]  # the transformers Auto class that loads the model
    # transformers' model type -> class name tables (``transformers.models.auto.modeling_auto``) whose
    # classes carry this task's head; the first is auto_class's
    head_tables: ClassVar[tuple[str, ...]]
    # the checkpoint must have been saved as one of those classes (else the head would load untrained)
    head_required: ClassVar[bool] = True
    bidirectional: ClassVar[bool]  # sequences are framed as [CLS] … [SEP] (packed windows too)
    embeds: ClassVar[bool] = False  # the output is a pooled sentence embedding (`loss.pooling` applies)
    metrics: ClassVar[tuple[str, ...]]  # what `eval.metric` may name
    teacher_metrics: ClassVar[frozenset[str]] = frozenset()  # those that need the teacher
    accumulators: ClassVar[tuple[str, ...]]  # the sums `accumulate` keeps (reduced across processes)

    def model_class(self) -> Any:
        import transformers

        return getattr(transformers, self.auto_class)

    def labeller(self, tokenizer: Any, mlm_probability: float) -> Callable[[Batch, torch.Generator], Batch]:
        """What turns a collated batch into a training batch (labels, masking)."""
        return lambda batch, gen: batch

    def default_metric(self, has_teacher: bool) -> str:
        """The held-out metric ``eval.keep_best`` ranks by when ``eval.metric`` is not set."""
        raise NotImplementedError

    def check_losses(self, cfg: Any) -> None:
        """Refuse a recipe config (``RecipeConfig``) whose loss section cannot train this task."""
        raise NotImplementedError

    def tokenizer_problem(self, tokenizer: Any, cfg: Any, named: str) -> tuple[str, str] | None:
        """``(config key, why)`` when ``tokenizer`` (which ``named`` describes: "the tokenizer of
        model.source 'x'") cannot frame this task's examples, else None."""
        return None

    def eval_examples_needed(self, metric: str) -> int:
        """Held-out examples each process needs for ``metric`` to be measured at all."""
        return 1

    def check_metric(self, cfg: Any) -> None:
        metric = cfg.eval.metric
        if metric is not None and metric not in self.metrics:
            raise NormswapError(
                f"config key `eval.metric` must be one of {', '.join(self.metrics)} for task {self.name}, "
                f"got {metric!r}"
            )
        if metric in self.teacher_metrics and not cfg.teacher.enabled:
            raise NormswapError(f"config key `eval.metric`: {metric!r} needs the teacher (teacher.enabled)")

    def loss(self, lc: Any, out: Any, t_out: Any, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """The training loss (``lc``: the ``loss`` config section) and its parts for the log."""
        raise NotImplementedError

    def accumulate(self, acc: dict[str, float], s_out: Any, t_out: Any, batch: Batch, pooling: str) -> None:
        """Add one held-out batch to the running sums."""
        raise NotImplementedError

    def close(self, acc: dict[str, float]) -> None:
        """Figures computed on this process's whole share, before the sums are reduced."""

    def finish(self, acc: dict[str, float], has_teacher: bool) -> dict[str, float]:
        """The reported metrics from the (reduced) sums."""
        raise NotImplementedError


class _LanguageModel(Task):
    """Shared by the two LM tasks: KL to the teacher's logits plus cross-entropy on the labels."""

    causal: ClassVar[bool]
    teacher_metrics = frozenset({"kl", "top1_agreement", "kl_masked", "top1_agreement_masked"})

    def default_metric(self, has_teacher: bool) -> str:
        return "kl" if has_teacher else "ppl"

    def check_losses(self, cfg: Any) -> None:
        lc = cfg.loss
        if not cfg.teacher.enabled and lc.kl_weight > 0:
            raise NormswapError(
                "config key `loss.kl_weight` must be 0 when `teacher.enabled` is false "
                "(there is no teacher to distil from)"
            )
        if (lc.kl_weight if cfg.teacher.enabled else 0.0) + lc.ce_weight <= 0:
            raise NormswapError(
                "config key `loss.kl_weight` (or `loss.ce_weight`, or for encoders "
                "`loss.pooled_weight`/`loss.hidden_weight`) must be > 0: nothing would be trained"
            )

    def loss(self, lc: Any, out: Any, t_out: Any, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        total, parts = torch.zeros((), device=batch["input_ids"].device), {}
        logits = logits_of(out)
        if t_out is not None and lc.kl_weight:
            mask = batch["attention_mask"] if lc.positions == "all" else batch["labels"] != -100
            kl = losses.kl_logits(logits, logits_of(t_out), mask, lc.temperature)
            total = total + lc.kl_weight * kl
            parts["kl_loss"] = float(kl.detach())
        if lc.ce_weight:
            ce = losses.lm_ce(logits, batch["labels"], causal=self.causal)
            total = total + lc.ce_weight * ce
            parts["ce_loss"] = float(ce.detach())
        return total, parts

    def _agreement(self, acc: dict[str, float], s_log: torch.Tensor, t_log: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
        """KL and top-1/top-5 agreement over ``mask``; returns the per-token KL."""
        kl = losses.token_kl_exact(s_log, t_log)  # float64: the figure keep_best ranks steps by
        acc["kl"] += float(kl[mask.to(kl.device)].sum())
        acc["agree"] += float((s_log.argmax(-1) == t_log.argmax(-1))[mask].sum())
        acc["agree5"] += float(_in_top5(s_log, t_log)[mask].sum())
        return kl

    @staticmethod
    def _with_teacher(acc: dict[str, float], ppl: float, teacher_ppl: float,
                      extra: dict[str, float] | None = None) -> dict[str, float]:
        return {"kl": _mean_kl(acc["kl"], acc["n"]), "top1_agreement": _div(acc["agree"], acc["n"]),
                "top5_agreement": _div(acc["agree5"], acc["n"]), **(extra or {}), "ppl": ppl,
                "teacher_ppl": teacher_ppl, "ppl_ratio": _div(ppl, teacher_ppl)}


class CausalLM(_LanguageModel):
    name = "causal-lm"
    auto_class = "AutoModelForCausalLM"
    head_tables = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",)
    bidirectional = False
    causal = True
    metrics = ("kl", "top1_agreement", "ppl")
    accumulators = ("kl", "agree", "agree5", "n", "ce", "tce", "n_ce")

    def labeller(self, tokenizer: Any, mlm_probability: float) -> Callable[[Batch, torch.Generator], Batch]:
        def next_token_labels(batch: Batch, gen: torch.Generator) -> Batch:
            return {**batch, "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)}

        return next_token_labels

    def check_losses(self, cfg: Any) -> None:
        super().check_losses(cfg)
        if cfg.loss.positions == "masked":
            raise NormswapError("config key `loss.positions` can be 'masked' only for task masked-lm")

    def accumulate(self, acc: dict[str, float], s_out: Any, t_out: Any, batch: Batch, pooling: str) -> None:
        mask = batch["attention_mask"].bool()
        s_log = logits_of(s_out).float()
        t_log = logits_of(t_out).float() if t_out is not None else None
        if t_log is not None:
            self._agreement(acc, s_log, t_log, mask)
        acc["n"] += float(mask.sum())
        next_labels = batch["labels"][:, 1:]
        acc["ce"] += _ce_sum(s_log[:, :-1], next_labels)
        if t_log is not None:
            acc["tce"] += _ce_sum(t_log[:, :-1], next_labels)
        acc["n_ce"] += float((next_labels != -100).sum())

    def finish(self, acc: dict[str, float], has_teacher: bool) -> dict[str, float]:
        ppl = _ppl(acc["ce"], acc["n_ce"])
        return self._with_teacher(acc, ppl, _ppl(acc["tce"], acc["n_ce"])) if has_teacher else {"ppl": ppl}


class MaskedLM(_LanguageModel):
    name = "masked-lm"
    auto_class = "AutoModelForMaskedLM"
    # a *ForPreTraining checkpoint (BERT's) holds the masked-LM head too
    head_tables = ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "MODEL_FOR_PRETRAINING_MAPPING_NAMES")
    bidirectional = True
    causal = False
    metrics = ("kl", "top1_agreement", "kl_masked", "top1_agreement_masked", "ppl")
    accumulators = ("kl", "agree", "agree5", "n", "kl_m", "agree_m", "n_m", "ce", "tce")

    def labeller(self, tokenizer: Any, mlm_probability: float) -> Callable[[Batch, torch.Generator], Batch]:
        return MaskingPolicy(tokenizer, mlm_probability)

    def tokenizer_problem(self, tokenizer: Any, cfg: Any, named: str) -> tuple[str, str] | None:
        if getattr(tokenizer, "mask_token_id", None) is None:
            return "task", f"masked-lm replaces tokens by a mask token and {named} has none; use the model's own"
        return None

    def accumulate(self, acc: dict[str, float], s_out: Any, t_out: Any, batch: Batch, pooling: str) -> None:
        mask = batch["attention_mask"].bool()
        labels = batch["labels"]
        masked = labels != -100
        s_log = logits_of(s_out).float()
        if t_out is not None:
            t_log = logits_of(t_out).float()
            kl = self._agreement(acc, s_log, t_log, mask)
            acc["kl_m"] += float(kl[masked.to(kl.device)].sum())
            acc["agree_m"] += float((s_log.argmax(-1) == t_log.argmax(-1))[masked].sum())
            acc["tce"] += _ce_sum(t_log, labels)
        acc["n"] += float(mask.sum())
        acc["n_m"] += float(masked.sum())
        acc["ce"] += _ce_sum(s_log, labels)

    def finish(self, acc: dict[str, float], has_teacher: bool) -> dict[str, float]:
        ppl = _ppl(acc["ce"], acc["n_m"])
        if not has_teacher:
            return {"ppl": ppl}
        masked = {"kl_masked": _mean_kl(acc["kl_m"], acc["n_m"]),
                  "top1_agreement_masked": _div(acc["agree_m"], acc["n_m"])}
        return self._with_teacher(acc, ppl, _ppl(acc["tce"], acc["n_m"]), masked)


class Encoder(Task):
    """Sentence embeddings: match pooled embeddings, hidden states and in-batch similarity."""

    name = "encoder"
    auto_class = "AutoModel"
    head_tables = ("MODEL_MAPPING_NAMES",)
    head_required = False  # the base model is inside every head class's checkpoint
    bidirectional = True
    embeds = True
    metrics = ("cosine", "hidden_rel_mse", "top1_neighbour_agreement", "recall_at_10", "similarity_spearman")
    accumulators = ("cos", "n_seq", "mse", "n", "top1_nb", "recall10", "spearman", "n_proc")

    def __init__(self) -> None:
        self._pooled: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    def default_metric(self, has_teacher: bool) -> str:
        return "cosine"

    def check_losses(self, cfg: Any) -> None:
        if not cfg.teacher.enabled:
            raise NormswapError(
                "config key `teacher.enabled`: the encoder task distils embeddings and needs the teacher"
            )
        lc = cfg.loss
        if lc.pooled_weight + lc.hidden_weight + lc.similarity_weight <= 0:
            raise NormswapError(
                "config key `loss.kl_weight` (or `loss.ce_weight`, or for encoders "
                "`loss.pooled_weight`/`loss.hidden_weight`) must be > 0: nothing would be trained"
            )
        if lc.similarity_weight > 0 and cfg.data.batch_size < SIMILARITY_MIN_BATCH:
            raise NormswapError(
                f"config key `data.batch_size`: {cfg.data.batch_size} sentences per batch leave the in-batch "
                f"similarity of loss.similarity_weight empty (it needs {SIMILARITY_MIN_BATCH}); use "
                f"data.batch_size={SIMILARITY_MIN_BATCH} or more, or loss.similarity_weight=0"
            )

    def tokenizer_problem(self, tokenizer: Any, cfg: Any, named: str) -> tuple[str, str] | None:
        if cfg.loss.pooling == "cls" and getattr(tokenizer, "cls_token_id", None) is None:
            return "loss.pooling", f"'cls' pools a [CLS] token and {named} puts none first; use loss.pooling=mean"
        return None

    def eval_examples_needed(self, metric: str) -> int:
        # the retrieval figures compare each held-out sentence's nearest neighbours among the others
        return NEIGHBOUR_MIN_EXAMPLES if metric in NEIGHBOUR_METRICS else 1

    def loss(self, lc: Any, out: Any, t_out: Any, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        total, parts = torch.zeros((), device=batch["input_ids"].device), {}
        s_h, t_h, mask = hidden_of(out), hidden_of(t_out), batch["attention_mask"]
        if lc.pooled_weight:
            cos = losses.pooled_cosine(s_h, t_h, mask, lc.pooling)
            total = total + lc.pooled_weight * cos
            parts["cos_loss"] = float(cos.detach())
        if lc.hidden_weight:
            mse = losses.hidden_relative_mse(s_h, t_h, mask)
            total = total + lc.hidden_weight * mse
            parts["hidden_loss"] = float(mse.detach())
        if lc.similarity_weight:
            sim = losses.similarity_kl(losses.pool(s_h.float(), mask, lc.pooling),
                                       losses.pool(t_h.float(), mask, lc.pooling), lc.similarity_temperature)
            total = total + lc.similarity_weight * sim
            parts["similarity_loss"] = float(sim.detach())
        return total, parts

    def accumulate(self, acc: dict[str, float], s_out: Any, t_out: Any, batch: Batch, pooling: str) -> None:
        s_h, t_h = hidden_of(s_out).float(), hidden_of(t_out).float()
        s_p = losses.pool(s_h, batch["attention_mask"], pooling)
        t_p = losses.pool(t_h, batch["attention_mask"], pooling)
        acc["cos"] += float(F.cosine_similarity(s_p, t_p, dim=-1).sum())
        acc["n_seq"] += s_p.shape[0]
        self._pooled[0].append(s_p.double().cpu())
        self._pooled[1].append(t_p.double().cpu())
        mask = batch["attention_mask"].bool()
        per_token = (s_h - t_h).pow(2).sum(-1) / t_h.pow(2).sum(-1).clamp_min(1e-12)
        acc["mse"] += float(per_token[mask].sum())
        acc["n"] += float(mask.sum())

    def close(self, acc: dict[str, float]) -> None:
        students, teachers = self._pooled
        self._pooled = ([], [])
        figures = neighbour_figures(torch.cat(teachers), torch.cat(students)) if teachers else None
        if figures:
            acc["top1_nb"], acc["recall10"] = figures["top1_neighbour_agreement"], figures["recall_at_10"]
            acc["spearman"], acc["n_proc"] = figures["similarity_spearman"], 1.0

    def finish(self, acc: dict[str, float], has_teacher: bool) -> dict[str, float]:
        out = {"cosine": _div(acc["cos"], acc["n_seq"]), "hidden_rel_mse": _div(acc["mse"], acc["n"])}
        if acc.get("n_proc"):
            out.update({"top1_neighbour_agreement": _div(acc["top1_nb"], acc["n_proc"]),
                        "recall_at_10": _div(acc["recall10"], acc["n_proc"]),
                        "similarity_spearman": _div(acc["spearman"], acc["n_proc"])})
        return out


TASKS: dict[str, type[Task]] = {t.name: t for t in (CausalLM, MaskedLM, Encoder)}
TASK_NAMES = tuple(TASKS)


def get(name: str) -> Task:
    """A fresh :class:`Task` for ``name`` (one of :data:`TASK_NAMES`)."""
    try:
        return TASKS[name]()
    except KeyError:
        raise NormswapError(f"config key `task` must be one of {', '.join(TASK_NAMES)}, got {name!r}") from None
