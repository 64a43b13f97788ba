"""Compare variants of ``executorch_dinov2.py`` runs written to different JSON files, crop by crop.

Each file holds per-crop ``1 − cos`` errors keyed ``variant/scheme``; files of the same command line (same crops,
``--images``, ``--image``, photographs) are paired crop by crop. The files' ``original/<scheme>`` errors must agree
(checked: the runs are deterministic, so a mismatch means different crops). Prints, per scheme, each variant over
the original and over ``--base`` (default ``native``), with 95% intervals resampling photographs
(``quant_utils.cluster_bootstrap``).

    python benchmarks/executorch_compare.py docs/results/executorch55_dinov2_256.json \\
        docs/results/executorch55_dinov2_256_static_nf.json docs/results/executorch56_dinov2_form.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    from quant_utils import cluster_bootstrap

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=Path, nargs="+")
    ap.add_argument("--base", default="native")
    args = ap.parse_args()
    errors: dict[str, list[float]] = {}
    photo = None
    for path in args.files:
        data = json.loads(path.read_text())
        if photo is None:
            photo = data["photo"]
        elif data["photo"] != photo:
            raise SystemExit(f"{path}: other crops than {args.files[0]}")
        for key, err in data["errors"].items():
            if key.startswith("original/") and key in errors and max(
                    abs(a - b) for a, b in zip(errors[key], err, strict=True)) > 1e-12 * max(errors[key]):
                raise SystemExit(f"{path}: {key} differs from the earlier file's (not the same crops or engine)")
            errors.setdefault(key, err)
    schemes = sorted({k.split("/", 1)[1] for k in errors})
    print("| variant / scheme | over the original | over " + args.base + " |\n|---|---|---|")
    for scheme in schemes:
        base = errors.get(f"original/{scheme}")
        for key in sorted(k for k in errors if k.endswith("/" + scheme) and not k.startswith("original/")):
            r, lo, hi = cluster_bootstrap(errors[key], base, photo)
            cell = f"| {key} | {r:.3f} ({lo:.2f}-{hi:.2f}) | "
            other = errors.get(f"{args.base}/{scheme}")
            if other is not None and not key.startswith(args.base + "/"):
                r, lo, hi = cluster_bootstrap(errors[key], other, photo)
                cell += f"{r:.3f} ({lo:.3f}-{hi:.3f}) |"
            else:
                cell += "– |"
            print(cell)


if __name__ == "__main__":
    main()
