"""OpenVINO's CPU plugin: what ``--writer-centering op`` / ``auto`` cost in speed, float32 and NNCF int8 weights.

Round 54 measured the accuracy side (DINOv2-small in NNCF's int8 weights: the default conversion 1.128× the
original's error, ``op`` 0.995×, ``auto`` 0.999×); the two settings add a centering op (one ``ReduceMean`` and one
``Subtract``) after each of the 24 writers. This script times them against the original and the default, side by
side, in one process, and counts what the plugin runs.

Models (``--models``):

* ``dinov2``: the real DINOv2-small (``--dinov2 DIR``), exported as the round-54 accuracy runs export it
  (``bench_quant_engines.export``: ``torch.onnx.export(dynamo=False)``, opset 17, dynamic batch; one file per
  resolution) and read by ``openvino.convert_model("model.onnx")``; shapes ``--dinov2-shapes`` (batch × px);
* ``gpt2``: a GPT-2-small-shaped decoder (12 layers, width 768, random weights, LayerNorm γ/β and biases
  randomised: ``bench_deploy_speed.build``), read by ``openvino.convert_model(module, example_input=...)``
  (``bench_openvino.to_ir``, the torch route), ``use_cache=False``: prefill ``1 × 128`` and one token ``1 × 1``
  (a decode step *without* the past: the same per-token work in the norms, ops and matmuls, no attention over a
  cache);
* ``bert``: a BERT-base-shaped encoder, the same way (``mode="all"``, no calibration): ``--writer-centering op``
  refuses it in round 55 (verification, model left unchanged), so it is recorded and only ``auto`` (no op on it)
  is timed.

Variants: ``original``; ``native`` (``normswap.patch(beta_placement="keep")``: what ``normswap convert`` writes);
``op`` (the same with ``writer_centering="op"``); ``auto`` (``writer_centering="auto"``); ``original2``, a second
compiled copy of the original (the A/A control). A variant whose plan has no writer op (``auto`` on GPT-2 and BERT)
is the default's graph and is not timed twice (recorded as such).

Precisions (``--precisions``): ``f32`` (``INFERENCE_PRECISION_HINT=f32``) and ``w8`` (``nncf.compress_weights``
defaults, int8 asymmetric per output channel, compiled at ``f32``; the CPU plugin's defaults otherwise, so its
dynamic quantization of the compressed MatMuls' inputs is on, as in round 54's accuracy runs); ``default`` (the
plugin's own precision: bf16 on a CPU with AVX-512 BF16) on request.

Timing: one inference thread, one stream (``INFERENCE_NUM_THREADS=1``, ``NUM_STREAMS=1``), timed by the calling
thread's CPU time (checked against the process's CPU time at start: with one thread the plugin runs the request on
the calling thread). A round runs the original, each variant in turn, the variants again in reverse order, and the
original again; a variant's ratio in that round is its two times over the original's two (a linear drift cancels
for every variant). The variants' order turns by one each round: a variant nearer the middle of a round ran faster
(round 55's first runs: monotonic in position, the innermost, run twice back to back, up to 8% faster), so each
variant takes every position equally often (``--rounds`` a multiple of twice the variants). Median over rounds,
with a 95% bootstrap interval of the median (rounds resampled). Rounds are pooled over two halves whose compiled
models are created in opposite orders (memory placement). Before timing, each compiled model's runtime graph
(``compiled.get_runtime_model()``) is counted by layer type: ``RMS`` (the fused RMSNorm), ``MVN`` (LayerNorm, or a
centering op fused with the norm after it), ``Reduce`` (an unfused mean).

    PYTHONPATH=OV:$PWD OMP_NUM_THREADS=1 python benchmarks/ov_writer_ops_speed.py --dinov2 /tmp/ck50/dinov2-small \\
        --models dinov2 gpt2 --rounds 16 --json ov55_speed.json
    python benchmarks/ov_writer_ops_speed.py --dinov2 DIR --models dinov2 --ops-only   # op counts only
    ... --onnx-dir DIR: the DINOv2 exports kept there as VARIANT-PX.onnx and reused (a variant whose files are all
    there is not converted again: DINOv2's conversion takes minutes)

Needs ``openvino`` and ``nncf`` (not normswap dependencies). Results: docs/results/deploy-speed.md.
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_deploy_speed as deploy  # noqa: E402 (the benchmarks folder is on the path only now)

VARIANTS = ("native", "op", "auto")
KEEP_LAYERS = ("RMS", "MVN", "Reduce", "Eltwise", "Subgraph", "FullyConnected")


def build_variant(original: torch.nn.Module, name: str, model: str) -> tuple[torch.nn.Module | None, str]:
    """``name``'s conversion of ``original`` (a copy) and a one-line note; ``None`` where ``patch`` refuses it."""
    import normswap

    if name == "original":
        return original, "the original"
    kwargs: dict[str, Any] = {"beta_placement": "keep"}
    if model == "bert":
        kwargs |= {"mode": "all", "calibration": False}
    if name != "native":
        kwargs["writer_centering"] = name
    converted = copy.deepcopy(original)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = normswap.patch(converted, **kwargs)
    except Exception as exc:  # noqa: BLE001 (a refusal is a result: recorded, not fatal)
        return None, f"refused: {type(exc).__name__}: {str(exc)[:200]}"
    ops = sum(len(getattr(m, "_normswap_hooks", {})) for m in converted.modules())
    return converted.eval(), f"{ops} centering op(s); {report.plan.summary()}"


