"""A native checkpoint with online Hadamards, loaded through transformers' ``quantization_config`` (round 50).

``from_pretrained(dir, quantization_config=...)`` lets the engine replace each ``nn.Linear`` with its own module
before the weights load (bitsandbytes' ``Linear4bit``), or while they load. The online Hadamard before a Linear
(``convert --rotate none --online-hadamard``) is a pre-hook and buffers on the Linear, whose weight holds the
op's transpose: a swap that drops them leaves a model that runs and computes wrong outputs. This benchmark loads
the original and the converted checkpoint with the same ``quantization_config`` and measures each against the
float32 original: ``1 − cos`` per image (every token and the CLS embedding, ``bench_quanto``'s crops and
metrics, ``bench_heldout_engines``' row format), ratio to the original in the same engine with 95% paired
bootstrap intervals (``bench_quant_engines.ci_table``).

Engines (``--engines``; each needs its package on ``PYTHONPATH``):

* ``bnb-nf4``: ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
  bnb_4bit_compute_dtype=torch.float32)`` (bitsandbytes' CPU backend);
* ``bnb-int8``: ``BitsAndBytesConfig(load_in_8bit=True)`` (LLM.int8);
* ``hqq-w4``: ``HqqConfig(nbits=4, group_size=64)``;
* ``quanto-int8``: ``QuantoConfig(weights="int8")``;
* ``torchao-int8wo``: ``TorchAoConfig(Int8WeightOnlyConfig())``.

An engine whose load raises is recorded with the error's first line (``"failed"``), not retried. Each converted
row records how many of the manifest's op-holding modules hold their op after the load (``ops_present`` of
``ops_expected``) and the class now at an op's path: the figure that says whether the load kept the model
whole. Run it once with the normswap to measure (``--label after``) and once with an earlier one on
``PYTHONPATH`` (``--label before``); ``--before FILE`` adds that run's converted rows, as ``NAME (before)``,
to this run's table (same crops, same original, same engine: paired).

    PYTHONPATH=BNB:$PWD python benchmarks/bench_load_quantized.py --dinov2 ORIG online=CONVERTED \\
        --photos SKIMAGE/data --images 32 --engines bnb-nf4 --json after.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

ENGINES = ("bnb-nf4", "bnb-int8", "hqq-w4", "quanto-int8", "torchao-int8wo")


def quantization_config(how: str) -> Any:
    """The ``quantization_config`` of engine ``how`` (see the module docstring)."""
    import transformers as tf

    if how == "bnb-nf4":
        return tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    if how == "bnb-int8":
        return tf.BitsAndBytesConfig(load_in_8bit=True)
    if how == "hqq-w4":
        return tf.HqqConfig(nbits=4, group_size=64)
    if how == "quanto-int8":
        return tf.QuantoConfig(weights="int8")
    if how == "torchao-int8wo":
        from torchao.quantization import Int8WeightOnlyConfig

        return tf.TorchAoConfig(Int8WeightOnlyConfig())
    raise ValueError(how)


def load_quantized(path: Path, how: str) -> torch.nn.Module:
    """``path`` (original or native normswap checkpoint) loaded with engine ``how``'s ``quantization_config``."""
    import transformers as tf

    import normswap

    config = json.loads((path / "config.json").read_text())
    kwargs = {"quantization_config": quantization_config(how), "dtype": torch.float32}
    model = normswap.load(str(path), **kwargs) if "normswap" in config else tf.AutoModel.from_pretrained(path, **kwargs)
    return model.eval()


def op_paths(model: torch.nn.Module) -> list[str]:
    """The modules the manifest says hold an online Hadamard (before a Linear, or after a norm)."""
    import normswap

    plan = normswap.plan_of(model)
    paths: set[str] = set()
    for r in getattr(plan, "rotations", None) or []:
        paths.update(r.get("online", []))
        paths.update(o["norm"] for o in r.get("online_outputs", []))
    return sorted(paths)


def op_present(module: torch.nn.Module) -> bool:
    """The op's hook is registered on the module (read without normswap.rotation.carry: an earlier normswap has
    none)."""
    handle = module.__dict__.get("_normswap_online")
    return handle is not None and (handle.id in module._forward_pre_hooks or handle.id in module._forward_hooks)


