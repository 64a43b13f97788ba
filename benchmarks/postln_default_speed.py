"""Post-LN encoders: the default conversion (mean carry) against ``--per-norm-centering --no-mean-carry`` (a centering
op before each Post-LN norm), each against the original, in speed: torch eager per call at batch 1 and short
sequences (the host cost of one call), ``torch.compile`` (inductor, CPU) and ONNX Runtime float (issue 40, round 58).

Real checkpoints (a sentence-transformers directory: all-MiniLM-L6-v2, all-mpnet-base-v2; never in tests). Variants
are ``bench_quant_encoders.py``'s: ``converted`` (``normswap.patch`` defaults: 12 MLPs widened by the carry, the
attention-output norms approximate) and ``converted-pnc-nocarry`` (``per_norm_centering=True, mean_carry=False``: a
pre-hook ``x - mean(x)`` on every Post-LN RMSNorm but the embedding one, the MLPs at stock width). Inputs: the first
of ``bench_quant_encoders``' English paragraphs, cut to ``--tokens`` tokens, batch 1 (``--batch`` adds more).

Timing reuses ``bench_deploy_speed.py``'s ABBA quads (original, variant, variant, original; the calling thread's CPU
time; one thread), median of the per-quad ratio with its quartiles. Each torch cell pools two halves with second
copies of both models allocated in opposite orders (memory placement, as ``bench_deploy_speed``); ORT cells pool two
halves whose sessions are created in opposite orders (``abba_sessions``; the legacy opset-17 export the quantizers
read). Columns: each variant against the original, ``pnc`` against ``converted`` directly, and the original against
its second copy (A/A: the noise floor). ``torch.compile`` (``dynamic=False``, one compile per model and shape) is
timed at ``--compile-tokens`` only, first copies only (and the original's second copy for the A/A), one ABBA run per
pair (compiles take minutes on a loaded 2-core machine; before round 58's last run the A/A was not compiled).

    OMP_NUM_THREADS=1 python benchmarks/postln_default_speed.py MINILM MPNET --budget 6 --json speed.json
    OMP_NUM_THREADS=1 python benchmarks/postln_default_speed.py MINILM --engines eager --budget 3   # quick
    OMP_NUM_THREADS=1 python benchmarks/postln_default_speed.py MINILM --engines eager,ort \
        --variants converted-exact-nocarry converted-pnc-nocarry     # the Post-LN norms left LayerNorm, vs the ops
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_deploy_speed as deploy  # noqa: E402 (the benchmarks folder is on the path only now)
import bench_quant_encoders as encoders  # noqa: E402

VARIANTS = ("converted", "converted-pnc-nocarry")


def pairs_of(variants: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Each variant against the original, the second against the first, and the original's A/A."""
    return (*((v, "original") for v in variants), *(((variants[1], variants[0]),) if len(variants) > 1 else ()),
            ("original2", "original"))


PAIRS = pairs_of(VARIANTS)


