"""Sentence encoders (real checkpoints) original vs converted, in ONNX Runtime int8: embedding cosine.

Each variant of a sentence-transformers encoder (a transformers directory: all-MiniLM-L6-v2,
all-mpnet-base-v2) is exported by ``torch.onnx.export`` (legacy exporter, opset 17, dynamic batch and
sequence) and quantized by ONNX Runtime's ``quantize_dynamic`` (int8 weights, dynamic uint8
activations), per tensor (``dyn-pt``) and per channel (``dyn-pc``), and the same with ``reduce_range=True``
(``dyn-pt-rr``, ``dyn-pc-rr``: 7-bit weights, ONNX Runtime's advice for CPUs without VNNI), with unsigned
weights (``dyn-pt-u8``, ``dyn-pc-u8``: U8U8, its other advice for them; :func:`dynamic_settings`) or both (``-u8rr``);
with ``--quantizers`` also
``quantize_static`` (``qdq``: QDQ format, int8 weights per tensor, uint8 activations calibrated by MinMax on
32 held-out paragraphs) and ``MatMulNBitsQuantizer`` 4-bit RTN (``nbits-rtn``: block 32, symmetric); and one engine
outside ONNX Runtime, ``torchao`` (torchao's ``Int8DynamicActivationInt8WeightConfig`` on the torch model itself,
every ``nn.Linear``: int8 weights per output channel, int8 activations per token, run in eager; round 61);
``torchao-emu`` computes the same int8 model at float speed (``whisper_paired_draws.TorchaoInt8Linear``: torchao's
grids and float32 order, the integer product as an exact float32 matmul; torch's CPU ``_int_mm`` took 40 minutes for
all-MiniLM-L6-v2's 256 texts on a loaded core), checked against torchao itself on the first batch (recorded in the
variant's note; the run stops above 1e-6 of the largest embedding entry; round 62). The
embedding is the model's own
pooling (mean over the attention mask, then L2-normalised, as its ``1_Pooling`` / ``Normalize``
modules do). The error of a text is ``1 − cos`` against the float32 original in torch; a cell is the
mean over the texts, and its ratio to the original's in the same quantizer comes with a 95% paired
bootstrap interval over texts (the same resampled texts for both).

Variants: ``original``; ``converted`` (``normswap.patch`` with default options: these are Post-LN
encoders, so some norms are approximate and calibrated on the built-in sentences); ``converted-fold``
(``beta_placement="fold"``: every β out of the norms, through the residual writers where the output is
also a residual); ``converted-keep`` (``beta_placement="keep"``); ``converted-nocarry``
(``mean_carry=False``: no MLP widened to carry a Post-LN mean, so those norms are approximate too);
``converted-pnc`` (``per_norm_centering=True``: a centering op before each Post-LN norm the carry leaves
approximate); ``converted-pnc-nocarry`` (``per_norm_centering=True, mean_carry=False``: a centering op
before every Post-LN norm, no MLP widened); ``converted-pnc-nocarry-keep`` (the same, every β kept in its
norm: what ``normswap convert --per-norm-centering --no-mean-carry`` writes); ``converted-exact-nocarry``
(``mode="exact", mean_carry=False``: only the exact norms converted, so every Post-LN norm stays the original's
LayerNorm); ``converted-exact-keep`` (``mode="exact", beta_placement="keep"``: the weights ``normswap convert
--format compat`` writes for a Post-LN encoder, the carry included, its approximate norms kept as LayerNorm);
``converted-nocarry-keep`` (``mean_carry=False, beta_placement="keep"``). ``online-VARIANT`` (``online``
alone: ``online-converted``): that variant's conversion, then ``normswap.rotate(model, "none", online=True)`` (no
stream turned; an online Hadamard before every Linear input: what ``--rotate none --online-hadamard`` adds);
``online-b32-VARIANT`` the same with ``online_block=32``. ``--float-ops`` leaves those ops' MatMuls in float in
ONNX Runtime's quantizers (``nodes_to_exclude``), as ``bench_quant_engines.py --float-ops`` does.
``--texts`` English paragraphs from Python's reference docs (offline, held out from the calibration
sentences), up to ``--max-len`` tokens.

    python benchmarks/bench_quant_encoders.py --model DIR --texts 256 --json out.json
    python benchmarks/bench_quant_encoders.py --model DIR --texts 256 --variants original \
        --checkpoint default=CONV_DIR ort-dynamic=CONV2_DIR --quantizers dyn-pt torchao   # the CLI's own outputs
    python benchmarks/bench_quant_encoders.py --model DIR --texts 16 --quantizers fp32 --speed 20 \
        --variants original converted converted-pnc-nocarry      # + ORT speed and norm ops, vs the original

``--speed SECONDS``: each variant's float ONNX file (the one the quantizers read) against the original's in
ONNX Runtime (default session optimisation, one thread), ABBA quads of ``bench_deploy_speed.py`` (thread CPU
time, two halves with sessions created in opposite orders) at batch 1 (the first text) and batch 16 (the
first batch), SECONDS per shape; and the norm-related op types in ORT's optimised graph of each file.

One variant at a time, single-threaded ONNX Runtime sessions; checkpoints never enter the tests.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_utils import BatchReader  # noqa: E402 (the benchmarks folder is on the path only now)

# dynamic int8: per tensor (pt) / per channel (pc); -rr: reduce_range (7-bit signed weights); -u8: unsigned 8-bit
# weights (U8U8, weight_type=QUInt8); -u8rr: both. The -rr and -u8 forms are ONNX Runtime's two documented answers
# to the saturation of its U8S8 kernel on x86-64 CPUs without VNNI (round 64)
DYNAMIC = ("dyn-pt", "dyn-pc", "dyn-pt-rr", "dyn-pc-rr", "dyn-pt-u8", "dyn-pc-u8", "dyn-pt-u8rr", "dyn-pc-u8rr")
QUANTIZERS = ("fp32", *DYNAMIC, "qdq", "nbits-rtn", "torchao", "torchao-emu")
DEFAULT_QUANTIZERS = ("fp32", "dyn-pt", "dyn-pc")
CALIBRATION_TEXTS = 32  # qdq's calibration paragraphs, the ones after the measured texts (held out)
CONVERTED = ("converted", "converted-fold", "converted-keep", "converted-nocarry", "converted-carry128",
             "converted-pnc", "converted-pnc-nocarry", "converted-pnc-nocarry-keep", "converted-exact-nocarry",
             "converted-exact-keep", "converted-nocarry-keep")
# online Hadamards on top of a conversion: online-<variant> (full op) and online-b32-<variant> (blocks of 32)
ONLINE = ("online", *(f"online-{v}" for v in CONVERTED), *(f"online-b32-{v}" for v in CONVERTED))
VARIANTS = ("original", *CONVERTED, *ONLINE)
OPTIONS: dict[str, dict[str, Any]] = {"converted": {}, "converted-fold": {"beta_placement": "fold"},
                                      "converted-keep": {"beta_placement": "keep"},
                                      "converted-nocarry": {"mean_carry": False},
                                      # the carry's MLPs padded to a multiple of 128 (int4 groups along that width)
                                      "converted-carry128": {"carry_multiple": 128},
                                      # a centering op before each Post-LN norm the carry does not make exact
                                      "converted-pnc": {"per_norm_centering": True},
                                      # a centering op before every Post-LN norm, no MLP widened (RMSNorm + op
                                      # is LayerNorm: nothing of the conversion left for a quantizer to round)
                                      "converted-pnc-nocarry": {"per_norm_centering": True, "mean_carry": False},
                                      # the same two with every β kept in its norm: what `normswap convert`
                                      # writes (its default since round 48, native or compat)
                                      "converted-pnc-nocarry-keep": {"per_norm_centering": True, "mean_carry": False,
                                                                     "beta_placement": "keep"},
                                      # only the exact norms converted and no carry: every Post-LN norm stays the
                                      # original's LayerNorm (no op, no widened MLP; round 58)
                                      "converted-exact-nocarry": {"mode": "exact", "mean_carry": False},
                                      # the exact norms converted (the carry's included), every β kept: the
                                      # weights `normswap convert --format compat` writes for a Post-LN encoder
                                      # (its approximate norms stay LayerNorm; round 61)
                                      "converted-exact-keep": {"mode": "exact", "beta_placement": "keep"},
                                      # no carry, every β kept (the attention- and FFN-output norms approximate)
                                      "converted-nocarry-keep": {"mean_carry": False, "beta_placement": "keep"}}


def english(n: int, seed: int = 0) -> list[str]:
    """``n`` English paragraphs from Python's reference docs (shipped with Python, offline)."""
    import pydoc_data.topics as topics
    import random

    paras = [" ".join(p.split()) for text in topics.topics.values() for p in text.split("\n\n")]
    paras = sorted({p for p in paras if len(p.split()) >= 8 and not p.startswith(("*", ">>>", "|"))})
    random.Random(seed).shuffle(paras)
    return paras[:n]


