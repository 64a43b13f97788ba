"""A decoder LM through the quantization checks of issue 40: ``normswap convert`` outputs against their original.

Issue 40 is "checked by the same measurements on held-out real checkpoints and engines". Every checkpoint
measured before round 52 is an encoder (or Whisper's decoder); this runs a causal LM directory (a stock
``*ForCausalLM``; ``pydoc_gpt2.py`` builds a trained-like GPT-2 where no real one can be had) and the
directories ``normswap convert`` wrote for it through the engines people quantize decoders with on CPU:

* ONNX Runtime (``torch.onnx.export(dynamo=True)``, default opset, the logits as output; quantized by ONNX
  Runtime's own tools, ``bench_quant_engines.quantize``): ``dyn-pt`` / ``dyn-pc`` (``quantize_dynamic``, int8
  weights per tensor / per channel, dynamic uint8 activations), ``nbits-rtn`` / ``nbits-hqq``
  (``MatMulNBitsQuantizer``, 4-bit blocks of 32: RTN symmetric, HQQ). A rotation's online ops stay float
  (``normswap.rotation.onnx_nodes.float_nodes`` passed as ``nodes_to_exclude``), as docs/rotation.md says;
* ``torchao``: torchao's ``Int8DynamicActivationInt8WeightConfig`` (``quant_utils.torchao_int8``: int8 weights
  per output channel, int8 activations per token), run in torch eager;
* ``ct2-int8``: CTranslate2 (``TransformersConverter(...).convert(quantization="int8")``, ``Generator`` with
  ``compute_type="int8"``, ``forward_batch`` logits). Only for directories CTranslate2 can read: stock
  architectures (the original, ``--format compat`` outputs); a native normswap checkpoint is skipped, with
  the reason.

Error against the float32 original in torch, teacher-forced on ``--windows`` windows of ``--length`` tokens of
Python's reference documentation (``pydoc_data``, held out from ``pydoc_gpt2.py``'s training text): per window
the mean over positions of KL(original ‖ quantized) of the next-token distributions, and top-1 agreement.
GPT-2's projections are HF ``Conv1D`` modules, which export as ``Gemm``; ONNX Runtime's dynamic and 4-bit
quantizers only take ``MatMul`` (and ``Gather``), so by default each is swapped for the equivalent ``nn.Linear``
before export (``--as-exported`` keeps them: then only the embeddings and an untied LM head are rounded).
Ratios to the original in the same engine, with a 95% paired bootstrap over windows
(``bench_quant_engines.ci_table``). Each variant is first run in float32 (``fp32``) to check it matches the
original (the conversion is exact: the error there is float32 rounding).

    PYTHONPATH=$PWD:CT2:TORCHAO python benchmarks/heldout_lm.py ORIG native=N compat=C hadamard=H online=O \\
        --windows 256 --length 64 --engines dyn-pt dyn-pc nbits-rtn nbits-hqq torchao ct2-int8 --json out.json

``CT2``/``TORCHAO``: ``pip install --no-deps --target DIR ctranslate2`` / ``torchao`` (neither is a normswap
dependency).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_engines as engines  # noqa: E402  (the benchmark's own helpers, next to this file)
import pydoc_gpt2  # noqa: E402
import quant_utils  # noqa: E402

ORT = ("fp32", "dyn-pt", "dyn-pc", "nbits-rtn", "nbits-hqq")
ENGINES = (*ORT, "torchao", "ct2-int8")


def is_native(path: Path) -> bool:
    """A normswap native checkpoint (its own model type), not a stock architecture."""
    config = json.loads((path / "config.json").read_text())
    return str(config.get("model_type", "")).startswith("normswap")


def load(path: Path) -> torch.nn.Module:
    """The causal LM at ``path`` in float32, eval mode: ``normswap.load`` for a native checkpoint (its RMSNorms,
    online ops and all), plain ``AutoModelForCausalLM`` for a stock one."""
    from transformers import AutoModelForCausalLM

    import normswap

    if is_native(path):
        return normswap.load(str(path)).float().eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


class Logits(torch.nn.Module):
    """``input_ids`` → next-token logits, no cache (what an exporter sees)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


@torch.inference_mode()
def torch_logits(model: torch.nn.Module, ids: torch.Tensor, batch: int = 16) -> torch.Tensor:
    wrapped = Logits(model).eval()
    return torch.cat([wrapped(ids[i:i + batch], torch.ones_like(ids[i:i + batch])).float()
                      for i in range(0, len(ids), batch)])