def runtime_layers(compiled) -> dict[str, int]:
    counts = collections.Counter(op.get_rt_info()["layerType"].astype(str)
                                 for op in compiled.get_runtime_model().get_ops())
    return {k: counts[k] for k in KEEP_LAYERS}


def compile_model(ov_model, precision: str):
    import openvino as ov

    config: dict[str, Any] = {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1}
    if precision != "default":
        config["INFERENCE_PRECISION_HINT"] = "f32"
    return ov.Core().compile_model(ov_model, "CPU", config)


def for_precision(ov_model, precision: str):
    """The OpenVINO model to compile for ``precision``: NNCF's int8 weights for ``w8``, else as it is."""
    if precision != "w8":
        return ov_model
    import nncf

    return nncf.compress_weights(ov_model.clone())


def ir_models(model: str, variants: dict[str, torch.nn.Module | None], shapes: list[tuple[int, int]], work: Path,
              onnx_dir: Path | None = None) -> dict[tuple[str, int], Any]:
    """OpenVINO models per (variant, shape key): DINOv2 one per resolution (its ONNX export fixes the size; read
    from ``onnx_dir`` where a file of that name is there, a variant then not built), the text models one per
    variant (the torch route's IR has dynamic shapes)."""
    import openvino as ov

    out: dict[tuple[str, int], Any] = {}
    logging.disable(logging.WARNING)
    try:
        for name, m in variants.items():
            if model == "dinov2":
                from bench_quant_engines import export

                for px in sorted({p for _, p in shapes}):
                    path = (onnx_dir or work) / f"{name}-{px}.onnx"
                    if not path.exists():  # ``--onnx-dir``: a cache of these exports, kept between runs
                        with torch.no_grad():
                            export(m, torch.randn(2, 3, px, px), path)
                    out[(name, px)] = ov.convert_model(str(path))
            else:
                from bench_openvino import to_ir

                body = deploy.Body(m, ("input_ids", "attention_mask")).eval()
                path = work / f"{model}-{name}.xml"
                to_ir(body, deploy.inputs_for(model, 2, 16), "torch", path, work / f"{model}-{name}.onnx")
                model_ir = ov.Core().read_model(str(path))
                for key in sorted({p for _, p in shapes}):
                    out[(name, key)] = model_ir
    finally:
        logging.disable(logging.NOTSET)
    return out


def example_for(model: str, batch: int, size: int) -> list[np.ndarray]:
    if model == "dinov2":
        gen = torch.Generator().manual_seed(batch * 1000 + size)
        return [torch.randn(batch, 3, size, size, generator=gen).numpy()]
    return [t.numpy() for t in deploy.inputs_for(model, batch, size)]


