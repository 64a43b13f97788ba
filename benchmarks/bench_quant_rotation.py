"""Rotated variants against the original through ONNX Runtime's quantizers and RTN at 4-bit activations.

The DINOv2-shaped model of ``bench_quant_engines.py`` (hidden 384, LayerScale λ over three decades, LayerNorm
γ/β randomised, massive channels; random weights), each variant exported to ONNX and quantized by ONNX
Runtime's own tools (``dyn-pt``, ``dyn-pc``, ``qdq``, ``nbits-rtn``, ``nbits-hqq``: see that file), plus
round-to-nearest fake quantization in torch at 4-bit activations (``w8a4``, ``w4a4``; weights per output
channel, activations per token, every Linear: ``quant_utils``), which no ONNX Runtime CPU quantizer offers.

Variants (every rotated one is ``patch(fold_gamma=True)`` then ``normswap.rotate(..., output="restore")``: the
backbone's output is the final norm's, so its input is turned back by one ``Qᵀ`` matmul):

* ``original``; ``converted``: ``patch(fold_gamma=True)`` alone (what the rotation starts from);
* ``hadamard``: every MatMul quantized, the rotation's own ``Qᵀ`` included (what a plain quantizer call does);
* ``hadamard+float-ops``: the rotation's ops left in float (``nodes_to_exclude`` =
  :func:`normswap.rotation.onnx_nodes.float_nodes`); every variant below does the same;
* ``hadamard+smooth``, ``hadamard+smooth0.25``: and ``rotate(smooth=α)`` (α = 0.5, 0.25), calibrated on the
  held-out calibration images (the ones static QDQ calibrates on);
* ``hadamard+online``, ``hadamard+online+smooth``: with QuaRot's online Hadamards (before every MLP down
  projection; per-head value/output Hadamards).
* ``learned-w4g32[f][+smooth]``, ``learned-w4a4[+online]``, ``learned-w8a8``: ``rotate(m, "learned", ...)``,
  the Hadamard times an orthogonal R learned on the calibration images (``--learn-steps`` Adam steps) for
  4-bit weights in blocks of 32 (``MatMulNBits``' setting, weight-only; ``f``: on its own grid,
  ``grid="full"``), RTN W4A4, RTN W8A8 (per-token activations).

Error: ``1 − cosine`` against the float32 original in torch, over every output token (``tok``) and the CLS
embedding (``cls``), on ``--images`` held-out generated images.

    python benchmarks/bench_quant_rotation.py --layers 6 --images 256 --json rot.json
    python benchmarks/bench_quant_rotation.py --from-json rot.json
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_engines as engines  # noqa: E402  (the benchmark's sibling: model, export, ONNX quantizers)
import quant_utils  # noqa: E402

ORT = ("dyn-pt", "dyn-pc", "qdq", "nbits-rtn", "nbits-hqq")
RTN = {"w8a4": (8, 4), "w4a4": (4, 4)}
VARIANTS = ("original", "converted", "hadamard", "hadamard+float-ops", "hadamard+smooth", "hadamard+smooth0.25",
            "hadamard+online", "hadamard+online+smooth", "learned-w4g32", "learned-w4g32f", "learned-w4g32+smooth",
            "learned-w4g32f+smooth",
            "learned-w4a4", "learned-w4a4+online", "learned-w8a8", "learned-w4g32f+online",
            "learned-w4g32f+scales", "learned-w4g32f+online+scales")
LEARN_STEPS = 100  # --learn-steps
LEARN_LR = 1e-3  # --learn-lr


def learn_target(name: str) -> dict[str, Any]:
    """``learned-w4g32`` → bits 4, groups of 32 (MatMulNBits' blocks); ``learned-w4g32f`` → the same on
    MatMulNBits' own grid (``grid="full"``); ``learned-w4a4`` → W4A4 per token."""
    target = name.removeprefix("learned-").split("+")[0]
    grid = "full" if target.endswith("f") else "symmetric"
    w, _, rest = target.removesuffix("f")[1:].partition("g" if "g" in target else "a")
    kind = "group_size" if "g" in target else "act_bits"
    return {"bits": int(w), kind: int(rest), "steps": LEARN_STEPS, "grid": grid, "lr": LEARN_LR,
            **({"scales": True} if "+scales" in name else {})}


def build(model: torch.nn.Module, name: str, calib: torch.Tensor) -> tuple[torch.nn.Module, str, bool]:
    """``(variant, note, keep the rotation's ops in float)``."""
    import normswap

    if name == "original":
        return model, "", False
    m = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(m, fold_gamma=True)
        if name == "converted":
            return m, "patch(fold_gamma=True), native", False
        alpha = None
        if "+smooth" in name:
            alpha = float(name.split("+smooth")[1] or 0.5)
        batches = [{"pixel_values": calib[i:i + 8]} for i in range(0, len(calib), 8)]
        learned = learn_target(name) if name.startswith("learned-") else {}
        r = normswap.rotate(m, "learned" if learned else "hadamard", seed=0, output="restore",
                            online="+online" in name, smooth=alpha,
                            calibration=batches if alpha is not None or learned else None, **learned)
    return m, r.headline(), name != "hadamard"


def quantize(fp32: Path, how: str, calib: torch.Tensor, exclude: list[str]) -> Path:
    """``bench_quant_engines.quantize`` with ``nodes_to_exclude``."""
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization import matmul_nbits_quantizer as mq

    out = fp32.with_name(f"{fp32.stem}.{how}.onnx")
    if how in ("dyn-pt", "dyn-pc"):
        quantize_dynamic(str(fp32), str(out), weight_type=QuantType.QInt8, per_channel=how == "dyn-pc",
                         nodes_to_exclude=exclude)
    elif how == "qdq":
        quantize_static(str(fp32), str(out), quant_utils.BatchReader(
            [{"pixel_values": calib[i:i + 8].numpy()} for i in range(0, len(calib), 8)]), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=False,
                        nodes_to_exclude=exclude)
    else:
        algo = (mq.HQQWeightOnlyQuantConfig(block_size=32, bits=4) if how == "nbits-hqq"
                else mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True))
        q = mq.MatMulNBitsQuantizer(onnx.load(str(fp32)), block_size=32, is_symmetric=True, algo_config=algo,
                                    nodes_to_exclude=exclude)
        q.process()
        q.model.save_model_to_file(str(out), use_external_data_format=False)
    return out