def versions() -> dict[str, str]:
    import normswap

    out = {"torch": torch.__version__, "normswap": str(Path(normswap.__file__).parent)}
    for mod in ("transformers", "bitsandbytes", "hqq", "optimum.quanto", "torchao"):
        try:
            m = __import__(mod, fromlist=["_"])
            out[mod] = getattr(m, "__version__", "?")
        except Exception:  # noqa: BLE001 - absent or broken: recorded
            out[mod] = "absent"
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dinov2", type=Path, required=True, help="the original Dinov2Model directory")
    ap.add_argument("variants", nargs="+", help="NAME=DIR: native normswap checkpoints")
    ap.add_argument("--engines", nargs="+", default=["bnb-nf4"], choices=ENGINES)
    ap.add_argument("--photos", type=Path, required=True, help="scikit-image's skimage/data")
    ap.add_argument("--calib-photos", default="motorcycle_right.png,gravel.png,brick.png",
                    help="photographs left out of the crops (bench_quanto's calibration ones)")
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--label", default="", help="recorded in the JSON: which normswap ran")
    ap.add_argument("--before", type=Path, help="a run of this script with another normswap: its converted rows "
                    "join this run's table as 'NAME (before)'")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tables-of", type=Path, help="print the tables of a saved run (its --json) and exit; with "
                    "--before, that run's converted rows too")
    args = ap.parse_args(argv)
    if args.tables_of:
        result = json.loads(args.tables_of.read_text())
        tables(result, args.before)
        return result
    from bench_quant_engines import per_image
    from bench_quanto import run
    from heldout_exactness import load
    from photo_crops import photo_crops

    torch.set_num_threads(1)
    px = photo_crops(args.photos, args.images, args.image, seed=args.seed, exclude=args.calib_photos.split(","))
    ref_pool, ref_tok = run(load(args.dinov2), px)
    dirs = {"original": args.dinov2} | {k: Path(v) for k, v in (v.split("=", 1) for v in args.variants)}
    rows: dict[str, Any] = {}
    for name, path in dirs.items():
        row: dict[str, Any] = {"note": str(path), "errors": {}, "per_image": {}, "loads": {}}
        for how in args.engines:
            t0 = time.perf_counter()
            try:
                model = load_quantized(path, how)
            except Exception as exc:  # noqa: BLE001 - an engine transformers cannot load with: recorded
                row["loads"][how] = {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                print(f"{name:12s} {how:16s} load failed: {row['loads'][how]['failed']}", flush=True)
                continue
            paths = op_paths(model) if name != "original" else []
            present = [p for p in paths if op_present(model.get_submodule(p))]
            load_info = {"ops_expected": len(paths), "ops_present": len(present),
                         "classes": sorted({type(model.get_submodule(p)).__name__ for p in paths})}
            try:
                pool, tok = run(model, px)
            except Exception as exc:  # noqa: BLE001 - normswap's refusal of a model that lost an op: recorded
                row["loads"][how] = load_info | {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                print(f"{name:12s} {how:16s} run refused: {row['loads'][how]['failed']}", flush=True)
                continue
            cls_err, tok_err = per_image(ref_pool, pool), per_image(ref_tok, tok)
            row["errors"][how] = {"cls": float(cls_err.mean()), "tok": float(tok_err.mean())}
            row["per_image"][how] = {"cls": cls_err.tolist(), "tok": tok_err.tolist()}
            row["loads"][how] = load_info | {"seconds": time.perf_counter() - t0}
            print(f"{name:12s} {how:16s} cls {cls_err.mean():.3e} tok {tok_err.mean():.3e} "
                  f"ops {len(present)}/{len(paths)} {load_info['classes']}", flush=True)
        rows[name] = row
    result = {"model": f"{args.dinov2}, {args.image} px", "inputs": len(px), "label": args.label, "rows": rows,
              "versions": versions()}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    tables(result, args.before)
    return result


def tables(result: dict[str, Any], before: Path | None = None) -> None:
    """Ratios to the original with 95% paired intervals (every token, CLS; mean and typical image), for the rows
    that ran; ``before``: a run with another normswap, whose converted rows join as ``NAME (before)``."""
    from bench_quant_engines import ci_table

    rows = dict(result["rows"])
    if before is not None:
        rows.update({f"{k} (before)": v for k, v in json.loads(before.read_text())["rows"].items() if k != "original"})
    measured = {k: v for k, v in rows.items() if v["per_image"]}
    if "original" not in measured or len(measured) < 2:
        return
    common = set.intersection(*(set(v["per_image"]) for v in measured.values()))  # engines every row ran
    original = {**measured["original"], "per_image": {h: e for h, e in measured["original"]["per_image"].items()
                                                      if h in common}}
    table = {**result, "rows": measured | {"original": original}}
    for metric in ("tok", "cls"):
        print("\n" + ci_table([table], metric) + "\n\n" + ci_table([table], metric, typical=True))


if __name__ == "__main__":
    main()
