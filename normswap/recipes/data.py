"""Local data only: a text file, a JSONL file with a named field, or a ``datasets`` directory.

Documents are tokenised with the model's tokenizer and either packed into ``seq_len`` windows
(``pack: true``; no padding, every token trains) or kept one per example, truncated and padded
(``pack: false``; what sentence encoders see). A seeded shuffle splits off the held-out set.

Batches are a pure function of ``(micro-batch index, process rank)``: the epoch permutation is
seeded by ``seed + epoch`` and MLM masking by ``(seed, index, rank)``. Resuming therefore only
needs the step counter to continue on exactly the same data.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from normswap.errors import NormswapError
from normswap.recipes import tasks
from normswap.recipes.config import DataConfig


# ---------------------------------------------------------------------------------- reading
def _detect_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "datasets"
    if path.suffix in (".jsonl", ".ndjson") or (path.suffix == ".json" and _looks_like_jsonl(path)):
        return "jsonl"
    return "text"


def _looks_like_jsonl(path: Path) -> bool:
    with path.open() as fh:
        first = fh.readline().strip()
    return first.startswith("{")


def read_documents(cfg: DataConfig) -> list[str]:
    """The raw documents (strings) named by ``data.path``, at most ``data.max_documents`` of them."""
    path = Path(cfg.path)
    if not path.exists():
        raise NormswapError(f"config key `data.path`: {cfg.path!r} does not exist")
    fmt = _detect_format(path, cfg.format)
    limit = cfg.max_documents
    docs: list[str] = []
    if fmt == "text":
        if path.is_dir():
            raise NormswapError(
                f"config key `data.path`: {cfg.path!r} is a directory; use data.format=datasets"
            )
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.strip():
                docs.append(line.strip())
                if limit and len(docs) >= limit:
                    break
    elif fmt == "jsonl":
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise NormswapError(
                        f"config key `data.path`: line {lineno} of {cfg.path!r} is not JSON ({exc.msg})"
                    ) from None
                if not isinstance(record, dict) or cfg.field not in record:
                    raise NormswapError(
                        f"config key `data.field`: line {lineno} of {cfg.path!r} has no field {cfg.field!r}"
                    )
                value = record[cfg.field]
                if isinstance(value, str) and value.strip():
                    docs.append(value)
                if limit and len(docs) >= limit:
                    break
    elif fmt == "datasets":
        docs = _read_datasets(path, cfg)
    else:  # pragma: no cover - validated by the config types
        raise NormswapError(f"config key `data.format`: unknown format {fmt!r}")
    if not docs:
        raise NormswapError(f"config key `data.path`: no text found in {cfg.path!r}")
    return docs


def _read_datasets(path: Path, cfg: DataConfig) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise NormswapError(
            "config key `data.format`: reading a datasets directory needs the `datasets` "
            "package (pip install datasets)"
        ) from None
    try:
        ds: Any = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - any failure means this is not a saved dataset
        raise NormswapError(
            f"config key `data.path`: {str(path)!r} is not a directory saved with "
            f"datasets' save_to_disk ({type(exc).__name__})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if cfg.split not in ds:
            raise NormswapError(
                f"config key `data.split`: {cfg.split!r} not in the dataset (splits: {', '.join(ds)})"
            )
        ds = ds[cfg.split]
    if cfg.field not in ds.column_names:
        raise NormswapError(
            f"config key `data.field`: the dataset has no column {cfg.field!r} "
            f"(columns: {', '.join(ds.column_names)})"
        )
    n = len(ds) if not cfg.max_documents else min(len(ds), cfg.max_documents)
    return [t for t in ds.select(range(n))[cfg.field] if isinstance(t, str) and t.strip()]


# ---------------------------------------------------------------------------------- tokenising
@dataclass
class TokenData:
    """Tokenised examples (lists of ids, unpadded) split into train and held-out eval sets."""

    train: list[list[int]]
    eval: list[list[int]]
    pad_id: int
    tokens_per_example: float


def _special(tokenizer: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return None


def tokenize(docs: list[str], tokenizer: Any, cfg: DataConfig, task: str) -> TokenData:
    """Tokenise, pack (or truncate) to ``seq_len``, shuffle with ``seed`` and split off eval."""
    encoder_style = tasks.get(task).bidirectional  # [CLS] … [SEP] framing
    cls_id = _special(tokenizer, "cls_token_id", "bos_token_id") if encoder_style else None
    sep_id = _special(tokenizer, "sep_token_id", "eos_token_id")
    pad_id = _special(tokenizer, "pad_token_id", "eos_token_id", "sep_token_id")
    pad_id = 0 if pad_id is None else pad_id
    examples: list[list[int]] = []
    if cfg.pack:
        ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
        stream: list[int] = []
        for doc in ids:
            stream.extend(doc)
            if sep_id is not None:
                stream.append(sep_id)
        inner = cfg.seq_len - (2 if encoder_style and cls_id is not None and sep_id is not None else 0)
        for start in range(0, len(stream) - inner + 1, inner):
            chunk = stream[start : start + inner]
            if inner != cfg.seq_len:
                chunk = [cls_id, *chunk, sep_id]
            examples.append(chunk)
    else:
        enc = tokenizer(docs, add_special_tokens=True, truncation=True, max_length=cfg.seq_len)
        examples = [list(x) for x in enc["input_ids"] if len(x) >= 2]
    if len(examples) < 2:
        raise NormswapError(
            f"config key `data.seq_len`: {cfg.path!r} gives only {len(examples)} example(s) of "
            f"{cfg.seq_len} tokens; use more text or a shorter seq_len"
        )
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    examples = [examples[i] for i in order]
    n_eval = max(1, round(cfg.eval_fraction * len(examples)))
    if cfg.eval_batches is not None:
        n_eval = min(n_eval, cfg.eval_batches * cfg.eval_batch_size)
    n_eval = min(n_eval, len(examples) - 1)
    mean_len = sum(len(e) for e in examples) / len(examples)
    return TokenData(
        train=examples[n_eval:], eval=examples[:n_eval], pad_id=pad_id, tokens_per_example=mean_len
    )


# ---------------------------------------------------------------------------------- batches
def collate(examples: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; ``attention_mask`` marks real tokens."""
    width = max(len(e) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e)] = torch.tensor(e, dtype=torch.long)
        mask[i, : len(e)] = 1
    return {"input_ids": ids, "attention_mask": mask}