class Body(torch.nn.Module):
    """The encoder's ``last_hidden_state`` from explicit tensors (what the ONNX graph takes)."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model, self.names = model, names
        self.train(model.training)  # torch.onnx.export restores the wrapper's mode recursively

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, tensors, strict=True))).last_hidden_state


def pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the attention mask, L2-normalised (sentence-transformers' Pooling + Normalize)."""
    m = mask.to(hidden.dtype).unsqueeze(-1)
    e = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(e.double(), dim=-1)


def batches(tok: Any, texts: list[str], max_len: int, names: list[str], size: int = 16) -> list[dict]:
    out = []
    for i in range(0, len(texts), size):
        enc = tok(texts[i:i + size], padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        out.append({k: enc[k] for k in names})
    return out


def export(model: torch.nn.Module, example: dict, path: Path) -> None:
    names = list(example)
    axes = {n: {0: "batch", 1: "seq"} for n in names} | {"last_hidden_state": {0: "batch", 1: "seq"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Body(model, names), tuple(example.values()), str(path), input_names=names,
                          output_names=["last_hidden_state"], dynamic_axes=axes, dynamo=False, opset_version=17)


def dynamic_settings(how: str) -> dict[str, Any]:
    """``quantize_dynamic``'s settings for dynamic quantizer ``how`` (one of :data:`DYNAMIC`): ``per_channel``,
    ``reduce_range`` and ``weight_type`` (its name). Why the variants: on an x86-64 CPU without VNNI ONNX Runtime's
    U8S8 kernel (AVX2 ``vpmaddubsw``) adds two u8 × s8 products in int16, which saturates above 32767 (255 · 127 · 2
    does); ONNX Runtime's documented answers are ``reduce_range=True`` (7-bit weights: 255 · 63 · 2 fits) and the
    U8U8 format (``weight_type=QUInt8``), whose kernel widens to int16 before multiplying and cannot saturate."""
    if how not in DYNAMIC:
        raise ValueError(f"not a dynamic quantizer: {how!r} (one of {', '.join(DYNAMIC)})")
    tail = how.split("-")[2] if how.count("-") == 2 else ""
    return {"per_channel": how.startswith("dyn-pc"), "reduce_range": tail in ("rr", "u8rr"),
            "weight_type": "QUInt8" if tail.startswith("u8") else "QInt8"}


def quantize(fp32: Path, how: str, calib: list[dict] | None = None, exclude: list[str] | None = None) -> Path:
    """Write ``how``'s quantized model next to ``fp32`` with ONNX Runtime's own quantization tools; ``exclude``:
    node names every quantizer leaves in float (a rotation's own ops, ``--float-ops``)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    if how == "fp32":
        return fp32
    out = fp32.with_name(f"{fp32.stem}.{how}.onnx")
    if how in DYNAMIC:
        settings = dynamic_settings(how)
        weight_type = QuantType.QUInt8 if settings.pop("weight_type") == "QUInt8" else QuantType.QInt8
        quantize_dynamic(str(fp32), str(out), weight_type=weight_type, nodes_to_exclude=exclude or [], **settings)
    elif how == "qdq":
        assert calib is not None, "qdq needs calibration batches"
        feeds = [{k: v.numpy() for k, v in b.items()} for b in calib]
        quantize_static(str(fp32), str(out), BatchReader(feeds), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=False,
                        nodes_to_exclude=exclude or [])
    elif how == "nbits-rtn":
        import onnx
        from onnxruntime.quantization import matmul_nbits_quantizer as mq

        algo = mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True)
        q = mq.MatMulNBitsQuantizer(onnx.load(str(fp32)), block_size=32, is_symmetric=True, algo_config=algo,
                                    nodes_to_exclude=exclude or [])
        q.process()
        q.model.save_model_to_file(str(out), use_external_data_format=False)
    else:
        raise ValueError(how)
    return out


def embed_onnx(path: Path, data: list[dict]) -> torch.Tensor:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    out = []
    for b in data:
        (h,) = sess.run(None, {k: v.numpy() for k, v in b.items()})
        out.append(pooled(torch.from_numpy(h), b["attention_mask"]))
    return torch.cat(out)


def embed_torch(model: torch.nn.Module, data: list[dict]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([pooled(model(**b).last_hidden_state, b["attention_mask"]) for b in data])


def embed_torchao(model: torch.nn.Module, data: list[dict]) -> torch.Tensor:
    """A copy of ``model`` quantized by torchao's ``Int8DynamicActivationInt8WeightConfig`` (every ``nn.Linear``;
    anything else, the norms and a centering op included, stays float32), run in torch eager."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    q = copy.deepcopy(model)
    quantize_(q, Int8DynamicActivationInt8WeightConfig())
    return embed_torch(q, data)


def embed_torchao_emulated(model: torch.nn.Module, data: list[dict]) -> tuple[torch.Tensor, float]:
    """:func:`embed_torchao` computed by ``whisper_paired_draws.torchao_int8_emulated`` (every ``nn.Linear``'s
    forward replaced in place, so hooks on it still run), and its largest difference from torchao's own on the first
    batch, over the largest embedding entry there (0: bit for bit)."""
    from whisper_paired_draws import torchao_int8_emulated

    got = embed_torch(torchao_int8_emulated(model), data)
    real = embed_torchao(model, data[:1])
    n = len(real)
    return got, float((got[:n] - real).abs().max() / real.abs().max())


def bootstrap(err: np.ndarray, base: np.ndarray, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of ``mean(err)/mean(base)`` over texts resampled with replacement (paired)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(err), size=(draws, len(err)))
    ratios = err[idx].mean(1) / base[idx].mean(1)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(lo), float(hi)


CHECKPOINTS: dict[str, Path] = {}  # --checkpoint NAME=DIR: variants read from directories `normswap convert` wrote


def build(name: str, original: torch.nn.Module, model_dir: Path) -> tuple[torch.nn.Module, str]:
    if name == "original":
        return original, ""
    import normswap

    if name in CHECKPOINTS:  # what the CLI wrote (native: normswap.load re-applies the manifest; compat: stock)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = normswap.load(CHECKPOINTS[name]).float().eval()
        config = json.loads((CHECKPOINTS[name] / "config.json").read_text())
        fmt = "native" if str(config.get("model_type", "")).startswith("normswap_") else "compat"
        return model, f"checkpoint {CHECKPOINTS[name]} ({fmt}): {sum(p.numel() for p in model.parameters())} parameters"

    base, block = online_parts(name)
    model = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(model, tokenizer=str(model_dir), **OPTIONS[base])
        turned = normswap.rotate(model, "none", online=True, online_block=block) if name in ONLINE else None
    biased = sum(1 for m in model.modules() if isinstance(m, normswap.RMSNorm) and m.bias is not None)
    note = f"{report.plan.summary()}; RMSNorms keeping a bias: {biased}"
    return model, note + (f"; {turned.headline()}" if turned else "")


def online_parts(name: str) -> tuple[str, int | None]:
    """The conversion variant under an ``online…`` name and its ``online_block`` (``online-b32-converted-keep``
    → ``("converted-keep", 32)``; ``online`` → ``("converted", None)``); other names come back unchanged."""
    if name not in ONLINE:
        return name, None
    rest = name.removeprefix("online").removeprefix("-")
    block = None
    if rest.startswith("b32-"):
        block, rest = 32, rest.removeprefix("b32-")
    return rest or "converted", block


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a transformers directory (config + weights)")
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--variants", nargs="+", default=["original", "converted"], choices=VARIANTS)
    ap.add_argument("--checkpoint", nargs="+", default=[], metavar="NAME=DIR",
                    help="also measure these directories (what `normswap convert ... --out DIR` wrote) as variant NAME")
    ap.add_argument("--quantizers", nargs="+", default=list(DEFAULT_QUANTIZERS), choices=QUANTIZERS,
                    help="fp32 is always measured (the conversion's own error)")
    ap.add_argument("--float-ops", action="store_true", help="ONNX Runtime's quantizers leave a rotation's own "
                    "ops (online Hadamards) in float: nodes_to_exclude")
    ap.add_argument("--exclude-nodes", metavar="REGEX", help="ONNX Runtime's quantizers leave the nodes whose name "
                    "matches REGEX in float (nodes_to_exclude; e.g. 'layer\\.\\d+/output/dense/MatMul' for the FFN "
                    "output projections, '_embeddings/Gather' for the embedding tables quantize_dynamic rounds): "
                    "which weights' rounding a variant's excess comes from")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--baseline", type=Path, help="an earlier --json of the same model and texts: its "
                    "original's errors are reused (the original variant is not measured again)")
    ap.add_argument("--speed", type=float, default=0, metavar="SECONDS",
                    help="also time each variant's float ONNX file against the original's in ONNX Runtime")
    args = ap.parse_args(argv)
    from transformers import AutoModel, AutoTokenizer

    for item in args.checkpoint:
        name, _, path = item.partition("=")
        if not path or name in VARIANTS:
            ap.error(f"--checkpoint takes NAME=DIR with a NAME that is no built-in variant, not {item!r}")
        CHECKPOINTS[name] = Path(path)
        args.variants.append(name)
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    original = AutoModel.from_pretrained(args.model).float().eval()
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in tok.model_input_names]
    quantizers = ["fp32", *[q for q in args.quantizers if q != "fp32"]]
    texts = english(args.texts + CALIBRATION_TEXTS)
    texts, calib = texts[:args.texts], batches(tok, texts[args.texts:], args.max_len, names, size=8)
    data = batches(tok, texts, args.max_len, names)
    ref = embed_torch(original, data)
    result: dict[str, Any] = {"model": str(args.model), "texts": len(texts), "max_len": args.max_len,
                              "exclude_nodes": args.exclude_nodes, "cells": {}, "notes": {}, "per_text": {}}
    if args.baseline:
        reuse_baseline(result, args.baseline, quantizers)
        args.variants = [v for v in args.variants if v != "original"]
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            model, note = build(name, original, args.model)
            result["notes"][name] = note
            fp32 = Path(tmp) / f"{name}.onnx"
            export(model, data[0], fp32)
            exclude = []
            if args.float_ops:
                from normswap.rotation.onnx_nodes import float_nodes

                exclude = float_nodes(fp32, model)
                result["notes"][name] += f"; {len(exclude)} rotation MatMul(s) left in float"
            if args.exclude_nodes:
                import re

                import onnx

                matched = [n.name for n in onnx.load(str(fp32)).graph.node if re.search(args.exclude_nodes, n.name)]
                exclude += matched
                result["notes"][name] += f"; {len(matched)} node(s) matching {args.exclude_nodes!r} left in float"
            own = embed_onnx(fp32, data)
            for how in quantizers:
                if how == "torchao-emu":
                    got, diff = embed_torchao_emulated(model, data)
                    result["notes"][name] += f"; torchao-emu vs torchao, first batch: max |Δ| / max = {diff:.1e}"
                    if not diff <= 1e-6:
                        raise SystemExit(f"{name}: the torchao emulation is not torchao's computation ({diff:.1e})")
                else:
                    got = (own if how == "fp32" else embed_torchao(model, data) if how == "torchao"
                           else embed_onnx(quantize(fp32, how, calib, exclude), data))
                err = (1 - (ref * got).sum(-1)).clamp(min=0).numpy()
                self_err = (1 - (own * got).sum(-1)).clamp(min=0).numpy()
                result["per_text"][f"{name}/{how}"] = err.tolist()
                result["cells"][f"{name}/{how}"] = {"err": float(err.mean()), "err_vs_own_fp32": float(self_err.mean())}
                print(f"{name:15s} {how:7s} 1-cos {err.mean():.4e} (vs its own fp32 {self_err.mean():.4e})"
                      f"  [{time.time() - t0:.0f} s]", flush=True)
            if model is not original:
                del model
            if args.json:  # after each variant: a long run stopped early keeps what it measured
                args.json.write_text(json.dumps(result, indent=1))
        if args.speed:
            result["speed"] = speed(original, args.model, [v for v in args.variants if v != "original"],
                                    data[0], Path(tmp), args.speed)
    for key, cell in result["cells"].items():
        name, how = key.split("/")
        base = np.array(result["per_text"][f"original/{how}"])
        err = np.array(result["per_text"][key])
        if name != "original" and how != "fp32":
            cell["ratio"] = float(err.mean() / base.mean())
            cell["ci95"] = bootstrap(err, base)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


