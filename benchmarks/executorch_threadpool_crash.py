"""A minimal reproducer, outside normswap, of ExecuTorch's threadpool reset crashing a loaded XNNPACK program.

One ``torch.nn.Linear`` (and nothing of normswap) lowered to XNNPACK with ``to_edge_transform_and_lower`` +
``XnnpackPartitioner``; each case runs in a fresh process, ``--repeats`` times, and records how it exited:

- ``reset, then load``: ``_unsafe_reset_threadpool(1)`` before the program is loaded, then calls (what
  ``executorch_short_calls.py`` does);
- ``load at 2, reset to 1, call``: the method loaded and called on a two-thread pool, the pool reset to one thread,
  ``--churn`` other programs loaded and called (they reuse freed memory), then the first method called again;
- ``load at 2, reset to 1, load again``: the same, but the first method loaded again after the reset (the new one
  called);
- ``load at 1, reset to 2, call``: the pool grown instead (the dangling pool had one thread);
- ``load at 2, reset to 1, call, no churn``: nothing loaded between the reset and the calls.

Cause (ExecuTorch's source, ``extension/threadpool/threadpool.cpp`` and ``backends/xnnpack/runtime/XNNCompiler.cpp``
at v1.4.1 and at main, 2026-08): the XNNPACK delegate's ``init`` (at method load) hands the pool's raw
``pthreadpool_t`` to ``xnn_create_runtime_v4``, which keeps it; ``_unsafe_reset_threadpool`` destroys that pool
(``threadpool_.reset(pthreadpool_create(n))``) and creates another, so every XNNPACK runtime loaded before the reset
holds a dangling pool and its next call is a use after free (it crashes when the freed memory has been reused, hence
"now and then"). ``threadpool.h`` says so ("some other code may also be holding on to the threadpool pointer, that is
no longer valid"); upstream pull request 17641 calls the API "not safe when multiple models are loaded in a single
process".

    PYTHONPATH=$ET python benchmarks/executorch_threadpool_crash.py --repeats 10 \\
        --json docs/results/executorch58_threadpool_crash.json
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = {  # name: (pool at load, pool after the reset, other programs loaded after it, load the method again)
    "reset, then load": (None, 1, None, False),
    "load at 2, reset to 1, call": (2, 1, None, False),
    "load at 2, reset to 1, load again": (2, 1, None, True),
    "load at 1, reset to 2, call": (1, 2, None, False),
    "load at 2, reset to 1, call, no churn": (2, 1, 0, False),
}


def lower(path: Path, width: int) -> None:
    """Write a ``torch.nn.Linear(width, width)`` lowered to XNNPACK to ``path``."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    model = torch.nn.Linear(width, width).eval()
    ep = torch.export.export(model, (torch.randn(64, width),))
    path.write_bytes(to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)


def case(pte: str, name: str, width: int, calls: int, churn: int) -> None:
    """Run one case in this process; prints the pool sizes seen, exits 0 when it survives."""
    import torch
    from executorch.extension.pybindings import _C

    at_load, after, own_churn, reload = CASES[name]
    churn = churn if own_churn is None else own_churn
    x = [torch.randn(64, width)]
    if at_load is None:
        _C._unsafe_reset_threadpool(after)
    else:
        _C._unsafe_reset_threadpool(at_load)
    module = _C._load_for_executorch(pte)
    module.forward(x)
    if at_load is not None:
        _C._unsafe_reset_threadpool(after)
    others = []
    for _ in range(churn):
        others.append(_C._load_for_executorch(pte))
        others[-1].forward(x)
    if reload:
        module = _C._load_for_executorch(pte)
    for _ in range(calls):
        module.forward(x)
    print(json.dumps({"pool_after": _C._threadpool_get_thread_count()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--pte", help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--calls", type=int, default=50, help="calls after the reset, per process")
    ap.add_argument("--churn", type=int, default=3, help="programs loaded between the reset and the calls")
    ap.add_argument("--repeats", type=int, default=20, help="processes per case")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.case:
        case(args.pte, args.case, args.width, args.calls, args.churn)
        return
    with tempfile.TemporaryDirectory() as tmp:
        pte = Path(tmp) / "linear.pte"
        lower(pte, args.width)
        result: dict = {"width": args.width, "calls": args.calls, "churn": args.churn, "repeats": args.repeats,
                        "cases": {}}
        for name in CASES:
            codes: collections.Counter = collections.Counter()
            info = None
            for _ in range(args.repeats):
                cmd = [sys.executable, __file__, "--case", name, "--pte", str(pte), "--width", str(args.width),
                       "--calls", str(args.calls), "--churn", str(args.churn)]
                out = subprocess.run(cmd, capture_output=True, text=True)
                codes[out.returncode] += 1
                if out.returncode == 0:
                    info = json.loads(out.stdout.strip().splitlines()[-1])
            result["cases"][name] = {"exit_codes": {str(k): v for k, v in sorted(codes.items())}, "pools": info,
                                      "setup": dict(zip(("pool_at_load", "pool_after_reset", "churn", "reload"),
                                                        CASES[name], strict=True))}
            print(f"{name}: exit codes {dict(codes)} (of {args.repeats}); pool sizes {info}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