def median_ci(values: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """Median and a 95% percentile-bootstrap interval of the median."""
    arr = np.array(values)
    rng = np.random.default_rng(0)
    meds = np.median(arr[rng.integers(0, len(arr), size=(draws, len(arr)))], axis=1)
    return float(np.median(arr)), float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def time_cell(compiled: dict[str, Any], feed: list[np.ndarray], rounds: int, clock) -> dict[str, list[float]]:
    """``rounds`` rounds of original, v1 … vn, vn … v1, original: per variant, its time over the original's."""
    requests = {k: c.create_infer_request() for k, c in compiled.items()}
    names = [k for k in compiled if k != "original"]
    for r in requests.values():  # warm-up
        r.infer(feed)
        r.infer(feed)
    ratios: dict[str, list[float]] = {k: [] for k in names}
    base: list[float] = []
    for r in range(rounds):
        t: dict[str, float] = collections.defaultdict(float)
        turn = names[r % len(names):] + names[:r % len(names)]  # every variant in every position as often
        for k in ["original", *turn, *turn[::-1], "original"]:
            t0 = clock()
            requests[k].infer(feed)
            t[k] += clock() - t0
        for k in names:
            ratios[k].append(t[k] / t["original"])
        base.append(t["original"] / 2)
    ratios["original_ms"] = [1e3 * b for b in base]
    return ratios


def run(args: argparse.Namespace) -> dict[str, Any]:
    import nncf
    import openvino as ov

    nncf.set_log_level(logging.ERROR)
    torch.set_num_threads(1)
    clock = time.thread_time
    result: dict[str, Any] = {"openvino": ov.__version__, "nncf": nncf.__version__, "torch": torch.__version__,
                              "cpus": os.cpu_count(), "load_before": os.getloadavg(), "argv": sys.argv[1:],
                              "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "threads": "INFERENCE_NUM_THREADS=1, NUM_STREAMS=1; OMP_NUM_THREADS="
                              + os.environ.get("OMP_NUM_THREADS", "unset"),
                              "notes": {}, "layers": {}, "max_abs_diff": {}, "cells": []}
    print(f"# {result['started']}; openvino {ov.__version__}, nncf {nncf.__version__}; load {result['load_before']}",
          flush=True)
    for model in args.models:
        if model == "dinov2":
            import transformers as tf

            original = tf.Dinov2Model.from_pretrained(args.dinov2).float().eval()
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.dinov2_shapes]
        else:
            original, _ = deploy.build(model, 0, args.layers)
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.text_shapes]
        variants: dict[str, torch.nn.Module | None] = {"original": original}
        for name in args.variants:
            if model == "dinov2" and args.onnx_dir and all(
                    (args.onnx_dir / f"{name}-{px}.onnx").exists() for _, px in shapes):
                variants[name] = None  # every export cached: not converted again
                result["notes"][f"{model}/{name}"] = f"read from {args.onnx_dir}"
                continue
            m, note = build_variant(original, name, model)
            result["notes"][f"{model}/{name}"] = note
            print(f"# {model}/{name}: {note}", flush=True)
            if m is None:
                continue
            if name != "native" and note.startswith("0 centering op"):
                result["notes"][f"{model}/{name}"] += " (the default's graph: not timed again)"
                continue
            variants[name] = m
        with tempfile.TemporaryDirectory() as tmp:
            if args.onnx_dir:
                args.onnx_dir.mkdir(parents=True, exist_ok=True)
            irs = ir_models(model, variants, shapes, Path(tmp), args.onnx_dir if model == "dinov2" else None)
        del variants
        gc.collect()
        for precision in args.precisions:
            for key in sorted({p for _, p in shapes}):
                names = [n for n, k in irs if k == key]
                prepared = {n: for_precision(irs[(n, key)], precision) for n in names}
                for n in names:
                    compiled = compile_model(prepared[n], precision)
                    result["layers"][f"{model}/{n}/{key}/{precision}"] = runtime_layers(compiled)
                    print(f"#   {model}/{n}/{key}/{precision}: {result['layers'][f'{model}/{n}/{key}/{precision}']}",
                          flush=True)
                    del compiled
                if args.ops_only:
                    continue
                for batch, size in [s for s in shapes if s[1] == key]:
                    feed = example_for(model, batch, size)
                    pooled: dict[str, list[float]] = collections.defaultdict(list)
                    for half in (0, 1):
                        order = names if half == 0 else names[::-1]
                        compiled = {n: compile_model(prepared[n], precision) for n in order}
                        compiled["original2"] = compile_model(prepared["original"], precision)
                        compiled = {"original": compiled.pop("original"), **compiled}
                        if half == 0 and precision == "f32":
                            outs = {n: c(feed)[0] for n, c in compiled.items()}
                            for n, o in outs.items():
                                result["max_abs_diff"][f"{model}/{n}/{batch}x{size}"] = float(
                                    np.abs(o - outs["original"]).max())
                        if half == 0:
                            req = compiled["original"].create_infer_request()
                            req.infer(feed)
                            p0, t0 = time.process_time(), time.thread_time()
                            for _ in range(3):
                                req.infer(feed)
                            result["notes"][f"clock/{model}/{batch}x{size}/{precision}"] = (
                                f"thread {time.thread_time() - t0:.3f} s, process {time.process_time() - p0:.3f} s")
                        got = time_cell(compiled, feed, (args.rounds + 1) // 2, clock)
                        for k, v in got.items():
                            pooled[k].extend(v)
                        del compiled
                        gc.collect()
                    cell: dict[str, Any] = {"model": model, "batch": batch, "size": size, "precision": precision,
                                            "load": os.getloadavg()[0], "rounds": len(pooled["original_ms"]),
                                            "original_ms": statistics.median(pooled["original_ms"]), "ratios": {},
                                            "raw": dict(pooled)}
                    for k in [n for n in ("op", "auto") if n in pooled and "native" in pooled]:
                        # the setting against the default, round by round (both sit symmetrically in a round)
                        pooled[f"{k}/native"] = [a / b for a, b in zip(pooled[k], pooled["native"], strict=True)]
                    for k, v in pooled.items():
                        if k != "original_ms":
                            med, lo, hi = median_ci(v)
                            cell["ratios"][k] = {"median": med, "lo": lo, "hi": hi}
                    result["cells"].append(cell)
                    print(f"#   {model} {batch}x{size} {precision} ({cell['original_ms']:.1f} ms, {cell['rounds']} "
                          f"rounds, load {cell['load']:.1f}): " + ", ".join(
                              f"{k} {r['median']:.3f} ({r['lo']:.3f}-{r['hi']:.3f})"
                              for k, r in cell["ratios"].items()),
                          flush=True)
                    if args.json:
                        args.json.write_text(json.dumps(result, indent=1))
                del prepared
                gc.collect()
        del irs, original
        gc.collect()
    result["load_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(table(result))
    return result


def table(result: dict[str, Any]) -> str:
    """Markdown: one row per cell (median, 95% interval), from each cell's rounds. The original always sits at a
    round's two ends, the variants and its second copy (``original2``) take the inner positions in turn; an inner
    position ran faster on this machine, so a variant is compared with the copy (``X / copy``: both took the same
    positions) and with the default (``op / native``), and ``A/A`` (the copy over the original) shows the ends'
    bias."""
    cols = [("native", "original2"), ("op", "original2"), ("auto", "original2"), ("op", "native"),
            ("auto", "native"), ("original2", None)]
    heads = ["native / copy", "op / copy", "auto / copy", "op / native", "auto / native", "A/A (copy / original)"]
    lines = ["| model | batch × size | precision | " + " | ".join(heads) + " | original ms | rounds |",
             "|" + "---|" * (len(cols) + 5)]
    for c in result["cells"]:
        raw = c["raw"]
        cells = []
        for num, den in cols:
            if num not in raw or (den and den not in raw):
                cells.append("–")
                continue
            per = raw[num] if den is None else [a / b for a, b in zip(raw[num], raw[den], strict=True)]
            med, lo, hi = median_ci(per)
            cells.append(f"**{med:.3f}** ({lo:.2f}–{hi:.2f})")
        lines.append(f"| {c['model']} | {c['batch']} × {c['size']} | {c['precision']} | " + " | ".join(cells)
                     + f" | {c['original_ms']:.1f} | {c['rounds']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["dinov2", "gpt2"], choices=("dinov2", "gpt2", "bert"))
    ap.add_argument("--dinov2", type=Path, help="the real DINOv2-small directory (Dinov2Model)")
    ap.add_argument("--dinov2-shapes", nargs="+", default=["1x224", "8x112"], help="BATCHxPX")
    ap.add_argument("--text-shapes", nargs="+", default=["1x128", "1x1"], help="BATCHxTOKENS")
    ap.add_argument("--layers", type=int, default=12, help="the random text models' depth")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--precisions", nargs="+", default=["f32", "w8"], choices=("f32", "w8", "default"))
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--onnx-dir", type=Path, help="DINOv2: keep (and reuse) the exports here, VARIANT-PX.onnx")
    ap.add_argument("--ops-only", action="store_true", help="the runtime layer counts only, no timing")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--from-json", type=Path, help="print an earlier --json's table")
    args = ap.parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        print(table(result))
        return result
    if "dinov2" in args.models and args.dinov2 is None:
        ap.error("--models dinov2 needs --dinov2 DIR")
    return run(args)


if __name__ == "__main__":
    main()
