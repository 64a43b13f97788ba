"""OpenVINO (CPU plugin): a converted model against its LayerNorm original, in speed and in NNCF quantization.

An engine the rest of the benchmarks do not name (issue 40's "engines that are not named here").

**Speed** (``speed``, the default): the models of ``bench_deploy_speed.py`` (GPT-2 small, BERT-base,
ViT-B/16 at 64 and 128 px; random weights, LayerNorm γ/β and every bias randomised; body only), each
original and converted (``normswap.patch``; BERT ``mode="all"``), through OpenVINO's two import routes:

* ``torch``: ``openvino.convert_model(module, example_input=...)`` straight from the PyTorch model;
* ``onnx``: ``openvino.convert_model("model.onnx")`` of the file ``torch.onnx.export(dynamo=True)`` writes
  (default opset, dynamic batch and sequence: the export docs/deployment.md shows).

Each converted OpenVINO model is saved as IR (``.xml``/``.bin``) in ``--cache`` and compiled on the CPU
plugin with one inference thread and one stream, at two inference precisions: ``default`` (the plugin's
own choice: bf16 on a CPU with AVX-512 BF16 or AMX, f32 otherwise; what a user gets) and ``f32``
(``INFERENCE_PRECISION_HINT=f32``). Before timing, the compiled model's runtime graph
(``compiled.get_runtime_model()``) is counted: ``RMS`` nodes (OpenVINO's fused RMS kernel, from its
``RMSFusion`` transformation) in the converted model, ``MVN`` (its LayerNorm kernel) in the original.

Timing reuses ``bench_deploy_speed.py``'s ABBA quads (original, converted, converted, original) and
summary, timed by the calling thread's CPU time (OpenVINO's CPU plugin with one inference thread runs the
request on the calling thread: measured, thread CPU time equals process CPU time), pooled over two
halves whose compiled models are created in opposite orders. ``--control`` adds the original against
a second compiled copy of itself (the A/A noise floor).

**Quantization** (``quant --model DIR``): a sentence encoder (a transformers directory, e.g.
all-MiniLM-L6-v2, all-mpnet-base-v2), with ``bench_quant_encoders.py``'s texts, export (legacy ONNX
exporter, opset 17), pooling and metric (1 − cos of the pooled embedding against the float32 original
in torch, per text, over ``--texts`` paragraphs; ratio to the original in the same quantizer with a 95%
paired bootstrap interval). Each variant's ONNX file is read by ``openvino.convert_model`` and quantized
by NNCF: ``w8`` (``nncf.compress_weights`` defaults: int8 asymmetric per channel), ``w4s128`` /
``w4a128`` / ``w4s32`` (int4 symmetric / asymmetric, group 128 / 32, RTN, NNCF's defaults otherwise:
``ratio=1``, the embedding and last layer in int8), ``static`` (``nncf.quantize``, ``ModelType.TRANSFORMER``,
int8 weights and activations, calibrated on ``--calib`` held-out paragraphs not used in the measurement).
Every variant runs with ``INFERENCE_PRECISION_HINT=f32``, so the error is the quantization's, not bf16's.
Variants: ``original``; ``converted`` (``normswap.patch`` defaults, the native format); ``compat``
(``normswap.save(format="compat")`` of the same, loaded back by plain transformers: refused for a
Post-LN encoder, whose default conversion has approximate norms; recorded as not measured);
``compat-exact`` (``mode="exact"``: only the exact norms converted, the rest kept as LayerNorm, saved
as compat and loaded back); ``converted-nocarry`` (``mean_carry=False``: no widened FFN, those norms
approximate too). int4 groups use ``group_size_fallback_mode=ADJUST`` (see :func:`nncf_quantize`).

**Pre-LN real checkpoints** (round 64): ``quant-vision --dinov2 DIR NAME=DIR ... --photos SKIMAGE/data`` (DINOv2:
1 − cos of the CLS embedding and of every token per photo crop, calibration crops from photographs the measured
ones never come from; :func:`quant_vision`) and ``quant-whisper --whisper DIR NAME=DIR ... --speech CLIPS`` (Whisper's
decoder and head teacher-forced on the original encoder's states: KL and top-1 disagreements per clip;
:func:`quant_whisper`). ``NAME=DIR``: ``normswap convert`` outputs. Ratios to the original in the same quantizer
with a 95% paired bootstrap over inputs (:func:`add_ratios`).

    python benchmarks/bench_openvino.py speed --control --json ov_speed.json     # ~20-30 min, loaded 2-core box
    python benchmarks/bench_openvino.py speed --models gpt2 --layers 2 --budget 1  # plumbing check
    python benchmarks/bench_openvino.py fusion --layers 2        # only the runtime op counts
    python benchmarks/bench_openvino.py speed --models bert --routes torch --quick --no-mean-carry --control
    python benchmarks/bench_openvino.py quant --model DIR --texts 256 --json ov_quant.json
    python benchmarks/bench_openvino.py quant --model DIR --baseline ov_quant.json --variants compat-exact
    python benchmarks/bench_openvino.py quant-vision --dinov2 ORIG native=CONV --photos SKIMAGE/data --json d.json
    python benchmarks/bench_openvino.py quant-whisper --whisper ORIG native=CONV --speech CLIPS --json w.json

Needs ``openvino`` (speed) and ``nncf`` (quant); neither is a normswap dependency. Results:
docs/results/openvino.md.
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import json
import logging
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_deploy_speed as deploy  # noqa: E402 (the benchmarks folder is on the path only now)
import bench_quant_encoders as encoders  # noqa: E402

ROUTES = ("torch", "onnx")
PRECISIONS = ("default", "f32")
QUANT_MODES = ("fp32", "w8", "w4s128", "w4a128", "w4s32", "static")


def core():
    import openvino as ov

    return ov.Core()


def compile_ir(path: Path, precision: str):
    """The IR at ``path`` compiled on the CPU plugin: one inference thread, one stream, ``precision``."""
    config: dict[str, Any] = {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1}
    if precision != "default":
        config["INFERENCE_PRECISION_HINT"] = precision
    return core().compile_model(str(path), "CPU", config)


def runtime_ops(compiled) -> collections.Counter:
    """Op types of the compiled model's runtime graph (what the plugin executes after its fusions)."""
    return collections.Counter(op.get_rt_info()["layerType"].astype(str)
                               for op in compiled.get_runtime_model().get_ops())


