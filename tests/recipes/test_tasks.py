"""The recipe tasks (``normswap.recipes.tasks``) one by one: labelling, losses and held-out metrics.

A student equal to its teacher must score perfectly on every metric of its task, and a perturbed
one must score worse on each divergence; the labellers must produce the labels the losses expect.
Tiny random models built from configs, no training.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, BertModel, GPT2Config, GPT2LMHeadModel

from normswap import NormswapError
from normswap.recipes import tasks
from normswap.recipes.config import LossConfig
from normswap.recipes.metrics import evaluate

VOCAB = 50


class _Tokenizer:
    """The three things the MLM labeller reads from a tokenizer."""

    mask_token_id = 3
    all_special_ids = [0, 1, 2, 3]

    def __len__(self) -> int:
        return VOCAB


def _model(task: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if task == "causal-lm":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32)).eval()
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32)
    return (BertForMaskedLM(cfg) if task == "masked-lm" else BertModel(cfg)).eval()


def _batches(task: str, n: int = 3) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    label = tasks.get(task).labeller(_Tokenizer(), 0.3)
    out = []
    for i in range(n):
        ids = torch.randint(4, VOCAB, (6, 12), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, 9:] = 0  # one padded row
        ids[0, 9:] = 0
        out.append(label({"input_ids": ids, "attention_mask": mask}, torch.Generator().manual_seed(i)))
    return out


@pytest.mark.parametrize("name", tasks.TASK_NAMES)
def test_a_student_equal_to_its_teacher_scores_perfectly(name):
    teacher = _model(name)
    figures = evaluate(copy.deepcopy(teacher), teacher, _batches(name), name)
    task = tasks.get(name)
    assert set(task.metrics) <= set(figures)  # every metric eval.metric may name is reported
    for key, value in figures.items():
        if key in ("kl", "kl_masked", "hidden_rel_mse"):
            assert abs(value) < 1e-6, (key, value)
        elif key in tasks.HIGHER_IS_BETTER or key == "ppl_ratio":
            assert value == pytest.approx(1.0, abs=1e-6), (key, value)


@pytest.mark.parametrize("name", tasks.TASK_NAMES)
def test_a_perturbed_student_scores_worse_and_its_loss_is_positive(name):
    teacher = _model(name)
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.3 * torch.randn_like(p))
    batches = _batches(name)
    figures = evaluate(student, teacher, batches, name)
    divergence = "cosine" if name == "encoder" else "kl"
    assert (figures[divergence] < 0.99) if name == "encoder" else (figures[divergence] > 1e-3)
    lc = LossConfig(pooling="mean")
    batch = batches[0]
    inputs = tasks.model_inputs(batch)
    loss, parts = tasks.get(name).loss(lc, student(**inputs), teacher(**inputs), batch)
    assert loss.item() > 0 and parts and all(v >= 0 for v in parts.values())


def test_labellers_give_each_task_its_labels():
    ids = torch.tensor([[5, 6, 7, 8, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": mask}
    gen = torch.Generator().manual_seed(0)
    causal = tasks.get("causal-lm").labeller(_Tokenizer(), 0.15)(batch, gen)
    assert causal["labels"].tolist() == [[5, 6, 7, 8, -100, -100]]  # padding never predicted
    masked = tasks.get("masked-lm").labeller(_Tokenizer(), 0.15)(batch, gen)
    chosen = masked["labels"] != -100
    assert chosen.any() and not chosen[mask == 0].any()  # at least one real token, no padding
    assert (masked["labels"][chosen] == ids[chosen]).all()  # labels are the original tokens
    assert tasks.get("encoder").labeller(_Tokenizer(), 0.15)(batch, gen) is batch


def test_masked_lm_without_a_mask_token_is_a_config_error():
    class NoMask(_Tokenizer):
        mask_token_id = None

    with pytest.raises(NormswapError, match="mask token"):
        tasks.get("masked-lm").labeller(NoMask(), 0.15)
