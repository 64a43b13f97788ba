"""What a :class:`normswap.rotation.carry.WatchedModules` (round 53: the ``_modules`` dictionary of each module on
the way to an online op, a ``dict`` subclass that tells the guard of writes) costs a submodule read: ``m.mlp``
through ``nn.Module.__getattr__`` on a module whose ``_modules`` is watched, against the same module with a plain
``dict``. CPython specialises ``dict[key]`` for exact dicts only, so the subclass takes the generic path.

Nanoseconds per read (a lambda's call included, the same in both), the fastest of ``--repeats`` alternated
timings (plain, watched, watched, plain) of ``--reads`` reads, and their ratio.

    OMP_NUM_THREADS=1 python benchmarks/watched_modules_read.py --json docs/results/watched_modules_read53.json
"""

from __future__ import annotations

import argparse
import json
import timeit
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> dict:
    from normswap.rotation.carry import WatchedModules

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reads", type=int, default=200000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    plain, watched = torch.nn.Module(), torch.nn.Module()
    for m in (plain, watched):
        m.add_module("mlp", torch.nn.Identity())
        m.add_module("attn", torch.nn.Identity())
    watched.__dict__["_modules"] = WatchedModules(watched.__dict__["_modules"])
    runs: dict[str, list[float]] = {"plain": [], "watched": []}
    for _ in range(args.repeats):
        for name, m in (("plain", plain), ("watched", watched), ("watched", watched), ("plain", plain)):
            runs[name].append(timeit.timeit(lambda m=m: m.mlp, number=args.reads) / args.reads * 1e9)
    out = {"reads": args.reads, "repeats": args.repeats, "ns": runs,
           "plain_ns": min(runs["plain"]), "watched_ns": min(runs["watched"])}
    out["ratio"] = out["watched_ns"] / out["plain_ns"]
    print(f"submodule read: plain dict {out['plain_ns']:.1f} ns, watched {out['watched_ns']:.1f} ns, "
          f"ratio {out['ratio']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