class BatchSource:
    """Deterministic batches. ``train_batch(i)`` is micro-batch ``i`` for this process."""

    def __init__(
        self, data: TokenData, cfg: DataConfig, task: str, tokenizer: Any, rank: int = 0, world: int = 1
    ) -> None:
        self.data, self.cfg, self.task = data, cfg, task
        self.rank, self.world = rank, world
        self.labeller = tasks.get(task).labeller(tokenizer, cfg.mlm_probability)  # labels, MLM masking
        self.global_batch = cfg.batch_size * world
        self.batches_per_epoch = len(data.train) // self.global_batch
        if self.batches_per_epoch == 0:
            raise NormswapError(
                f"config key `data.batch_size`: the training split has {len(data.train)} "
                f"example(s), fewer than one batch of {self.global_batch}; use more data or "
                "a smaller batch"
            )
        self._perm: tuple[int, list[int]] | None = None
        self._neighbours: list[list[int]] | None = None  # per training example, nearest first
        self._group = 1

    def group_by_neighbours(self, embeddings: torch.Tensor, size: int) -> None:
        """From now on, order each epoch in groups of ``size`` examples that are near neighbours.

        ``embeddings[i]`` is the teacher's sentence embedding of training example ``i``. Each group
        is a randomly chosen anchor and its nearest neighbours (cosine) not yet used this epoch, so a
        batch holds ``batch_size / size`` such groups: the in-batch similarity loss then sees the
        close neighbours whose order a retrieval user sees, not only unrelated documents.
        """
        e = F.normalize(embeddings.double(), dim=-1)
        k = min(len(e) - 1, 4 * size)
        nearest = []
        for i in range(0, len(e), 1024):  # chunked: the similarity matrix is never materialised whole
            sim = e[i:i + 1024] @ e.T
            sim[torch.arange(sim.shape[0]), torch.arange(i, i + sim.shape[0])] = -math.inf
            nearest.append(sim.topk(k, dim=-1).indices)
        self._neighbours = torch.cat(nearest).tolist() if k > 0 else [[] for _ in range(len(e))]
        self._group, self._perm = size, None

    def _permutation(self, epoch: int) -> list[int]:
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.data.train), generator=gen).tolist()
            self._perm = (epoch, order if self._neighbours is None else self._grouped(order))
        return self._perm[1]

    def _grouped(self, anchors: list[int]) -> list[int]:
        """``anchors`` reordered into consecutive groups of ``self._group`` near neighbours (groups
        whose anchor has run out of unused neighbours are completed with the next unused anchors,
        so every group stays aligned with the batch boundaries)."""
        used = [False] * len(anchors)
        out: list[int] = []
        fill = 0  # the next anchor position that may still be unused
        for a in anchors:
            if used[a]:
                continue
            group = [a]
            used[a] = True
            for b in self._neighbours[a]:
                if len(group) == self._group:
                    break
                if not used[b]:
                    group.append(b)
                    used[b] = True
            while len(group) < self._group and fill < len(anchors):
                b = anchors[fill]
                fill += 1
                if not used[b]:
                    group.append(b)
                    used[b] = True
            out.extend(group)
        return out

    def train_examples(self, size: int) -> Iterator[dict[str, torch.Tensor]]:
        """Every training example once, in index order, collated ``size`` at a time (no labels)."""
        for i in range(0, len(self.data.train), size):
            yield collate(self.data.train[i:i + size], self.data.pad_id)

    def _finish(self, batch: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
        return self.labeller(batch, torch.Generator().manual_seed(seed))

    def train_batch(self, index: int, rank: int | None = None) -> dict[str, torch.Tensor]:
        rank = self.rank if rank is None else rank
        epoch, pos = divmod(index, self.batches_per_epoch)
        perm = self._permutation(epoch)
        start = pos * self.global_batch + rank * self.cfg.batch_size
        rows = [self.data.train[j] for j in perm[start : start + self.cfg.batch_size]]
        return self._finish(collate(rows, self.data.pad_id), (self.cfg.seed + 1) * 7_919 + index * 131 + rank)

    def eval_batches(self) -> list[dict[str, torch.Tensor]]:
        """This process's share of the held-out set (fixed masking), in eval-batch-size pieces."""
        rows = self.data.eval[self.rank :: self.world]
        size = self.cfg.eval_batch_size
        return [
            self._finish(collate(rows[i : i + size], self.data.pad_id), 1_000_000_007 + i)
            for i in range(0, len(rows), size)
        ]

    def calibration_batches(self, n: int) -> list[dict[str, torch.Tensor]]:
        """The first ``n`` training batches as plain model inputs (for least-squares norm init).

        The same on every process (rank 0's share), so every process fits the same norms.
        """
        n = min(n, self.batches_per_epoch)
        return [{k: v for k, v in self.train_batch(i, rank=0).items() if k != "labels"} for i in range(n)]