def source_ops(path: Path) -> collections.Counter:
    """Op types of the IR before compilation (what the import route wrote)."""
    return collections.Counter(op.get_type_name() for op in core().read_model(str(path)).get_ops())


def ir_call(compiled, example: tuple[torch.Tensor, ...]):
    request = compiled.create_infer_request()
    feed = [t.numpy() for t in example]
    return lambda: request.infer(feed)


def to_ir(body: torch.nn.Module, example: tuple[torch.Tensor, ...], route: str, out: Path,
          onnx_path: Path) -> None:
    """``body`` converted by OpenVINO's ``route`` and saved as IR at ``out`` (cached: kept if complete)."""
    import openvino as ov

    done = out.with_suffix(".done")
    if out.exists() and done.exists():
        return
    logging.disable(logging.WARNING)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if route == "torch":
                model = ov.convert_model(body, example_input=example)
            else:
                deploy.export(body, example, onnx_path, None)
                model = ov.convert_model(str(onnx_path))
    finally:
        logging.disable(logging.NOTSET)
    ov.save_model(model, str(out), compress_to_fp16=False)
    done.write_text("")


def prepare(name: str, label: str, px: int, layers: int, cache: Path, routes: list[str],
            mean_carry: bool = True, carry_multiple: int = 8) -> dict:
    """IR files per (variant, route) for one model; the torch models are freed before timing.
    ``mean_carry=False``: BERT converted without the mean carry (no FFN widened by 8 units);
    ``carry_multiple``: the widened FFN padded to a multiple of this instead of 8."""
    model, keys = deploy.build(name, px, layers)
    if mean_carry and carry_multiple == 8:
        converted, verdicts = deploy.convert(name, model)
    else:
        import normswap

        converted = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = normswap.patch(converted, mean_carry=mean_carry, carry_multiple=carry_multiple,
                                    **({"mode": "all", "calibration": False} if name == "bert" else {}))
        verdicts = dict(collections.Counter(site.verdict for site in report.sites))
        converted.eval()
    norms = sum(type(m).__name__ == "RMSNorm" for m in converted.modules())
    example = deploy.inputs_for(name, 2, px or 16)
    paths: dict[tuple[str, str], Path] = {}
    for variant, m in (("original", model), ("converted", converted)):
        body = deploy.Body(m, keys).eval()
        for route in routes:
            tag = "-nocarry" if not mean_carry else f"-carry{carry_multiple}" if carry_multiple != 8 else ""
            stem = f"{label}-L{layers}-{variant}" + (tag if variant == "converted" else "")
            path = cache / f"{stem}-{route}.xml"
            t0 = time.perf_counter()
            to_ir(body, example, route, path, cache / f"{stem}-default.onnx")
            print(f"#   {path.name} ready in {time.perf_counter() - t0:.0f} s", flush=True)
            paths[(variant, route)] = path
    del model, converted
    gc.collect()
    return {"paths": paths, "verdicts": verdicts, "norms": norms}


def fusion(paths: dict[tuple[str, str], Path], precisions: list[str]) -> dict[str, dict[str, int]]:
    """Per variant/route/precision: norm-related op counts before and after the plugin's fusions."""
    keep_src = ("MVN", "RMS", "Power", "ReduceMean", "Sqrt", "Divide")
    keep_rt = ("MVN", "RMS", "Reduce", "Eltwise", "Math")
    counts: dict[str, dict[str, int]] = {}
    for (variant, route), path in paths.items():
        src = source_ops(path)
        for precision in precisions:
            rt = runtime_ops(compile_ir(path, precision))
            counts[f"{variant}/{route}/{precision}"] = (
                {f"ir:{k}": src[k] for k in keep_src if src[k]} | {k: rt[k] for k in keep_rt if rt[k]})
    return counts


