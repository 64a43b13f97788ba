"""A trained-like GPT-2 decoder from text shipped with Python, for the held-out decoder checks of issue 40.

No GPT-2 / OPT / Pythia / BLOOM-class LayerNorm decoder ships its weights on the package indexes reachable
here (docs/results/field.md, round 52), so this builds the largest one that trains in minutes on a 2-core
CPU: a Pre-LN ``GPT2LMHeadModel`` (``--hidden`` 256, ``--layers`` 4 by default) with a byte-level BPE
tokenizer, both trained on the docstrings of Python's standard library (modules, classes, functions; the
``test``/``idlelib`` packages left out), starting from bench_quant's "toy-gpt2-outliers" norms (LayerNorm γ
spread around 1, β spread around 0 with a few large outlier channels, as pretrained BERT/GPT-2 norms have).
The evaluation text (``windows``) is Python's reference documentation (``pydoc_data``), which training never
sees. The result is a stock transformers directory (``model.safetensors``, tokenizer files).

    PYTHONPATH=$PWD python benchmarks/pydoc_gpt2.py --out /tmp/lm52/pydoc-gpt2 --steps 400

It prints the held-out cross-entropy on the pydoc windows before and after training (a trained model: well
below ``log(vocab)``).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant import _random_norms  # noqa: E402  (toy-gpt2-outliers' norm start)

SPECIALS = ["<|endoftext|>"]


def stdlib_docstrings(min_words: int = 8) -> list[str]:
    """Every module, class and function docstring of the standard library with at least ``min_words`` words
    (the ``test``/``tests``/``idlelib`` packages and site-packages left out), in a fixed order."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(lib.rglob("*.py")):
        if {"site-packages", "test", "tests", "idlelib"} & set(path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= min_words:
                    docs.append(doc)
    return docs


def pydoc_text() -> str:
    """Python's reference documentation (``pydoc_data.topics``), topics in sorted order, joined."""
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def windows(tok, n: int, length: int, seed: int = 0) -> torch.Tensor:
    """``n`` windows of ``length`` tokens of :func:`pydoc_text` (``[n, length]`` token ids): the text is
    tokenized once and cut into consecutive non-overlapping windows, of which ``n`` are drawn without
    replacement (seeded). Raises when the text has fewer than ``n`` windows."""
    ids = tok(pydoc_text(), add_special_tokens=False)["input_ids"]
    total = len(ids) // length
    if total < n:
        raise SystemExit(f"pydoc_data has {total} windows of {length} tokens, fewer than the {n} asked for")
    cut = torch.tensor(ids[: total * length]).view(total, length)
    pick = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:n]
    return cut[pick.sort().values]


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab, min_frequency=2, special_tokens=SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=SPECIALS[0], eos_token=SPECIALS[0],
                                   unk_token=SPECIALS[0], pad_token=SPECIALS[0], model_max_length=1024)


@torch.no_grad()
def held_out_loss(model, ids: torch.Tensor, batch: int = 16) -> float:
    model.eval()
    losses = [float(model(input_ids=ids[i:i + batch], labels=ids[i:i + batch]).loss) for i in range(0, len(ids), batch)]
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    docs = stdlib_docstrings()
    tok = train_tokenizer(docs, args.vocab)
    eos = tok.eos_token_id
    stream = []
    for d in docs:
        stream += tok(d, add_special_tokens=False)["input_ids"] + [eos]
    stream_t = torch.tensor(stream)
    config = GPT2Config(vocab_size=len(tok), n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                        n_positions=256, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    _random_norms(model, args.seed)
    held = windows(tok, 64, args.seq, seed=args.seed + 1)
    before = held_out_loss(model, held)
    print(f"{len(docs)} docstrings, {len(stream)} tokens (vocab {len(tok)}); held-out loss before {before:.3f} "
          f"(log V = {math.log(len(tok)):.3f})", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 0.5 * (1 + math.cos(math.pi * s / args.steps))))
    gen = torch.Generator().manual_seed(args.seed + 2)
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, len(stream_t) - args.seq - 1, (args.batch,), generator=gen)
        ids = torch.stack([stream_t[s:s + args.seq] for s in starts.tolist()])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step} loss {float(loss.detach()):.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    after = held_out_loss(model, held)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(args.out))
    tok.save_pretrained(str(args.out))
    info = {"docstrings": len(docs), "train_tokens": len(stream), "vocab": len(tok), "hidden": args.hidden,
            "layers": args.layers, "steps": args.steps, "held_out_loss_before": before,
            "held_out_loss_after": after, "seconds": time.perf_counter() - t0}
    (args.out / "training.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
