"""Offline toy material for examples and tests: a synthetic grammar, a word-level tokenizer, and
small BERT / GPT-2 / Post-LN OPT models trained on it in seconds, so that they have real structure to lose
when converted approximately (a random model has none, and recovery numbers on it mean nothing).

Nothing here downloads anything.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_DET_SG = ["the", "a", "this", "that", "every"]
_DET_PL = ["the", "some", "these", "those", "many"]
_ADJ = ["red", "small", "old", "quiet", "bright", "heavy", "clever", "green"]
_N_SG = ["cat", "dog", "bird", "child", "teacher", "robot", "farmer", "river"]
_N_PL = ["cats", "dogs", "birds", "children", "teachers", "robots", "farmers", "rivers"]
_V_SG = ["sees", "likes", "follows", "finds", "helps", "watches"]
_V_PL = ["see", "like", "follow", "find", "help", "watch"]
_P = ["near", "behind", "with", "under"]
_ADV = ["often", "rarely", "quietly", "never"]


def _noun_phrase(rng: random.Random) -> tuple[list[str], bool]:
    plural = rng.random() < 0.5
    words = [rng.choice(_DET_PL if plural else _DET_SG)]
    if rng.random() < 0.5:
        words.append(rng.choice(_ADJ))
    words.append(rng.choice(_N_PL if plural else _N_SG))
    return words, plural


def sentence(rng: random.Random) -> str:
    """One sentence with subject–verb number agreement, optional adjectives, adverbs and PPs."""
    subject, plural = _noun_phrase(rng)
    if rng.random() < 0.3:
        pp, _ = _noun_phrase(rng)
        subject += [rng.choice(_P), *pp]
    words = subject
    if rng.random() < 0.3:
        words.append(rng.choice(_ADV))
    words.append(rng.choice(_V_PL if plural else _V_SG))
    obj, _ = _noun_phrase(rng)
    words += obj
    if rng.random() < 0.25:
        pp, _ = _noun_phrase(rng)
        words += [rng.choice(_P), *pp]
    return " ".join(words) + " ."


def grammar_corpus(n: int, seed: int = 0, sentences_per_line: int = 3) -> list[str]:
    """``n`` lines of ``sentences_per_line`` generated sentences each."""
    rng = random.Random(seed)
    return [" ".join(sentence(rng) for _ in range(sentences_per_line)) for _ in range(n)]


def write_corpus(path: str | Path, n: int, seed: int = 0) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("\n".join(grammar_corpus(n, seed)) + "\n")
    return p


def word_tokenizer(texts: list[str] | None = None) -> Any:
    """A word-level fast tokenizer (BERT-style specials) over the grammar's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = texts or grammar_corpus(200)
    vocab_words = sorted({*_DET_SG, *_DET_PL, *_ADJ, *_N_SG, *_N_PL, *_V_SG, *_V_PL, *_P, *_ADV, "."})
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(
        texts + [" ".join(vocab_words)], trainers.WordLevelTrainer(special_tokens=SPECIALS)
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        eos_token="[SEP]",
        bos_token="[CLS]",
        model_max_length=512,
    )


def _train(model: torch.nn.Module, batches: Any, steps: int, lr: float) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps)
    )
    model.train()
    history = []
    for i in range(steps):
        batch = batches(i)
        out = model(**batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        history.append(float(out.loss.detach()))
    model.eval()
    return history


def _bert_like_norms(model: torch.nn.Module, scale: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 17)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                d = module.weight.shape[0]
                module.weight.copy_(1.0 + 0.5 * scale * torch.randn(d, generator=gen))
                module.bias.copy_(0.3 * scale * torch.randn(d, generator=gen))
                module.bias[: max(1, d // 32)] += 3.0 * scale  # outlier channels


def _train_and_save(model: torch.nn.Module, texts: list[str], tokenizer: Any, task: str, out_dir: str | Path, *,
                    steps: int, seq_len: int, batch_size: int, lr: float, seed: int) -> Path:
    """Train ``model`` on ``texts`` for ``task`` (the recipes' own batching) and save it with its tokenizer."""
    from normswap.recipes.config import DataConfig
    from normswap.recipes.data import BatchSource, tokenize

    dcfg = DataConfig(path="-", seq_len=seq_len, batch_size=batch_size, eval_fraction=0.01, seed=seed)
    source = BatchSource(tokenize(texts, tokenizer, dcfg, task), dcfg, task, tokenizer)
    _train(model, source.train_batch, steps, lr)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def train_tiny_bert(
    out_dir: str | Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    steps: int = 300,
    seq_len: int = 32,
    batch_size: int = 32,
    lr: float = 2e-3,
    seed: int = 0,
    corpus_lines: int = 1500,
    bert_like_norms: float = 1.0,
) -> Path:
    """Train a small Post-LN ``BertForMaskedLM`` with MLM on the grammar; save model + tokenizer.

    ``bert_like_norms`` scales a BERT-like start for the LayerNorm parameters (spread γ, β with a
    few large "outlier" channels, as pretrained BERTs have): with default 1/0 norms a tiny model's
    Post-LN streams stay nearly zero-mean and approximate conversion would lose almost nothing.
    """
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    texts = grammar_corpus(corpus_lines, seed=seed + 1)
    tokenizer = word_tokenizer(texts)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForMaskedLM(config)
    if bert_like_norms:
        _bert_like_norms(model, bert_like_norms, seed)
    return _train_and_save(model, texts, tokenizer, "masked-lm", out_dir, steps=steps, seq_len=seq_len,
                           batch_size=batch_size, lr=lr, seed=seed)


CAUSAL_ARCHS = ("gpt2", "opt-post-ln")


def train_tiny_causal_lm(
    out_dir: str | Path,
    *,
    arch: str = "gpt2",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    steps: int = 200,
    seq_len: int = 32,
    batch_size: int = 32,
    lr: float = 2e-3,
    seed: int = 0,
    corpus_lines: int = 1000,
    bert_like_norms: float = 0.0,
) -> Path:
    """Train a small causal LM on the grammar; save model + tokenizer.

    ``arch``: ``"gpt2"`` (a Pre-LN ``GPT2LMHeadModel``: converts exactly) or ``"opt-post-ln"`` (an
    ``OPTForCausalLM`` with ``do_layer_norm_before=False``, the Post-LN layout of OPT-350m: its norms
    convert only approximately, so it is what the causal-LM recovery recipe is measured on).
    ``bert_like_norms`` as in :func:`train_tiny_bert`.
    """
    from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

    if arch not in CAUSAL_ARCHS:
        raise ValueError(f"arch must be one of {', '.join(CAUSAL_ARCHS)}, not {arch!r}")
    torch.manual_seed(seed)
    texts = grammar_corpus(corpus_lines, seed=seed + 1)
    tokenizer = word_tokenizer(texts)
    ids = {"bos_token_id": tokenizer.cls_token_id, "eos_token_id": tokenizer.sep_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(
            vocab_size=len(tokenizer), n_embd=hidden, n_layer=layers, n_head=heads, n_positions=128,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids))
    else:
        model = OPTForCausalLM(OPTConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, word_embed_proj_dim=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, ffn_dim=4 * hidden, max_position_embeddings=128,
            do_layer_norm_before=False, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **ids))
    if bert_like_norms:
        _bert_like_norms(model, bert_like_norms, seed)
    return _train_and_save(model, texts, tokenizer, "causal-lm", out_dir, steps=steps, seq_len=seq_len,
                           batch_size=batch_size, lr=lr, seed=seed)