def errors(ref_pool: torch.Tensor, ref_tok: torch.Tensor, pool: torch.Tensor,
           tok: torch.Tensor) -> tuple[dict[str, float], dict[str, list[float]]]:
    """``({"cls", "tok"}: 1 − cosine over all images, {"cls", "tok"}: the same per image)``: the per-image
    figures (``tok``: the image's tokens' mean) are what the paired bootstrap resamples."""
    per = {"cls": 1 - torch.nn.functional.cosine_similarity(ref_pool.double(), pool.double(), dim=-1),
           "tok": (1 - torch.nn.functional.cosine_similarity(ref_tok.double(), tok.double(), dim=-1)).mean(-1)}
    return {k: float(v.mean()) for k, v in per.items()}, {k: v.tolist() for k, v in per.items()}


def bootstrap(err: list[float], base: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of ``mean(err) / mean(base)`` over images resampled with replacement, the same images for
    both (paired): the noise of the image sample, not of the quantizer."""
    e, b = torch.tensor(err, dtype=torch.float64), torch.tensor(base, dtype=torch.float64)
    idx = torch.randint(0, len(e), (draws, len(e)), generator=torch.Generator().manual_seed(seed))
    ratios = e[idx].mean(1) / b[idx].mean(1)
    return float(ratios.quantile(0.025)), float(ratios.quantile(0.975))


@torch.no_grad()
def rtn(model: torch.nn.Module, px: torch.Tensor, w_bits: int, a_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The variant with every Linear fake-quantized (a copy), run on ``px``."""
    q = copy.deepcopy(model)
    quant_utils.fake_quantize_(q, w_bits, a_bits)
    outs = [engines.Outputs(q)(px[i:i + 32]) for i in range(0, len(px), 32)]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--learn-steps", type=int, default=LEARN_STEPS, help="steps of the learned rotations")
    ap.add_argument("--learn-lr", type=float, default=LEARN_LR, help="Adam's step of the learned rotations")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--from-json", type=Path, nargs="+", help="print the tables of earlier --json runs, rows merged")
    args = ap.parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json[0].read_text())
        for part in args.from_json[1:]:
            result["rows"].update(json.loads(part.read_text())["rows"])
        print(table(result, "tok") + "\n\n" + table(result, "cls"))
        return result
    torch.set_num_threads(1)
    globals()["LEARN_STEPS"] = args.learn_steps
    globals()["LEARN_LR"] = args.learn_lr
    model = engines.dino(args.layers, args.seed, args.image)
    px = engines.images(args.images, args.image, 1)
    calib = engines.images(args.calib, args.image, 2)
    with torch.no_grad():
        ref_pool, ref_tok = engines.Outputs(model)(px)
    result: dict[str, Any] = {"model": f"DINOv2-like, {args.layers} layers, {args.image} px, seed {args.seed}",
                              "images": args.images, "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            t0 = time.perf_counter()
            m, note, float_ops = build(model, name, calib)
            row: dict[str, Any] = {"note": note, "errors": {}, "per_image": {}}
            for how, (wb, ab) in RTN.items():
                pool, tok = rtn(m, px, wb, ab)
                row["errors"][how], row["per_image"][how] = errors(ref_pool, ref_tok, pool, tok)
            fp32 = Path(tmp) / f"{name.replace('+', '_')}.onnx"
            engines.export(m, px, fp32)
            from normswap.rotation.onnx_nodes import float_nodes

            exclude = float_nodes(fp32, m) if float_ops else []
            row["float_nodes"] = exclude
            del m
            for how in ORT:
                q = quantize(fp32, how, calib, exclude)
                pool, tok = engines.run_onnx(q, px)
                row["errors"][how], row["per_image"][how] = errors(ref_pool, ref_tok, pool, tok)
                q.unlink()
            row["seconds"] = time.perf_counter() - t0
            row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            result["rows"][name] = row
            if args.json:  # after every row: a long run stopped early keeps what it measured
                args.json.write_text(json.dumps(result, indent=1))
            print(f"{name}: {note}; float ops {exclude}; " + ", ".join(
                f"{h} {e['tok']:.3e}" for h, e in row["errors"].items()), flush=True)
    print(table(result, "tok") + "\n\n" + table(result, "cls"))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


def table(result: dict[str, Any], metric: str) -> str:
    """Each quantizer's error (``tok``: every token; ``cls``: CLS embedding) and its ratio to the original's."""
    rows = result["rows"]
    base = rows.get("original")
    hows = list(next(iter(rows.values()))["errors"])
    lines = [f"1 − cosine ({metric}) against the float32 original; {result['model']}, {result['images']} images", "",
             "| variant | " + " | ".join(hows) + " |", "|---|" + "---|" * len(hows)]
    for name, row in rows.items():
        cells = []
        for how in hows:
            e = row["errors"][how][metric]
            ratio = ""
            if base and name != "original":
                ratio = f" ({e / base['errors'][how][metric]:.2f}x"
                if how in row.get("per_image", {}) and how in base.get("per_image", {}):
                    lo, hi = bootstrap(row["per_image"][how][metric], base["per_image"][how][metric])
                    ratio += f", {lo:.2f}-{hi:.2f}"
                ratio += ")"
            cells.append(f"{e:.2e}{ratio}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