def export(model: torch.nn.Module, ids: torch.Tensor, path: Path, linear: bool = True) -> None:
    """``torch.onnx.export(dynamo=True)`` at the exporter's default opset (docs/deployment.md's path for GPT-2:
    the legacy exporter fails on transformers' mask code), dynamic batch, the window length fixed.

    ``linear``: every HF ``Conv1D`` (GPT-2's projections) replaced by the equivalent ``nn.Linear`` first
    (``quant_utils.conv1d_to_linear_``, exact, hooks carried): ``Conv1D`` exports as ``Gemm``, which neither
    ``quantize_dynamic`` (``MatMul``/``Gather`` only) nor ``MatMulNBitsQuantizer`` (``MatMul``) quantizes, so
    as exported only the embeddings and an untied LM head would be rounded."""
    import copy
    import logging

    if linear:
        model = copy.deepcopy(model)
        quant_utils.conv1d_to_linear_(model)
    batch = torch.export.Dim("batch", min=1, max=64)
    example = (ids[:2], torch.ones_like(ids[:2]))
    logging.disable(logging.WARNING)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(Logits(model).eval(), example, str(path), input_names=["input_ids", "attention_mask"],
                              output_names=["logits"], dynamo=True,
                              dynamic_shapes={"input_ids": {0: batch}, "attention_mask": {0: batch}})
    finally:
        logging.disable(logging.NOTSET)


def onnx_logits(path: Path, ids: torch.Tensor, batch: int = 16) -> torch.Tensor:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feeds = [{"input_ids": ids[i:i + batch].numpy(), "attention_mask": torch.ones_like(ids[i:i + batch]).numpy()}
             for i in range(0, len(ids), batch)]
    return torch.cat([torch.from_numpy(sess.run(None, f)[0]) for f in feeds])


