"""Is a Post-LN sentence encoder's NNCF int8-weight cell a rounding draw? Paired exact re-roundings in NNCF itself
(issue 40, round 58).

Round 47 measured all-mpnet-base-v2's default conversion (the mean carry) at 1.115× (1.09-1.15) the original's error
in OpenVINO NNCF's int8 weights (``nncf.compress_weights`` defaults: INT8_ASYM, one scale per output row), on one
draw of rounded weights. This script re-draws the rounding of both models alike, exactly, as
``nncf_paired_draws.py`` does for DINOv2-small (its :func:`~nncf_paired_draws.haar`,
:func:`~nncf_paired_draws.bootstrap` and per-draw table :func:`~nncf_paired_draws.draw_rows` are reused), and runs
each re-rounded model through the same engine path as
``bench_openvino.py quant`` (legacy ONNX export at opset 17, ``openvino.convert_model``, ``nncf.compress_weights``,
the CPU plugin at ``INFERENCE_PRECISION_HINT=f32``, one thread) with ``bench_quant_encoders.py``'s texts, pooling
and metric (1 − cos of the pooled embedding against the float32 original in torch, per text).

Draw ``k`` (seed ``k``; draw 0 is the shipped pair, nothing changed) applies the same transforms to both models:

* per layer and head, one Haar-random orthogonal ``B`` (head dim × head dim) on the head's rows of the query and key
  projections and their biases (``q' = B q``, ``k' = B k``: ``q'ᵀk' = qᵀk``), and another, ``A``, on the value
  projection's rows and bias and the attention output projection's columns of that head (``v' = A v``,
  ``o' = o Aᵀ``). Exact in any network (the original, the carry, the centering ops; MPNet's relative position bias
  is added to the scores and is untouched).
* **Re-rounded by a per-row int8 grid:** every row of q, k, v (each is a mix of its head's rows) and every row of the
  attention output projection (its columns mixed within each head). **Not re-rounded:** the FFN's two dense layers
  (with the carry, its widened ``up``/``down``), the embeddings, and the pooler (unused). So a draw changes 4 of each
  layer's 6 weight matrices (1/3 of the encoder's Linear weights; the FFN holds the other 2/3 and keeps its
  shipped rounding in every draw).

Before any engine run each re-rounded model is checked against its own unre-rounded self on 8 texts: the pooled
embedding's ``max |Δ|`` in float32 ≤ 1e-5, and the transforms alone in float64 ≤ 1e-10; the run stops otherwise.

The ratio over draws is ``Σ_k Σ_i conv[k, i] / Σ_k Σ_i orig[k, i]``; intervals: 95% paired bootstrap, draws and
texts resampled independently (the same indices for both models), and draws alone (texts fixed). ``--json`` is
rewritten after every (draw, model); ``--resume`` / ``--first`` split the draws over two processes and
``--from-json`` merges and reports.

    PYTHONPATH=OV:$PWD OMP_NUM_THREADS=1 python benchmarks/nncf_encoder_draws.py MPNET --texts 128 --draws 6 \\
        --json mp_draws.json
    python benchmarks/nncf_encoder_draws.py MPNET --from-json mp_draws.json mp_draws2.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_encoders as encoders  # noqa: E402 (the benchmarks folder is on the path only now)
from nncf_paired_draws import bootstrap, draw_rows, haar  # noqa: E402


def attention_parts(layer: torch.nn.Module) -> tuple[torch.nn.Linear, torch.nn.Linear, torch.nn.Linear,
                                                     torch.nn.Linear]:
    """The query, key, value and output projections of one BERT-family encoder layer (MPNet: ``attention.attn.q``
    ...; BERT / MiniLM: ``attention.self.query`` ... and ``attention.output.dense``)."""
    att = layer.attention
    if hasattr(att, "attn"):
        a = att.attn
        return a.q, a.k, a.v, a.o
    return att.self.query, att.self.key, att.self.value, att.output.dense


@torch.no_grad()
def redraw(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of ``model`` (the original or a conversion) re-rounded by draw ``seed`` (module docstring): the same
    random numbers in the same order whatever the model, so two models get the same transforms. Seed 0: a copy."""
    out = copy.deepcopy(model)
    if seed == 0:
        return out
    gen = torch.Generator().manual_seed(seed)
    heads = out.config.num_attention_heads
    for layer in out.encoder.layer:
        q, k, v, o = attention_parts(layer)
        d = q.out_features // heads
        for h in range(heads):
            rows = slice(h * d, (h + 1) * d)
            b, a = haar(d, gen), haar(d, gen)
            for lin, turn in ((q, b), (k, b), (v, a)):
                lin.weight[rows] = (turn @ lin.weight[rows].double()).to(lin.weight.dtype)
                lin.bias[rows] = (turn @ lin.bias[rows].double()).to(lin.bias.dtype)
            o.weight[:, rows] = (o.weight[:, rows].double() @ a.T).to(o.weight.dtype)
    return out


@torch.no_grad()
def check_exact(model: torch.nn.Module, redrawn: torch.nn.Module, seed: int, data: dict) -> dict[str, float]:
    """``redrawn`` against ``model`` (its unre-rounded self) on one batch: pooled embeddings' ``max |Δ|`` in float32
    (≤ 1e-5) and of the transform alone in float64 (``redraw(model.double())``, ≤ 1e-10); stops the run otherwise."""
    a = encoders.embed_torch(model, [data])
    b = encoders.embed_torch(redrawn, [data])
    m64 = copy.deepcopy(model).double()
    a64 = encoders.embed_torch(m64, [data])
    b64 = encoders.embed_torch(redraw(m64, seed), [data])
    found = {"max32": float((a - b).abs().max()), "max64": float((a64 - b64).abs().max())}
    if not (found["max32"] <= 1e-5 and found["max64"] <= 1e-10):
        raise SystemExit(f"draw {seed}: not exact: {found}")
    return found