def halves(calls: dict[str, Any], a: str, b: str, budget: float, min_quads: int) -> dict[str, float]:
    """``a`` against ``b`` over two halves: the first copies, then the second copies (allocated in the opposite
    order); A/A (``original2`` against ``original``) is one run of the two copies."""
    if a == "original2":
        return deploy.abba(calls[b], calls[a], budget, min_quads)
    part = [deploy.quads(calls[b + s], calls[a + s], budget / 2, max(1, (min_quads + 1) // 2)) for s in ("", "2")]
    return deploy.summary(part[0][0] + part[1][0], part[0][1] + part[1][1])


def cell(m: dict[str, float]) -> str:
    return f"**{m['ratio']:.3f}** ({m['q1']:.3f}–{m['q3']:.3f}, {m['quads']})"


def run_model(model_dir: Path, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in tok.model_input_names]
    original = AutoModel.from_pretrained(model_dir).float().eval()
    models = {"original": original}
    for v in VARIANTS:
        models[v] = encoders.build(v, original, model_dir)[0].eval()
    # second copies, allocated in the opposite order
    models |= {k + "2": copy.deepcopy(m) for k, m in reversed(list(models.items()))}
    bodies = {k: encoders.Body(m, names).eval() for k, m in models.items()}
    text = encoders.english(1)[0]
    rows = []

    def example(batch: int, n: int) -> tuple[torch.Tensor, ...]:
        enc = tok([text] * batch, truncation=True, max_length=n, return_tensors="pt")
        return tuple(enc[k] for k in names)

    shapes = [(b, n) for b in args.batch for n in args.tokens]
    if "eager" in args.engines:
        for b, n in shapes:
            ex = example(b, n)
            calls = {k: deploy.torch_call(body, ex) for k, body in bodies.items()}
            rows.append({"model": model_dir.name, "engine": "eager", "batch": b, "tokens": ex[0].shape[1],
                         **{f"{a}/{c}": halves(calls, a, c, args.budget, args.min_quads) for a, c in PAIRS}})
            print(row_line(rows[-1]), flush=True)
    if "compile" in args.engines:
        b, n = args.batch[0], args.compile_tokens
        ex = example(b, n)
        compiled, t_compile = {}, {}
        # first copies, and the original's second copy for the A/A
        for k, body in [(k, b) for k, b in bodies.items() if not k.endswith("2") or k == "original2"]:
            t0 = time.perf_counter()
            compiled[k] = torch.compile(body, dynamic=False)
            with torch.inference_mode():
                compiled[k](*ex)
            t_compile[k] = time.perf_counter() - t0
        calls = {k: deploy.torch_call(c, ex) for k, c in compiled.items()}
        rows.append({"model": model_dir.name, "engine": "compile", "batch": b, "tokens": ex[0].shape[1],
                     "compile_s": t_compile,
                     **{f"{a}/{c}": deploy.abba(calls[c], calls[a], args.budget, args.min_quads) for a, c in PAIRS}})
        print(row_line(rows[-1]), flush=True)
        del compiled, calls
        torch._dynamo.reset()
        gc.collect()
    if "ort" in args.engines:
        full = encoders.batches(tok, [text], 128, names)[0]
        paths = {}
        for k in ("original", *VARIANTS):
            paths[k] = tmp / f"{model_dir.name}-{k}.onnx"
            encoders.export(models[k], full, paths[k])
        ops = {k: encoders.ort_norm_ops(p) for k, p in paths.items()}
        for b, n in shapes:
            ex = example(b, n)
            row: dict[str, Any] = {"model": model_dir.name, "engine": "ort", "batch": b, "tokens": ex[0].shape[1],
                                   "ops": ops}
            for a, c in PAIRS:
                pa = paths["original"] if a == "original2" else paths[a]
                row[f"{a}/{c}"] = deploy.abba_sessions(paths[c], pa, ex, args.budget, args.min_quads)
            rows.append(row)
            print(row_line(rows[-1]), flush=True)
    return rows


def row_line(row: dict[str, Any]) -> str:
    cells = " | ".join(cell(row[f"{a}/{c}"]) if f"{a}/{c}" in row else "–" for a, c in PAIRS)
    return (f"| {row['model']} | {row['engine']} | {row['batch']} | {row['tokens']} | {cells} | "
            f"{row[f'{PAIRS[0][0]}/original']['original_ms']:.2f} |")


def main(argv: list[str] | None = None) -> None:
    global VARIANTS, PAIRS  # --variants: what run_model builds and times
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", type=Path, nargs="+", help="sentence-transformers directories")
    ap.add_argument("--engines", default="eager,compile,ort")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--compile-tokens", type=int, default=16)
    ap.add_argument("--budget", type=float, default=6.0, help="seconds of ABBA quads per pair and cell")
    ap.add_argument("--min-quads", type=int, default=10)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=encoders.CONVERTED,
                    help="bench_quant_encoders' conversions (the first two also timed against each other)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.engines = args.engines.split(",")
    VARIANTS, PAIRS = tuple(args.variants), pairs_of(tuple(args.variants))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    load0 = os.getloadavg()
    rows: list[dict[str, Any]] = []
    print("| model | engine | batch | tokens | " + " | ".join(f"{a} / {c}" for a, c in PAIRS) + " | original ms |")
    print("|" + "---|" * (len(PAIRS) + 5))
    with tempfile.TemporaryDirectory() as tmp:
        for d in args.models:
            rows += run_model(d, args, Path(tmp))
            if args.json:
                args.json.write_text(json.dumps({"rows": rows, "load_before": load0, "torch": torch.__version__},
                                                indent=1))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "load_before": load0, "load_after": os.getloadavg(),
                                         "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
