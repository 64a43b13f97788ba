"""Real checkpoints converted the way users do it: the default CLI, and ``normswap.patch`` on real inputs.

For each sentence-transformers directory given (``NAME=DIR``):

* ``normswap convert DIR --out OUT`` with defaults, in a fresh process under ``/usr/bin/time -v``: exit
  code, wall time, peak RSS, verdict counts and the figures it reports;
* the written directory loaded back in sentence-transformers, against the original, on held-out English
  paragraphs (Python's reference docs, as in ``bench_recovery.py``): mean cosine of the embeddings,
  top-1 neighbour agreement, recall@10, Spearman of pairwise similarities;
* the output error against the float64 original (token states over real tokens, relative RMS): the
  converted model in float32, and in bfloat16 divided by the original's own bfloat16 error (the ratio
  ``tests/test_bf16_fidelity.py`` holds to ≤ 1.1 on the zoo);
* ``normswap.plan(model, example_inputs=...)`` (the analysis ``patch`` runs) with a batch of real padded
  sentences as the analysis inputs: are the verdicts the CLI's?

    python benchmarks/bench_field.py minilm=/path/all-MiniLM-L6-v2 mpnet=/path/all-mpnet-base-v2 \\
        --json field.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recovery import figures, paragraphs  # noqa: E402


def run_cli(src: Path, out: Path) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-c", "from normswap.cli import main; main()",
           "convert", str(src), "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    row = {"exit": proc.returncode, "wall_s": round(wall, 1),
           "peak_rss_mb": round(int(rss.group(1)) / 1024) if rss else None,
           "notes": [ln for ln in proc.stderr.splitlines() if ln.startswith(("note:", "error:"))],
           "summary": proc.stdout.strip().splitlines()[:1]}
    if proc.returncode == 0:
        manifest = json.loads((out / "config.json").read_text())["normswap"]
        row["counts"] = {k: v for k, v in manifest["counts"].items() if v}
        row["verification"] = {k: v for k, v in manifest.get("verification", {}).items()
                               if isinstance(v, (int, float))}
    return row


@torch.no_grad()
def states(model: torch.nn.Module, batches: list[dict]) -> list[torch.Tensor]:
    """Last hidden states at the real tokens, float64, per batch."""
    out = []
    for enc in batches:
        h = model(**enc).last_hidden_state
        out.append(h.double()[enc["attention_mask"].bool()])
    return out


def rel_rms(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(ref, got, strict=True))
    den = sum(float(a.pow(2).sum()) for a in ref)
    return (num / den) ** 0.5


def errors(src: Path, out: Path, texts: list[str]) -> dict:
    """fp32 error and bf16 ratio, against the float64 original, on token states."""
    from transformers import AutoModel, AutoTokenizer

    import normswap

    tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    batches = [tok(texts[i:i + 16], padding=True, truncation=True, max_length=128, return_tensors="pt")
               for i in range(0, len(texts), 16)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        original = AutoModel.from_pretrained(str(src), local_files_only=True).eval()
    converted = normswap.load(out)
    ref = states(copy.deepcopy(original).double(), batches)
    row = {"fp32_rel_rms_error": rel_rms(ref, states(converted, batches)),
           "fp32_original_rel_rms_error": rel_rms(ref, states(original, batches))}
    o16 = rel_rms(ref, states(copy.deepcopy(original).to(torch.bfloat16), batches))
    c16 = rel_rms(ref, states(copy.deepcopy(converted).to(torch.bfloat16), batches))
    row.update(bf16_original_rel_rms_error=o16, bf16_converted_rel_rms_error=c16, bf16_ratio=c16 / o16)
    return row


def embeddings(src: Path, out: Path, held: list[str]) -> dict:
    import sentence_transformers as st

    import normswap  # noqa: F401 - registers the converted model types for AutoModel

    a = st.SentenceTransformer(str(src), device="cpu")
    b = st.SentenceTransformer(str(out), device="cpu")
    ea = a.encode(held, convert_to_tensor=True, batch_size=32).double()
    eb = b.encode(held, convert_to_tensor=True, batch_size=32).double()
    return figures(ea, eb)


def planned_on_real_inputs(src: Path, texts: list[str]) -> dict:
    """``normswap.plan`` (the analysis ``patch`` runs) with real padded sentences as the analysis
    inputs: the verdict counts, to compare with the CLI's (which analyses random ids)."""
    from transformers import AutoModel, AutoTokenizer

    import normswap

    tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModel.from_pretrained(str(src), local_files_only=True).eval()
        enc = dict(tok(texts[:8], padding=True, truncation=True, max_length=128, return_tensors="pt"))
        t0 = time.perf_counter()
        plan = normswap.plan(model, example_inputs=enc)
    return {"plan_counts": {k: v for k, v in plan.counts().items() if v},
            "plan_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="NAME=DIR (a sentence-transformers directory)")
    ap.add_argument("--json", default=None, help="append one JSON object per model to this file")
    ap.add_argument("--held-out", type=int, default=200)
    args = ap.parse_args()
    held, _ = paragraphs()
    held = held[:args.held_out]
    torch.manual_seed(0)
    for spec in args.models:
        name, _, path = spec.partition("=")
        src = Path(path)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out"
            row = {"model": name, "path": str(src), "torch": torch.__version__}
            row["cli"] = run_cli(src, out)
            print(json.dumps({"model": name, "cli": row["cli"]}), flush=True)
            if row["cli"]["exit"] == 0:
                row["embeddings"] = embeddings(src, out, held)
                print(json.dumps({"model": name, "embeddings": row["embeddings"]}), flush=True)
                row["errors"] = errors(src, out, held[:64])
                print(json.dumps({"model": name, "errors": row["errors"]}), flush=True)
            row["real_inputs"] = planned_on_real_inputs(src, held)
            print(json.dumps({"model": name, "real_inputs": row["real_inputs"]}), flush=True)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