def time_cells(paths: dict[tuple[str, str], Path], route: str, precision: str,
               examples: dict[tuple[int, int], tuple[torch.Tensor, ...]], args: argparse.Namespace) -> dict:
    """ABBA cells, converted against original (and original against a second copy with ``--control``),
    per shape, pooled over two halves whose compiled models are created in opposite orders."""
    pooled: dict[tuple[int, int], dict[str, tuple[list[float], list[float]]]] = {
        shape: {"cell": ([], []), "aa": ([], [])} for shape in examples}
    for original_first in (True, False):
        order = ("original", "converted") if original_first else ("converted", "original")
        compiled = {v: compile_ir(paths[(v, route)], precision) for v in order}
        if args.control:
            compiled["original2"] = compile_ir(paths[("original", route)], precision)
        for shape, example in examples.items():
            calls = {v: ir_call(c, example) for v, c in compiled.items()}
            least = max(1, (args.min_quads + 1) // 2)
            r, b = deploy.quads(calls["original"], calls["converted"], args.budget / 2, least)
            pooled[shape]["cell"][0].extend(r)
            pooled[shape]["cell"][1].extend(b)
            if args.control:
                r, b = deploy.quads(calls["original"], calls["original2"], args.budget / 2, least)
                pooled[shape]["aa"][0].extend(r)
                pooled[shape]["aa"][1].extend(b)
        del compiled, calls
        gc.collect()
    return {shape: {k: deploy.summary(*v) for k, v in cells.items() if v[0]} for shape, cells in pooled.items()}


def check_outputs(paths: dict[tuple[str, str], Path], route: str,
                  example: tuple[torch.Tensor, ...]) -> float:
    """Largest |converted − original| over the output at f32 precision (the conversion is exact for GPT-2
    and ViT; BERT's ``mode="all"`` is approximate)."""
    outs = [compile_ir(paths[(v, route)], "f32")([t.numpy() for t in example])[0]
            for v in ("original", "converted")]
    return float(np.abs(outs[0] - outs[1]).max())


def speed(args: argparse.Namespace) -> None:
    import openvino as ov

    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    deploy.CLOCK[0] = time.thread_time
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    info = (f"openvino {ov.__version__}, torch {torch.__version__}, Python {platform.python_version()}; "
            f"CPU plugin default precision {core().get_property('CPU', 'INFERENCE_PRECISION_HINT')}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {info}; {os.cpu_count()} CPUs; load "
          f"average {load_before[0]:.1f}", flush=True)
    rows: list[dict] = []
    ops: dict[str, Any] = {}
    for name in args.models.split(","):
        for label, px in deploy.variants(name):
            prep = prepare(name, label, px, args.layers, cache, args.routes, mean_carry=not args.no_mean_carry,
                           carry_multiple=args.carry_multiple)
            print(f"# {label}: {prep['norms']} RMSNorms, verdicts {prep['verdicts']}", flush=True)
            ops[label] = fusion(prep["paths"], args.precisions)
            for key, counts in ops[label].items():
                print(f"#   {key}: {counts}", flush=True)
            if args.fusion_only:
                continue
            examples = {(batch, n): deploy.inputs_for(name, batch, px or n)
                        for batch, n in deploy.shapes(label, args.quick)}
            diff = {route: check_outputs(prep["paths"], route, next(iter(examples.values())))
                    for route in args.routes}
            print(f"#   max |converted - original| at f32: {diff}", flush=True)
            for route in args.routes:
                for precision in args.precisions:
                    t0 = time.perf_counter()
                    cells = time_cells(prep["paths"], route, precision, examples, args)
                    for (batch, n), cell in cells.items():
                        row = {"model": label, "batch": batch, "tokens": (px // 16) ** 2 + 1 if px else n,
                               "route": route, "precision": precision, **cell}
                        rows.append(row)
                        aa = f"; A/A {cell['aa']['ratio']:.3f}" if "aa" in cell else ""
                        print(f"#   {route} {precision} b{batch} t{row['tokens']}: {cell['cell']['ratio']:.3f}{aa} "
                              f"({cell['cell']['original_ms']:.1f} ms)", flush=True)
                    print(f"#   ({time.perf_counter() - t0:.0f} s)", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"info": info, "ops": ops, "rows": rows}, indent=1))
    if args.fusion_only:
        return
    load_after = os.getloadavg()
    print()
    print(speed_table(rows, args.routes, args.precisions))
    print(f"\nmedian over ABBA quads of converted/original CPU time (quartiles, quads); 1 inference thread; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; "
          f"{time.perf_counter() - t_start:.0f} s in all; {' '.join(sys.argv[1:])}")
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "load": [load_before, load_after], "ops": ops,
                                               "rows": rows}, indent=1))


def speed_table(rows: list[dict], routes: list[str], precisions: list[str]) -> str:
    columns = [(r, p) for r in routes for p in precisions]
    lines = ["| model | batch | tokens | " + " | ".join(f"{r}, {p}" for r, p in columns) + " | original ms |",
             "|" + "---|" * (len(columns) + 4)]
    keys = list(dict.fromkeys((r["model"], r["batch"], r["tokens"]) for r in rows))
    for key in keys:
        cells, base = [], "–"
        for route, precision in columns:
            match = [r for r in rows if (r["model"], r["batch"], r["tokens"], r["route"], r["precision"])
                     == (*key, route, precision)]
            if not match:
                cells.append("–")
                continue
            m = match[0]["cell"]
            aa = match[0].get("aa")
            control = f"; A/A {aa['ratio']:.3f}" if aa else ""
            cells.append(f"**{m['ratio']:.3f}** ({m['q1']:.2f}–{m['q3']:.2f})" + control)
            if (route, precision) == columns[0]:
                base = f"{m['original_ms']:.1f}"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + f" | {base} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- quant


def variant_model(name: str, original: torch.nn.Module, model_dir: Path, workdir: Path) -> tuple[torch.nn.Module, str]:
    """``original``, one of ``bench_quant_encoders``' variants (native, in memory), ``compat`` (the default
    conversion saved with ``format="compat"`` and loaded back by transformers: fails where some norms are
    approximate, as in Post-LN encoders) or ``compat-exact`` (``mode="exact"``: only the exact norms
    converted, the others kept as LayerNorm, which the compat format can write)."""
    if not name.startswith("compat"):
        return encoders.build(name, original, model_dir)
    import transformers as tf

    import normswap

    model = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mode = {"mode": "exact"} if name == "compat-exact" else {}
        report = normswap.patch(model, tokenizer=str(model_dir), **mode)
        out = workdir / name
        normswap.save(model, out, format="compat", overwrite=True)
    del model
    return tf.AutoModel.from_pretrained(out).float().eval(), f"{report.plan.summary()}; compat checkpoint loaded back"


