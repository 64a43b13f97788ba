"""bf16/fp16 fidelity of converted zoo models: ``dtype_error_ratio`` per entry (issue 12 §1, target ≤ 1.1).

The ratio is ‖converted_in_dtype − fp64‖ / ‖original_in_dtype − fp64‖ on the model's primary output
(``normswap.surgery.verify``). Columns per dtype:

* ``one``: one random model (zoo seed 0) on 8 × 32 tokens, the architecture matrix's figure (docs/architectures.md);
* ``mean``: the geometric mean over ``--seeds`` random models on ``--batch`` × 32 tokens, the figure
  tests/surgery/test_bf16_fidelity.py asserts (a single tiny model reads one draw of a few parameters'
  roundings; see that test's docstring);
* ``null`` (``--null``): the reparametrisation alone on the seed-0 model, with every LayerNorm kept
  (writers centered and heads untied as the plan says; exact in float64): what the conversion's change
  of rounding pattern costs with no RMSNorm anywhere, i.e. the noise floor of a single model.

``--sweep NAME`` prints, for one entry, the converted and the null ratio of each random model instead.

    python benchmarks/bench_fidelity.py                     # all exact zoo entries (~1 min on 2 cores)
    python benchmarks/bench_fidelity.py --null --only gpt2,clip-vision
    python benchmarks/bench_fidelity.py --sweep clip-vision --seeds 8 --batch 128
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import normswap  # noqa: E402
from normswap.inputs import cast_inputs, hf_example_inputs  # noqa: E402
from normswap.pipeline import default_dtype  # noqa: E402
from normswap.surgery import edits  # noqa: E402
from normswap.surgery.verify import compare, dtype_error_ratio  # noqa: E402
from tests.zoo import EXACT, build  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16)


def variants(name: str, seed: int, null: bool) -> tuple[torch.nn.Module, dict[str, torch.nn.Module], set[str]]:
    """The float64 original, ``{"converted": ..., "null": ...}`` and the outputs a conversion changes."""
    model = build(EXACT, name, seed=seed)
    converted = copy.deepcopy(model)
    report = normswap.patch(converted)
    out = {"converted": converted}
    if null:
        kept = copy.deepcopy(model)
        for u in report.plan.unties:
            edits.untie(kept, u)
        for e in report.plan.writer_edits:
            edits.center_writer(kept, e)
        out["null"] = kept
    return model, out, set(report.plan.changed_outputs)


def ratios(name: str, seed: int, batch: int, null: bool = False) -> dict[tuple[str, torch.dtype], float | None]:
    """``{(variant, dtype): ratio}`` for one random model (None where a model is not finite in dtype)."""
    model, models, skip = variants(name, seed, null)
    probe = hf_example_inputs(model, batch=batch, seq=32, seed=11)
    with torch.no_grad(), default_dtype(torch.float64):
        reference = model(**probe)
    out = {}
    for dtype in DTYPES:
        args, kwargs = cast_inputs((), probe, dtype)
        with torch.no_grad():
            base = compare(reference, copy.deepcopy(model).to(dtype)(*args, **kwargs))
            for key, m in models.items():
                got = compare(reference, copy.deepcopy(m).to(dtype)(*args, **kwargs), skip)
                finite = all(math.isfinite(f.get("rel_rms_error", math.nan)) for f in (base, got))
                out[(key, dtype)] = dtype_error_ratio(base, got) if finite else None
    return out


def geomean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="comma-separated zoo entries (default: every exact one)")
    ap.add_argument("--seeds", type=int, default=6, help="random models per entry for the mean (default 6)")
    ap.add_argument("--batch", type=int, default=32, help="sequences per probe for the mean (default 32)")
    ap.add_argument("--null", action="store_true", help="add the reparametrisation-only ratio")
    ap.add_argument("--sweep", default=None, help="one entry: each random model's ratios")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    if args.sweep:
        print(f"{args.sweep}: per random model, {args.batch} x 32 tokens")
        print("| seed | " + " | ".join(f"{str(d)[6:]} converted | {str(d)[6:]} null" for d in DTYPES) + " |")
        print("|---|" + "---|---|" * len(DTYPES))
        rows = []
        for seed in range(args.seeds):
            r = ratios(args.sweep, seed, args.batch, null=True)
            rows.append(r)
            print(f"| {seed} | " + " | ".join(f"{fmt(r[('converted', d)])} | {fmt(r[('null', d)])}" for d in DTYPES)
                  + " |", flush=True)
        print("| geo-mean | " + " | ".join(
            f"{fmt(geomean([r[('converted', d)] for r in rows]))} | {fmt(geomean([r[('null', d)] for r in rows]))}"
            for d in DTYPES) + " |")
        return
    names = args.only.split(",") if args.only else sorted(EXACT)
    cols = [f"{str(d)[6:]} {c}" for d in DTYPES for c in (("one", "mean", "null") if args.null else ("one", "mean"))]
    print(f"torch {torch.__version__}; one = seed 0 on 8 x 32 tokens; mean = geometric mean over {args.seeds} "
          f"random models on {args.batch} x 32 tokens")
    print("| zoo entry | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    worst: dict[str, float] = {}
    for name in names:
        one = ratios(name, 0, 8, null=args.null)
        many = [ratios(name, s, args.batch) for s in range(args.seeds)]
        cells = []
        for d in DTYPES:
            vals = {"one": one[("converted", d)], "mean": geomean([m[("converted", d)] for m in many])}
            if args.null:
                vals["null"] = one[("null", d)]
            for k, v in vals.items():
                key = f"{str(d)[6:]} {k}"
                if v is not None:
                    worst[key] = max(worst.get(key, 0.0), v)
                cells.append(fmt(v))
        print(f"| `{name}` | " + " | ".join(cells) + " |", flush=True)
    print("| **max** | " + " | ".join(f"**{fmt(worst.get(c))}**" for c in cols) + " |")


if __name__ == "__main__":
    main()