NORM_OPS = ("LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
            "SkipSimplifiedLayerNormalization", "ReduceMean", "Sub", "Pow", "Sqrt", "Div", "Reciprocal")


def ort_norm_ops(path: Path) -> dict[str, int]:
    """How many of each norm-related op type ONNX Runtime's optimised graph of ``path`` holds (its default
    session optimisation level): did it fuse a centering op and the RMSNorm after it into one kernel?"""
    import collections

    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.optimized_model_filepath = str(path.with_name(path.stem + ".ort-optimised.onnx"))
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    counts = collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)
    return {op: counts[op] for op in NORM_OPS if counts[op]}


def speed(original: torch.nn.Module, model_dir: Path, names: list[str], batch: dict, tmp: Path,
          seconds: float) -> dict[str, Any]:
    """Each variant's float ONNX file (exported again here, as for the quantizers) against the original's in
    ONNX Runtime, ABBA quads at batch 1 and at ``batch``'s size; and the norm ops of every optimised graph."""
    import bench_deploy_speed as deploy

    paths = {"original": tmp / "original.onnx"}
    if not paths["original"].exists():
        export(original, batch, paths["original"])
    for name in names:
        paths[name] = tmp / f"{name}.onnx"
        if not paths[name].exists():
            model, _ = build(name, original, model_dir)
            export(model, batch, paths[name])
            del model
    one = {k: v[:1, :int(batch["attention_mask"][0].sum())] for k, v in batch.items()}
    out: dict[str, Any] = {"ops": {name: ort_norm_ops(p) for name, p in paths.items()}, "ratios": {}}
    for name, ops in out["ops"].items():
        print(f"ORT optimised graph, {name}: {ops}", flush=True)
    for name in names:
        for label, example in ((f"batch 1, {one['input_ids'].shape[1]} tokens", one),
                               (f"batch {batch['input_ids'].shape[0]}, {batch['input_ids'].shape[1]} tokens", batch)):
            m = deploy.abba_sessions(paths["original"], paths[name], tuple(example.values()), seconds, 5)
            out["ratios"][f"{name}/{label}"] = m
            print(f"ORT speed {name} / original, {label}: {m['ratio']:.3f} ({m['q1']:.3f}–{m['q3']:.3f}, "
                  f"{m['quads']} quads; original {m['original_ms']:.2f} ms)", flush=True)
    return out