def nncf_quantize(ov_model, how: str, calib: list[dict], ignored: list[str] | None = None,
                  ignored_types: list[str] | None = None, ignored_patterns: list[str] | None = None):
    """``how``'s NNCF quantization of an OpenVINO model (a new model; the input is left as is); ``ignored``: names
    of ops NNCF leaves in float (its ``IgnoredScope``: a rotation's own MatMuls, :func:`rotation_ops`);
    ``ignored_types``: op types it leaves in float (``Gather``: the embedding tables ``compress_weights`` rounds);
    ``ignored_patterns``: regular expressions on op names (``re.match``) it leaves in float (one weight group)."""
    import nncf

    if how == "fp32":
        return ov_model
    scope = ({"ignored_scope": nncf.IgnoredScope(names=list(ignored or []), types=list(ignored_types or []),
                                                 patterns=list(ignored_patterns or []), validate=False)}
             if ignored or ignored_types or ignored_patterns else {})
    if how == "static":
        feeds = [{k: v.numpy() for k, v in b.items()} for b in calib]
        return nncf.quantize(ov_model.clone(), nncf.Dataset(feeds), model_type=nncf.ModelType.TRANSFORMER,
                             subset_size=len(feeds), **scope)
    if how == "w8":
        return nncf.compress_weights(ov_model.clone(), **scope)
    mode = nncf.CompressWeightsMode.INT4_SYM if how.startswith("w4s") else nncf.CompressWeightsMode.INT4_ASYM
    # ADJUST: a layer whose input width the group size does not divide gets a smaller power-of-two group
    # (>= 32) or, failing that, NNCF's int8 backup. NNCF's default (ERROR) refuses the converted encoders
    # outright: the mean carry widens each FFN output projection's input by 8 (MiniLM 1536 -> 1544)
    fallback = nncf.AdvancedCompressionParameters(group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST)
    return nncf.compress_weights(ov_model.clone(), mode=mode, group_size=int(how[3:]),
                                 advanced_parameters=fallback, **scope)


def rotation_ops(ov_model, matrices: list[torch.Tensor], tol: float = 1e-6) -> list[str]:
    """Friendly names of ``ov_model``'s MatMuls whose constant input is one of ``matrices`` (a rotation's own
    op matrices, ``normswap.rotation.onnx_nodes.rotation_matrices``; matched by value, either orientation, as
    ``float_nodes`` matches ONNX nodes): NNCF's weight compression would round them like a Linear's weight,
    so they go in its ignored scope."""
    shapes = {tuple(m.shape) for m in matrices} | {tuple(m.shape[::-1]) for m in matrices}
    names = []
    for op in ov_model.get_ops():
        if op.get_type_name() != "MatMul":
            continue
        for port in op.inputs():
            src = port.get_source_output().get_node()
            while src.get_type_name() in ("Convert", "Transpose"):  # a constant passed on
                src = src.input_value(0).get_node()
            if src.get_type_name() != "Constant" or tuple(src.get_output_shape(0)) not in shapes:
                continue
            value = torch.from_numpy(np.array(src.get_data(), dtype=np.float64))
            if any(value.shape == m.shape and torch.allclose(value, m, atol=tol, rtol=0)
                   or value.shape == m.T.shape and torch.allclose(value, m.T, atol=tol, rtol=0) for m in matrices):
                names.append(op.get_friendly_name())
                break
    return names


def low_bit_constants(ov_model) -> dict[str, int]:
    """How many weight constants of each low-bit element type the model holds (int4 against NNCF's int8
    backup: which layers a group size could not reach)."""
    kinds: collections.Counter = collections.Counter()
    for op in ov_model.get_ops():
        if op.get_type_name() == "Constant":
            t = op.get_element_type().get_type_name()
            if t in ("i4", "u4", "i8", "u8") and op.get_output_partial_shape(0).rank.get_length() >= 2:
                kinds[t] += 1
    return dict(kinds)


def embed_ov(ov_model, data: list[dict]) -> torch.Tensor:
    compiled = core().compile_model(ov_model, "CPU", {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1,
                                                      "INFERENCE_PRECISION_HINT": "f32"})
    out = []
    for b in data:
        h = compiled({k: v.numpy() for k, v in b.items()})[0]
        out.append(encoders.pooled(torch.from_numpy(np.asarray(h)), b["attention_mask"]))
    return torch.cat(out)


