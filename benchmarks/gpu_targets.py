"""Issue 4's GPU targets as one command: measure, then print pass/FAIL per target and shape.

    python benchmarks/gpu_targets.py               # bf16 (the targets' dtype); a few minutes on an H100,
                                                   # most of it torch.compile building one graph per shape
    python benchmarks/gpu_targets.py --all-dtypes  # also float16 and float32

Times the public call (``normswap.rms_norm``, backend ``auto``) against ``native`` (F.rms_norm),
``torch.compile`` of the eager math, the triton backend and layer_norm, forward and backward alone,
at the target shapes (bf16 32768/65536 x 4096 forward, 16384/32768 x 4096 backward, small shapes up
to 512 x 4096) and at the issue's model shapes (bf16; --all-dtypes adds fp16, fp32). Writes the records and the checks
to ``--out`` (JSON) and exits 1 if any target fails or could not be measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from normswap.backends import bench

TARGET_SHAPES = {
    ("fwd", "bfloat16"): [(32768, 4096), (65536, 4096)],
    ("bwd", "bfloat16"): [(16384, 4096), (32768, 4096)],
}
SMALL_SHAPES = [(1, 4096), (16, 4096), (140, 4096), (512, 4096)]
MODEL_SHAPES = [(4096, 768), (2048, 4096), (256, 2048), (8192, 8192)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 rounds instead of 9")
    ap.add_argument("--all-dtypes", action="store_true", help="also float16 and float32 (about 3x longer)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "out", "benchmarks",
                                                  "gpu_targets.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_targets: no CUDA device here (this script needs one; CPU results are in bench_ops.py)",
              file=sys.stderr)
        raise SystemExit(2)
    rounds = 5 if args.quick else 9
    dtypes = ["bfloat16", "float16", "float32"] if args.all_dtypes else ["bfloat16"]
    records: list[bench.Record] = []
    for pass_ in ("fwd", "bwd"):
        for dname in dtypes:
            shapes = list(SMALL_SHAPES) + list(MODEL_SHAPES) + TARGET_SHAPES.get((pass_, dname), [])
            for rows, n in shapes:
                new = bench.bench_shape(rows, n, bench.parse_dtype(dname), "cuda", pass_=pass_,
                                        include=("native", "triton"), rounds=rounds, target_ms=5.0,
                                        compile_=True)
                records.extend(new)
                print(bench.table(new), flush=True)
    checks = bench.check_gpu_targets(records)
    missing = bench.missing_gpu_targets(checks)
    env = bench.environment("cuda")
    print(json.dumps(env))
    print(bench.targets_table(checks))
    for name in missing:
        print(f"{name}: not measured", file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    payload = bench.to_json(records, env)
    payload["checks"] = [vars(c) for c in checks]
    with open(args.out, "w") as fh:
        json.dump(payload, fh, indent=2)
    print(f"wrote {args.out}")
    failed = [c for c in checks if not c.ok]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed" + (f"; missing: {missing}" if missing else ""))
    raise SystemExit(1 if failed or missing else 0)


if __name__ == "__main__":
    main()