def report(result: dict[str, Any], variant: str) -> str:
    """Each draw's errors and ratio, and the ratio over draws with its intervals."""
    rows = result["draws"]
    done = sorted(int(k) for k in rows if "original" in rows[k] and variant in rows[k])
    if not done:
        return f"{variant}: no draw measured with the original"
    o = np.array([rows[str(k)]["original"] for k in done])
    c = np.array([rows[str(k)][variant] for k in done])
    lines = [f"{variant} / original, {result['texts']} texts, NNCF {result['mode']}; draws {done}", "",
             *draw_rows(done, o, c)]
    per = c.mean(1) / o.mean(1)
    for label, sel in (("every draw", slice(None)), ("re-roundings only (draw 0 left out)", slice(1, None))):
        cc, oo = c[sel], o[sel]
        if len(cc) < 2:
            continue
        r, lo, hi = bootstrap(cc, oo, None, mode="crops")
        _, dlo, dhi = bootstrap(cc, oo, None, mode="draws")
        lines.append(f"\n- {label} ({len(cc)}): ratio {r:.3f}; draws × texts resampled {lo:.3f}-{hi:.3f}; draws "
                     f"alone {dlo:.3f}-{dhi:.3f}; geometric mean of per-draw ratios "
                     f"{np.exp(np.log(per[sel]).mean()):.3f}"
                     f"; per draw {per[sel].min():.3f}-{per[sel].max():.3f}; draws above 1: {(per[sel] > 1).sum()}"
                     f" of {len(cc)}")
    checks = [v for k, v in result.get("exactness", {}).items() if k.startswith(variant + "|") or
              k.startswith("original|")]
    if checks:
        lines.append(f"\nexactness before compression ({len(checks)} re-rounded models, 16 texts, against the "
                     f"unre-rounded model): float32 max |Δ| ≤ {max(x['max32'] for x in checks):.1e}; the "
                     f"transforms alone in float64 ≤ {max(x['max64'] for x in checks):.1e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="the original encoder's transformers directory")
    ap.add_argument("--texts", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--draws", type=int, default=6, help="re-roundings K (seeds 1..K); draw 0, the shipped pair, too")
    ap.add_argument("--first", type=int, default=0, help="the first draw (to run the draws in two processes)")
    ap.add_argument("--variants", nargs="+", default=["converted"], choices=encoders.CONVERTED,
                    help="conversions paired with the original (bench_quant_encoders' names)")
    ap.add_argument("--mode", default="w8", help="bench_openvino's NNCF mode (w8, w4s128, w4a128)")
    ap.add_argument("--resume", type=Path, help="start from this --json file's rows")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--from-json", type=Path, nargs="+", help="no measuring: the report of earlier runs (merged)")
    args = ap.parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json[0].read_text())
        for extra in args.from_json[1:]:
            more = json.loads(extra.read_text())
            for k, row in more["draws"].items():
                result["draws"].setdefault(k, {}).update(row)
            result["exactness"].update(more.get("exactness", {}))
        if args.json:
            args.json.write_text(json.dumps(result))
        names = sorted({n for row in result["draws"].values() for n in row} - {"original"})
        print("\n\n".join(report(result, n) for n in names))
        return result
    import bench_openvino as bov
    import nncf
    import openvino as ov
    from transformers import AutoModel, AutoTokenizer

    nncf.set_log_level(logging.ERROR)
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    original = AutoModel.from_pretrained(args.model).float().eval()
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in tok.model_input_names]
    data = encoders.batches(tok, encoders.english(args.texts), args.max_len, names)
    ref = encoders.embed_torch(original, data)
    result: dict[str, Any] = {"model": str(args.model), "texts": len(ref), "mode": args.mode, "draws": {},
                              "exactness": {}, "notes": {}, "openvino": ov.__version__, "nncf": nncf.__version__}
    start = args.resume or args.json
    if start and start.exists():
        result = json.loads(start.read_text())
    bases = {"original": original}
    for name in args.variants:
        bases[name], result["notes"][name] = encoders.build(name, original, args.model)
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.first, args.draws + 1):
            row = result["draws"].setdefault(str(k), {})
            for name, base in bases.items():
                if name in row:
                    continue
                t0 = time.perf_counter()
                model = redraw(base, k)
                if k:
                    result["exactness"][f"{name}|{k}"] = check_exact(base, model, k, data[0])
                path = Path(tmp) / f"{name}.onnx"
                encoders.export(model, data[0], path)
                del model
                gc.collect()
                quantized = bov.nncf_quantize(ov.convert_model(str(path)), args.mode, [])
                got = bov.embed_ov(quantized, data)
                del quantized
                err = (1 - (ref * got).sum(-1)).clamp(min=0).numpy()
                row[name] = [float(f"{v:.5g}") for v in err]
                print(f"draw {k} {name:22s} 1-cos {err.mean():.4e} ({time.perf_counter() - t0:.0f} s)", flush=True)
                if args.json:
                    args.json.write_text(json.dumps(result))
                gc.collect()
    print("\n\n".join(report(result, n) for n in args.variants))
    return result


if __name__ == "__main__":
    main()