def quant(args: argparse.Namespace) -> dict[str, Any]:
    import nncf
    import openvino as ov
    from transformers import AutoModel, AutoTokenizer

    nncf.set_log_level(logging.ERROR)
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    original = AutoModel.from_pretrained(args.model).float().eval()
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in tok.model_input_names]
    texts = encoders.english(args.texts + args.calib)
    texts, calib_texts = texts[:args.texts], texts[args.texts:]
    data = encoders.batches(tok, texts, args.max_len, names)
    calib = encoders.batches(tok, calib_texts, args.max_len, names, size=1)  # one paragraph per sample
    ref = encoders.embed_torch(original, data)
    result: dict[str, Any] = {"model": str(args.model), "texts": len(texts), "calib": len(calib),
                              "max_len": args.max_len, "openvino": ov.__version__, "nncf": nncf.__version__,
                              "ignore_types": args.ignore_types, "ignore_patterns": args.ignore_patterns,
                              "cells": {}, "notes": {}, "per_text": {}}
    if args.baseline:  # an earlier run's original, same texts: its errors reused, not measured again
        encoders.reuse_baseline(result, args.baseline, args.modes)
        args.variants = [v for v in args.variants if v != "original"]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            try:
                model, note = variant_model(name, original, args.model, Path(tmp))
            except Exception as exc:  # noqa: BLE001  (e.g. a conversion compat cannot write: recorded, not fatal)
                result["notes"][name] = f"not measured: {type(exc).__name__}: {str(exc)[:300]}"
                print(f"{name}: {result['notes'][name]}", flush=True)
                continue
            result["notes"][name] = note
            path = Path(tmp) / f"{name}.onnx"
            encoders.export(model, data[0], path)
            ignored = None
            fp32 = ov.convert_model(str(path))
            if args.float_ops:  # a rotation's own MatMuls (online Hadamards) in NNCF's ignored scope
                from normswap.rotation.onnx_nodes import rotation_matrices

                ignored = rotation_ops(fp32, rotation_matrices(model))
                result["notes"][name] += f"; {len(ignored)} rotation MatMul(s) in NNCF's ignored scope"
            if model is not original:
                del model
            gc.collect()
            own = None
            for how in ["fp32", *[q for q in args.modes if q != "fp32"]]:
                quantized = nncf_quantize(fp32, how, calib, ignored, args.ignore_types, args.ignore_patterns)
                kinds = low_bit_constants(quantized)
                got = embed_ov(quantized, data)
                del quantized
                own = got if how == "fp32" else own
                err = (1 - (ref * got).sum(-1)).clamp(min=0).numpy()
                self_err = (1 - (own * got).sum(-1)).clamp(min=0).numpy()
                result["per_text"][f"{name}/{how}"] = err.tolist()
                result["cells"][f"{name}/{how}"] = {"err": float(err.mean()), "err_vs_own_fp32": float(self_err.mean()),
                                                    "constants": kinds}
                print(f"{name:10s} {how:7s} 1-cos {err.mean():.4e} (vs its own fp32 {self_err.mean():.4e}) {kinds}"
                      f"  [{time.time() - t0:.0f} s]", flush=True)
                gc.collect()
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))
    add_ratios(result)
    print(quant_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


def run_ov_vision(ov_model, px: torch.Tensor, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """An OpenVINO model of pixels (``bench_quant_engines.export``'s: pooler output, last hidden state) on ``px``,
    f32 inference, one thread: ``(CLS embeddings [n, dim], every token [n, tokens, dim])``."""
    compiled = core().compile_model(ov_model, "CPU", {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1,
                                                      "INFERENCE_PRECISION_HINT": "f32"})
    pooled, tokens = [], []
    for i in range(0, len(px), batch):
        out = compiled({"pixel_values": px[i:i + batch].numpy()})
        pooled.append(torch.from_numpy(np.asarray(out[0])).float())
        tokens.append(torch.from_numpy(np.asarray(out[1])).float())
    return torch.cat(pooled), torch.cat(tokens)


def quant_vision(args: argparse.Namespace) -> dict[str, Any]:
    """NNCF on a real DINOv2 checkpoint (``--dinov2 DIR``, a ``Dinov2Model`` directory) and its ``normswap convert``
    outputs (``NAME=DIR``, loaded by ``normswap.load``): each exported as ``bench_quant_engines.export`` does (legacy
    exporter, opset 17, dynamic batch), read by ``openvino.convert_model``, quantized by :func:`nncf_quantize`
    (``static``: calibrated on ``--calib`` crops of ``--calib-photos``, photographs the ``--images`` measured crops
    never come from), run at f32; error per image: 1 − cos of the CLS embedding (``cls``) and the mean over every
    token's (``tok``) against the float32 original in torch, ratio to the original's in the same quantizer with a 95%
    paired bootstrap interval over images."""
    import nncf
    import openvino as ov
    from bench_quant_engines import export, per_image
    from heldout_exactness import load
    from photo_crops import photo_crops, photographs

    nncf.set_log_level(logging.ERROR)
    torch.set_num_threads(1)
    calib_names = [n for n in args.calib_photos.split(",") if n]
    px = photo_crops(args.photos, args.images, args.image, seed=args.seed, exclude=calib_names)
    calib_files = [p for p in photographs(args.photos) if p.name in calib_names]
    if len(calib_files) != len(calib_names):
        raise SystemExit(f"bench_openvino: --calib-photos {args.calib_photos}: not all under {args.photos}")
    calib_px = photo_crops(files=calib_files, n=args.calib, size=args.image, seed=args.seed + 1)
    calib = [{"pixel_values": calib_px[i:i + 1]} for i in range(len(calib_px))]
    original = load(args.dinov2)
    with torch.no_grad():
        ref_cls, ref_tok = [], []
        for i in range(0, len(px), 16):
            out = original(pixel_values=px[i:i + 16])
            ref_cls.append(out.pooler_output.float())
            ref_tok.append(out.last_hidden_state.float())
        ref_cls, ref_tok = torch.cat(ref_cls), torch.cat(ref_tok)
    dirs = {"original": args.dinov2, **{k: Path(v) for k, v in (spec.split("=", 1) for spec in args.variants)}}
    result: dict[str, Any] = {"model": str(args.dinov2), "images": len(px), "image_px": args.image,
                              "calib": len(calib), "calib_photos": calib_names, "openvino": ov.__version__,
                              "nncf": nncf.__version__, "ignore_types": args.ignore_types,
                              "ignore_patterns": args.ignore_patterns, "variants": {k: str(v) for k, v in dirs.items()},
                              "cells": {}, "per_image": {}}
    if args.baseline:  # an earlier run's original (same crops): its errors reused
        encoders.reuse_baseline(result, args.baseline, args.modes, per="per_image",
                                inputs=("images", "image_px", "calib", "calib_photos"))
        dirs.pop("original")
    def measure(quantized) -> tuple[dict[str, Any], dict[str, Any], str]:
        cls, tok = run_ov_vision(quantized, px)
        errs = {"cls": per_image(ref_cls, cls).numpy(), "tok": per_image(ref_tok, tok).numpy()}
        return ({k: v.tolist() for k, v in errs.items()}, {k: float(v.mean()) for k, v in errs.items()},
                f"1-cos CLS {errs['cls'].mean():.4e} tokens {errs['tok'].mean():.4e}")

    measure_variants(result, "per_image", dirs, original, load, lambda model, path: export(model, px, path), measure,
                     calib, args)
    return finish(result, "per_image", args.json, lambda key, cell: (
        f"{key:24s} CLS {cell['ratio_cls']:.3f} ({cell['ci95_cls'][0]:.3f}-{cell['ci95_cls'][1]:.3f})  "
        f"tokens {cell['ratio_tok']:.3f} ({cell['ci95_tok'][0]:.3f}-{cell['ci95_tok'][1]:.3f})"))


class WhisperDecoderLogits(torch.nn.Module):
    """Whisper's decoder and head as one graph: (decoder ids, encoder states) → logits, teacher-forced."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.train(model.training)  # torch.onnx.export restores the wrapper's mode recursively

    def forward(self, decoder_input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        # an explicit all-ones mask, as bench_quant_whisper.TeacherForced (the exporter lacks aten::diff)
        return self.model(encoder_outputs=(encoder_hidden_states,), decoder_input_ids=decoder_input_ids,
                          decoder_attention_mask=torch.ones_like(decoder_input_ids), use_cache=False).logits


def quant_whisper(args: argparse.Namespace) -> dict[str, Any]:
    """NNCF on Whisper's decoder (``--whisper DIR``, the original, and its ``normswap convert`` outputs,
    ``NAME=DIR``), teacher-forced: each variant's decoder and head, (decoder ids, encoder states) → logits, exported
    by the legacy exporter (opset 17, dynamic batch and length), read by ``openvino.convert_model``, quantized by
    :func:`nncf_quantize` (``static``: calibrated on the ``--calib`` clips after the ``--clips`` measured ones,
    forced on their own transcripts), run at f32 one clip at a time. Every decoder reads the float32 original
    encoder's states (the conversions' encoders compute them to ~1e-6 in float): what is measured is the decoder's
    quantization alone (the whole model's encoder at 1,500 frames per clip was too slow on the loaded machine of
    round 64). Error per clip: the teacher-forced KL(float32 original in torch ‖ variant) summed over the clip's
    positions (``kl``), and the positions whose top-1 token differs (``disagree``); ratio to the original's in the
    same quantizer with a 95% paired bootstrap interval over clips."""
    import bench_quant_whisper as bqw
    import nncf
    import openvino as ov
    from bench_heldout_engines import whisper_encoded, whisper_logp
    from speech_samples import load_clips
    from transformers import AutoTokenizer

    nncf.set_log_level(logging.ERROR)
    torch.set_num_threads(1)
    bqw.set_prompt(args.whisper)
    clips = [c for d in args.speech for c in load_clips(d)]
    if len(clips) < args.clips + args.calib:
        raise SystemExit(f"bench_openvino: {len(clips)} clips, fewer than --clips {args.clips} + --calib {args.calib}")
    clips = clips[:args.clips + args.calib]
    feats = bqw.features(args.whisper, clips)
    spoken = AutoTokenizer.from_pretrained(args.whisper)
    refs = [spoken.encode(" " + text.strip(), add_special_tokens=False) for _, text in clips]
    ids = [torch.tensor([list(bqw.SOT_NOTS) + r]) for r in refs]
    p = len(bqw.SOT_NOTS)
    original = bqw.whisper_model(args.whisper)
    enc = [e[k:k + 1] for e in whisper_encoded(original, feats) for k in range(len(e))]
    # whisper_logp reads the encoder's states per batch of 4 clips
    ref = whisper_logp(original, feats[:args.clips], refs[:args.clips],
                       [torch.cat(enc[i:min(i + 4, args.clips)]) for i in range(0, args.clips, 4)])
    measured = range(args.clips)
    calib = [{"decoder_input_ids": ids[j], "encoder_hidden_states": enc[j]} for j in range(args.clips, len(clips))]
    dirs = {"original": args.whisper, **{k: Path(v) for k, v in (spec.split("=", 1) for spec in args.variants)}}
    result: dict[str, Any] = {"model": str(args.whisper), "part": "decoder and head, teacher-forced",
                              "clips": args.clips, "calib": len(calib),
                              "positions": sum(len(refs[j]) + 1 for j in measured), "openvino": ov.__version__,
                              "nncf": nncf.__version__, "ignore_types": args.ignore_types,
                              "ignore_patterns": args.ignore_patterns, "variants": {k: str(v) for k, v in dirs.items()},
                              "cells": {}, "per_clip": {}}
    if args.baseline:  # an earlier run's original (same clips and calibration): its errors reused
        encoders.reuse_baseline(result, args.baseline, args.modes, per="per_clip",
                                inputs=("clips", "calib", "positions"))
        dirs.pop("original")
    def export_decoder(model: torch.nn.Module, path: Path) -> None:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(WhisperDecoderLogits(model), (ids[0], enc[0]), str(path),
                              input_names=["decoder_input_ids", "encoder_hidden_states"], output_names=["logits"],
                              dynamic_axes={"decoder_input_ids": {0: "batch", 1: "len"},
                                            "encoder_hidden_states": {0: "batch"},
                                            "logits": {0: "batch", 1: "len"}}, dynamo=False, opset_version=17)

    def measure(quantized) -> tuple[dict[str, Any], dict[str, Any], str]:
        compiled = core().compile_model(quantized, "CPU", {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1,
                                                           "INFERENCE_PRECISION_HINT": "f32"})
        got = []
        for j in measured:
            logits = np.asarray(compiled({"decoder_input_ids": ids[j].numpy(),
                                          "encoder_hidden_states": enc[j].numpy()})[0])
            got.append(torch.log_softmax(torch.from_numpy(logits[0, p - 1: p + len(refs[j])]).double(), -1).float())
        cmp = bqw.compare(ref, got)
        disagree = [n - a for n, a in zip(cmp["clip_n"], cmp["clip_agree"], strict=True)]
        return ({"kl": cmp["clip_kl"], "disagree": disagree}, {"kl": cmp["kl"], "top1": cmp["top1"]},
                f"KL {cmp['kl']:.4e} top-1 {cmp['top1']:.4f}")

    measure_variants(result, "per_clip", dirs, original, bqw.whisper_model, export_decoder, measure, calib, args)
    return finish(result, "per_clip", args.json, lambda key, cell: (
        f"{key:24s} KL {cell['ratio_kl']:.3f} ({cell['ci95_kl'][0]:.3f}-{cell['ci95_kl'][1]:.3f})  "
        f"top-1 disagreements {cell['ratio_disagree']:.3f}"))


def measure_variants(result: dict[str, Any], per: str, dirs: dict[str, Path], original: torch.nn.Module,
                     load_model: Callable[[Path], torch.nn.Module],
                     export_model: Callable[[torch.nn.Module, Path], None],
                     measure: Callable[[Any], tuple[dict[str, Any], dict[str, Any], str]],
                     calib: list[dict], args: argparse.Namespace) -> None:
    """The loop ``quant-vision`` and ``quant-whisper`` share: each model of ``dirs`` (``original`` is the one in
    memory, the others ``load_model(dir)``) exported to ONNX by ``export_model``, read by ``openvino.convert_model``
    and quantized by :func:`nncf_quantize` in float and every ``--modes`` entry; ``measure(quantized)`` gives the
    per-input errors (``result[per]``), the cell's means and the printed figures. The JSON is rewritten after each
    model, so a long run keeps what it measured."""
    import openvino as ov

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in dirs.items():
            model = original if name == "original" else load_model(Path(path))
            onnx_path = Path(tmp) / f"{name}.onnx"
            export_model(model, onnx_path)
            del model  # the converted model, before its graph is quantized (the original stays the caller's)
            fp32 = ov.convert_model(str(onnx_path))
            for how in ["fp32", *[q for q in args.modes if q != "fp32"]]:
                quantized = nncf_quantize(fp32, how, calib, None, args.ignore_types, args.ignore_patterns)
                kinds = low_bit_constants(quantized)
                per_input, cell, figures = measure(quantized)
                del quantized
                result[per][f"{name}/{how}"] = per_input
                result["cells"][f"{name}/{how}"] = {**cell, "constants": kinds}
                print(f"{name:12s} {how:7s} {figures} {kinds}  [{time.time() - t0:.0f} s]", flush=True)
                gc.collect()
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))


def finish(result: dict[str, Any], per: str, json_path: Path | None,
           line: Callable[[str, dict[str, Any]], str]) -> dict[str, Any]:
    """The end of a multi-metric run (``quant-vision``, ``quant-whisper``): each quantized cell's ratios to the
    original's (:func:`add_ratios` over ``result[per]``), one printed ``line`` per cell that has them, the JSON."""
    add_ratios(result, per=per)
    for key, cell in result["cells"].items():
        if "ratio" in cell:
            print(line(key, cell))
    if json_path:
        json_path.write_text(json.dumps(result, indent=1))
    return result


