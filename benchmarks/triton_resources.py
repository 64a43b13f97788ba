"""Registers and spills of the triton kernels, compiled for a GPU architecture on any machine.

    python benchmarks/triton_resources.py            # sm_90 (H100)
    python benchmarks/triton_resources.py --arch 80  # sm_80 (A100)

No GPU needed: triton compiles to a cubin with its bundled ptxas, and cuobjdump reads the resource
usage (see benchmarks/triton_aot.py). ``spill B`` is per-thread local memory for spilled registers.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

from normswap.backends import triton as triton_backend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton_aot as aot  # noqa: E402 - beside this script

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES), help="repeatable (default: fp32, bf16)")
    parser.add_argument("--n", default="768,2048,4096,8192,16384,32768", help="comma-separated row lengths")
    parser.add_argument("--generic", action="store_true",
                        help="the unaligned specialisation (odd row lengths, offset views) instead of the usual one")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    kind_of = "generic (unaligned)" if args.generic else "aligned (the usual launch)"
    print(f"sm_{args.arch}, {kind_of}: registers / spill bytes per thread (weight | weight + bias | + residual)")
    print(f"{'kernel':6} {'dtype':5} {'n':>6} {'warps':>5}   {'w':>9}   {'w+b':>9}   {'w+b+res':>9}")
    for dname in args.dtype or ["fp32", "bf16"]:
        dtype = DTYPES[dname]
        for n in (int(v) for v in args.n.split(",")):
            for kind in ("fwd", "bwd"):
                warps = (triton_backend.fwd_launch_config(n, aligned=not args.generic)[2] if kind == "fwd"
                         else triton_backend.bwd_launch_config(n)[1])
                cells = []
                for has_b, has_res in ((False, False), (True, False), (True, True)):
                    used = aot.resources(aot.compile_kernel(kind, dtype, n, arch=args.arch, has_b=has_b,
                                                            has_res=has_res, aligned=not args.generic))
                    cells.append(f"{used.registers:>4} / {used.spill_bytes:<3}")
                print(f"{kind:6} {dname:5} {n:>6} {warps:>5}   " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