def ct2_logits(path: Path, ids: torch.Tensor, work: Path, batch: int = 16) -> torch.Tensor:
    """``path`` converted by CTranslate2's own converter to int8 and run by its ``Generator`` (int8 GEMMs,
    dynamically quantized activations), teacher-forced: ``forward_batch`` gives every position's logits."""
    import ctranslate2
    import numpy as np
    from ctranslate2.converters import TransformersConverter
    from transformers import AutoTokenizer

    out = work / "ct2-int8"
    if out.exists():
        shutil.rmtree(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        TransformersConverter(str(path)).convert(str(out), quantization="int8", force=True)
    tok = AutoTokenizer.from_pretrained(str(path))
    gen = ctranslate2.Generator(str(out), device="cpu", compute_type="int8", intra_threads=1)
    logits = []
    for i in range(0, len(ids), batch):
        toks = [tok.convert_ids_to_tokens(row.tolist()) for row in ids[i:i + batch]]
        logits.append(torch.from_numpy(np.array(gen.forward_batch(toks))).float())
    shutil.rmtree(out)
    return torch.cat(logits)


def per_window(ref: torch.Tensor, out: torch.Tensor) -> dict[str, list[float]]:
    """Per window: the mean over positions of KL(ref ‖ out) of the next-token distributions, and the fraction
    of positions whose top-1 token agrees."""
    lp = torch.log_softmax(ref.double(), -1)
    lq = torch.log_softmax(out.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean(-1)
    top1 = (ref.argmax(-1) == out.argmax(-1)).double().mean(-1)
    return {"kl": kl.tolist(), "top1": top1.tolist()}


def measure(name: str, path: Path, ids: torch.Tensor, ref: torch.Tensor, wanted: list[str], work: Path,
            calib: torch.Tensor, linear: bool = True) -> dict[str, Any]:
    """Every engine in ``wanted`` on the model at ``path``: per-window errors against ``ref``."""
    from normswap.rotation.onnx_nodes import float_nodes

    row: dict[str, Any] = {"path": str(path), "per_image": {}, "mean": {}, "notes": []}
    model = load(path)
    own = torch_logits(model, ids)
    row["fp32_torch_max_rel"] = float((own - ref).abs().max() / ref.abs().max())
    t0 = time.perf_counter()
    vdir = work / name
    vdir.mkdir(parents=True, exist_ok=True)
    fp32 = vdir / "model.onnx"
    if any(h in ORT for h in wanted):
        export(model, ids, fp32, linear=linear)
        keep = float_nodes(fp32, model)
        row["float_nodes"] = len(keep)
    for how in wanted:
        t1 = time.perf_counter()
        try:
            if how in ORT:
                out = onnx_logits(engines.quantize(fp32, how, calib, keep=keep), ids)
            elif how == "torchao":
                out = torch_logits(quant_utils.torchao_int8(model), ids)
            elif how == "ct2-int8":
                if is_native(path):
                    row["notes"].append("ct2-int8: skipped, a native normswap checkpoint (CTranslate2 reads stock "
                                        "architectures only; use --format compat)")
                    continue
                out = ct2_logits(path, ids, vdir)
            else:
                raise ValueError(how)
        except Exception as exc:  # noqa: BLE001  (one engine's failure must not lose the others' figures)
            row["notes"].append(f"{how}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            print(f"#   {name} {how}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        errs = per_window(ref, out)
        row["per_image"][how] = errs
        row["mean"][how] = {k: sum(v) / len(v) for k, v in errs.items()}
        print(f"#   {name} {how}: KL {row['mean'][how]['kl']:.3e}, top-1 {row['mean'][how]['top1']:.4f} "
              f"({time.perf_counter() - t1:.0f} s)", flush=True)
        gc.collect()
    for p in vdir.glob("*.onnx*"):
        p.unlink()
    row["seconds"] = time.perf_counter() - t0
    return row


def original_row(path: Path, args: dict[str, str], wait_s: float = 1800) -> dict[str, Any]:
    """The original's row from an earlier (or concurrent) run's ``--json`` at ``path``, waiting up to ``wait_s``
    for it to appear; that run must have used the same windows and export."""
    same = ("windows", "length", "seed", "as_exported", "engines")
    deadline = time.time() + wait_s
    while True:
        earlier = json.loads(path.read_text()) if path.exists() else {}
        if "original" in earlier.get("rows", {}):
            break
        if time.time() > deadline:
            raise SystemExit(f"--original-from {path}: no original row after {wait_s:.0f} s")
        time.sleep(15)
    if any(earlier["args"].get(k) != args[k] for k in same):
        raise SystemExit(f"--original-from {path}: another run ({', '.join(same)} differ)")
    return earlier["rows"]["original"]


def table(rows: dict[str, Any]) -> str:
    hows = [h for h in rows["original"]["mean"]]
    lines = ["| variant | " + " | ".join(hows) + " |", "|---|" + "---|" * len(hows)]
    for name, row in rows.items():
        cells = [f"{row['mean'][h]['kl']:.2e} ({row['mean'][h]['top1']:.4f})" if h in row["mean"] else "–"
                 for h in hows]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("original", type=Path)
    ap.add_argument("variants", nargs="*", help="NAME=DIR: normswap convert outputs of the original")
    ap.add_argument("--windows", type=int, default=256)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--seed", type=int, default=7, help="which pydoc windows")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "normswap-heldout-lm")
    ap.add_argument("--original-from", type=Path, default=None,
                    help="take the original's row from this earlier --json run (same windows, engines and export) "
                    "instead of measuring it again: the engines are deterministic, so two processes can split "
                    "the variants")
    ap.add_argument("--as-exported", action="store_true",
                    help="export HF Conv1D layers as they are (Gemm: ONNX Runtime's quantizers skip them)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(args.original))
    ids = pydoc_gpt2.windows(tok, args.windows, args.length, seed=args.seed)
    calib = pydoc_gpt2.windows(tok, 32, args.length, seed=args.seed + 1000)  # only the static quantizer reads it
    original = load(args.original)
    ref = torch_logits(original, ids)
    del original
    print(f"# {args.windows} pydoc windows of {args.length} tokens; load average {os.getloadavg()[0]:.1f}",
          flush=True)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": {}}
    named = [("original", args.original)] + [(v.split("=", 1)[0], Path(v.split("=", 1)[1])) for v in args.variants]
    if args.original_from:
        named = named[1:]
    for name, path in named:
        result["rows"][name] = measure(name, path, ids, ref, args.engines, args.workdir, calib,
                                       linear=not args.as_exported)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    if args.original_from:
        result["rows"] = {"original": original_row(args.original_from, result["args"]), **result["rows"]}
        result["original_from"] = str(args.original_from)
    print("\nmean KL(original ‖ quantized) per window (top-1 agreement)\n")
    print(table(result["rows"]))
    runs = [{"rows": result["rows"]}]
    hows = [h for h in result["rows"]["original"]["per_image"] if h != "fp32"]
    result["ratios"] = {name: {h: engines.ratio_ci(runs, name, h, "kl") for h in hows if h in row["per_image"]}
                        for name, row in result["rows"].items() if name != "original"}
    print("\nKL ratio to the original in the same engine (95% paired bootstrap over windows)\n")
    print("| variant | " + " | ".join(hows) + " |\n|---|" + "---|" * len(hows))
    for name, ratios in result["ratios"].items():
        cells = ["{:.3f} ({:.3f}-{:.3f})".format(*ratios[h]) if h in ratios else "–" for h in hows]
        print(f"| {name} | " + " | ".join(cells) + " |")
    result["seconds"] = time.perf_counter() - t0
    result["load_after"] = os.getloadavg()[0]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