def add_ratios(result: dict[str, Any], per: str = "per_text") -> None:
    """Give each quantized cell ``name/how`` of ``result`` (not the original's, not ``fp32``) its error over the
    original's in the same quantizer, ``ratio``, and a 95% paired bootstrap interval over inputs, ``ci95``, from the
    per-input errors in ``result[per]``. A value there may be a list (one metric) or a dict of lists (several:
    ``{"cls": [...], "tok": [...]}``, each ratio then ``ratio_<metric>``/``ci95_<metric>``, the first metric's
    also as ``ratio``/``ci95``). Cells without the original's errors in the same quantizer get none."""
    for key, cell in result["cells"].items():
        name, how = key.split("/")
        base_key = f"original/{how}"
        if name == "original" or how == "fp32" or base_key not in result[per] or key not in result[per]:
            continue
        got, base = result[per][key], result[per][base_key]
        pairs = got.items() if isinstance(got, dict) else [("", got)]
        for i, (metric, values) in enumerate(pairs):
            err, ref = np.asarray(values, dtype=float), np.asarray(base[metric] if metric else base, dtype=float)
            ratio, ci = float(err.mean() / ref.mean()), encoders.bootstrap(err, ref)
            if metric:
                cell[f"ratio_{metric}"], cell[f"ci95_{metric}"] = ratio, ci
            if i == 0:
                cell["ratio"], cell["ci95"] = ratio, ci