def reuse_baseline(result: dict[str, Any], baseline: Path, quantizers: list[str] | tuple[str, ...],
                   per: str = "per_text", inputs: tuple[str, ...] = ("texts", "calib", "max_len")) -> None:
    """Copy an earlier run's ``original`` cells and per-input errors (``result[per]``) into ``result``, so the
    original is not measured again; refused unless the earlier run measured the same inputs (each of ``inputs``
    that ``result`` holds: texts, calibration count, length; images or clips) and the original in every one of
    ``quantizers``."""
    old = json.loads(baseline.read_text())
    same = [k for k in inputs if k in result]
    assert all(old.get(k) == result[k] for k in same), f"baseline of other inputs (it must match in {', '.join(same)})"
    missing = [q for q in quantizers if f"original/{q}" not in old["cells"]]
    assert not missing, f"the baseline has no original measured in {missing}: run without --baseline"
    for key in [k for k in old["cells"] if k.startswith("original/")]:
        result["cells"][key], result[per][key] = old["cells"][key], old[per][key]


QUANTIZER_NAMES = {"dyn-pt": "int8 per-tensor", "dyn-pc": "int8 per-channel", "qdq": "static QDQ int8",
                   "nbits-rtn": "4-bit RTN", "torchao": "torchao int8 dynamic",
                   "torchao-emu": "torchao int8 dynamic (emulated)",
                   "dyn-pt-rr": "int8 per-tensor, reduce_range", "dyn-pc-rr": "int8 per-channel, reduce_range",
                   "dyn-pt-u8": "U8U8 per-tensor", "dyn-pc-u8": "U8U8 per-channel",
                   "dyn-pt-u8rr": "U8U8 per-tensor, reduce_range", "dyn-pc-u8rr": "U8U8 per-channel, reduce_range"}


def table(result: dict[str, Any], names: dict[str, str] | None = None) -> str:
    """One row per variant: its float error, then per quantizer (``names``: key -> column label, default
    this benchmark's) its error and ratio to the original's with the 95% interval."""
    names = names or QUANTIZER_NAMES
    variants = dict.fromkeys(k.split("/")[0] for k in result["cells"])
    hows = [h for h in names if all(f"{v}/{h}" in result["cells"] for v in variants)]
    lines = ["| variant | fp32: 1 − cos | " + " | ".join(f"{names[h]}: 1 − cos | ratio (95% CI)" for h in hows) + " |",
             "|---" * (2 + 2 * len(hows)) + "|"]
    for v in variants:
        row = [v, f"{result['cells'][f'{v}/fp32']['err']:.3e}"]
        for how in hows:
            c = result["cells"][f"{v}/{how}"]
            row.append(f"{c['err']:.3e}")
            row.append(f"**{c['ratio']:.3f}** ({c['ci95'][0]:.3f}–{c['ci95'][1]:.3f})" if "ratio" in c else "1")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