def quant_table(result: dict[str, Any]) -> str:
    return encoders.table(result, {"w8": "int8 weights", "w4s128": "int4 sym g128", "w4a128": "int4 asym g128",
                                   "w4s32": "int4 sym g32", "static": "static int8"})


def gemm_widths(widths: list[int], rows_list: list[int], precisions: list[str], budget: float) -> str:
    """BERT-base's FFN alone (768 -> width -> 768, GELU, biases) in OpenVINO's CPU plugin, one thread, at each
    width against the stock 3072: does a width the mean carry pads to (3080 by default; ``carry_multiple``
    16/32/64/128 give 3088/3104/3136/3200) cost OpenVINO's GEMMs more than its FLOPs? Median ABBA quad
    ratio (quartiles, quads); A/A = 3072 against a second compiled copy."""
    import openvino as ov

    cache = Path(tempfile.mkdtemp(prefix="normswap-ov-gemm-"))

    def compiled(width: int, rows: int, precision: str, copy_no: int = 0):
        torch.manual_seed(width + copy_no)
        ffn = torch.nn.Sequential(torch.nn.Linear(768, width), torch.nn.GELU(), torch.nn.Linear(width, 768)).eval()
        path = cache / f"ffn{width}-{rows}-{copy_no}.xml"
        if not path.exists():
            ov.save_model(ov.convert_model(ffn, example_input=torch.randn(rows, 768)), str(path),
                          compress_to_fp16=False)
        model = compile_ir(path, precision)
        x = np.random.default_rng(0).standard_normal((rows, 768)).astype(np.float32)
        request = model.create_infer_request()
        return lambda: request.infer([x])

    deploy.CLOCK[0] = time.thread_time
    cols = [*map(str, widths), "A/A"]
    lines = ["| precision | rows | " + " | ".join(f"{c} / 3072" for c in cols) + " | 3072 µs |",
             "|" + "---|" * (len(cols) + 3)]
    for precision in precisions:
        for rows in rows_list:
            base, cells = compiled(3072, rows, precision), []
            for c in cols:
                other = compiled(3072, rows, precision, 1) if c == "A/A" else compiled(int(c), rows, precision)
                m = deploy.abba(base, other, budget, 5)
                cells.append(f"**{m['ratio']:.3f}** ({m['q1']:.2f}–{m['q3']:.2f}, {m['quads']})")
            lines.append(f"| {precision} | {rows} | " + " | ".join(cells) + f" | {1e3 * m['original_ms']:.0f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    for cmd in ("speed", "fusion"):
        p = sub.add_parser(cmd)
        p.add_argument("--models", default="gpt2,bert,vit")
        p.add_argument("--routes", default=",".join(ROUTES))
        p.add_argument("--precisions", default=",".join(PRECISIONS))
        p.add_argument("--layers", type=int, default=12)
        p.add_argument("--quick", action="store_true", help="batch 1 and 4 at the short length only")
        p.add_argument("--budget", type=float, default=6.0, help="seconds of ABBA quads per cell (both halves)")
        p.add_argument("--min-quads", type=int, default=5)
        p.add_argument("--control", action="store_true", help="also the original against a second copy (A/A)")
        p.add_argument("--cache", default=os.environ.get("TMPDIR", "/tmp") + "/normswap-openvino-bench")
        p.add_argument("--json", default=None)
        p.add_argument("--no-mean-carry", action="store_true",
                       help="convert with mean_carry=False (BERT: no FFN widened by the mean carry)")
        p.add_argument("--carry-multiple", type=int, default=8,
                       help="convert with carry_multiple=N (BERT: the carried FFNs padded to a multiple of N)")
    g = sub.add_parser("gemm", help="BERT's FFN alone at the widths the mean carry pads to, against 3072")
    g.add_argument("--widths", default="3080,3088,3104,3136,3200")
    g.add_argument("--rows", default="8,32,128")
    g.add_argument("--precisions", default="f32,default")
    g.add_argument("--budget", type=float, default=4.0)
    q = sub.add_parser("quant")
    q.add_argument("--model", type=Path, required=True, help="a sentence-transformers transformers directory")
    q.add_argument("--texts", type=int, default=256)
    q.add_argument("--calib", type=int, default=100, help="held-out paragraphs for nncf.quantize")
    q.add_argument("--max-len", type=int, default=128)
    q.add_argument("--variants", nargs="+",
                   default=["original", "converted", "compat", "compat-exact", "converted-nocarry"])
    q.add_argument("--modes", nargs="+", default=list(QUANT_MODES), choices=QUANT_MODES)
    q.add_argument("--float-ops", action="store_true", help="NNCF leaves a rotation's own ops (online Hadamards: "
                   "bench_quant_encoders' online-… variants) in float: its ignored scope")
    q.add_argument("--ignore-types", nargs="+", metavar="OP", help="op types NNCF leaves in float (its IgnoredScope; "
                   "Gather: the embedding tables compress_weights rounds): whose rounding an excess comes from")
    q.add_argument("--ignore-patterns", nargs="+", metavar="REGEX", help="op names NNCF leaves in float (its "
                   "IgnoredScope patterns, re.match on OpenVINO's names, e.g. '.*/intermediate/dense/MatMul'): "
                   "one weight group's share of an excess")
    q.add_argument("--json", type=Path)
    q.add_argument("--baseline", type=Path, help="an earlier --json of the same model and texts: its original's "
                   "errors are reused")
    v = sub.add_parser("quant-vision", help="NNCF on a real DINOv2 checkpoint and its conversions, photo crops")
    v.add_argument("--dinov2", type=Path, required=True, help="the original Dinov2Model directory")
    v.add_argument("variants", nargs="*", metavar="NAME=DIR", help="normswap convert outputs")
    v.add_argument("--photos", type=Path, required=True, help="scikit-image's skimage/data")
    v.add_argument("--calib-photos", default="motorcycle_right.png,gravel.png,brick.png",
                   help="photographs for the calibration crops, left out of the measured ones")
    v.add_argument("--calib", type=int, default=64, help="calibration crops for nncf.quantize")
    v.add_argument("--images", type=int, default=256)
    v.add_argument("--image", type=int, default=112, help="crop size in pixels")
    v.add_argument("--seed", type=int, default=1)
    v.add_argument("--modes", nargs="+", default=["fp32", "static"], choices=QUANT_MODES)
    v.add_argument("--ignore-types", nargs="+", metavar="OP")
    v.add_argument("--ignore-patterns", nargs="+", metavar="REGEX")
    v.add_argument("--json", type=Path)
    v.add_argument("--baseline", type=Path, help="an earlier --json of the same crops: its original's errors")
    w = sub.add_parser("quant-whisper", help="NNCF on Whisper's decoder, teacher-forced KL per clip")
    w.add_argument("--whisper", type=Path, required=True, help="the original Whisper directory")
    w.add_argument("variants", nargs="*", metavar="NAME=DIR", help="normswap convert outputs")
    w.add_argument("--speech", type=Path, nargs="+", required=True, help="speech_samples.py clip directories")
    w.add_argument("--clips", type=int, default=64, help="measured clips (the first ones)")
    w.add_argument("--calib", type=int, default=16, help="calibration clips for nncf.quantize (the next ones)")
    w.add_argument("--modes", nargs="+", default=["fp32", "static"], choices=QUANT_MODES)
    w.add_argument("--ignore-types", nargs="+", metavar="OP")
    w.add_argument("--ignore-patterns", nargs="+", metavar="REGEX")
    w.add_argument("--json", type=Path)
    w.add_argument("--baseline", type=Path, help="an earlier --json of the same clips: its original's errors")
    commands = ("speed", "fusion", "quant", "quant-vision", "quant-whisper", "gemm")
    args = parser.parse_args(sys.argv[1:] if len(sys.argv) > 1 and sys.argv[1] in commands
                             else ["speed", *sys.argv[1:]])
    if args.command == "quant":
        quant(args)
        return
    if args.command == "quant-vision":
        quant_vision(args)
        return
    if args.command == "quant-whisper":
        quant_whisper(args)
        return
    if args.command == "gemm":
        print(gemm_widths([int(w) for w in args.widths.split(",")], [int(r) for r in args.rows.split(",")],
                          args.precisions.split(","), args.budget))
        return
    args.routes = [r for r in args.routes.split(",") if r]
    args.precisions = [p for p in args.precisions.split(",") if p]
    args.fusion_only = args.command == "fusion"
    speed(args)


if __name__ == "__main__":
    main()
