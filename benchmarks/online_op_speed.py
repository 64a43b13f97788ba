"""Host and kernel time of one online Hadamard op in torch eager, alone, in forms side by side: float32, one thread.

The op is ``x·D·H/sqrt(n)`` (``rotate(..., online=True)``): ``full``, ``H = H_K ⊗ H_{2^m}`` (``K = 12`` at the
widths timed here), or ``b32``, block-diagonal ``(I ⊗ H_32)/sqrt(32)`` (``online_block=32``). Forms:

* ``before``: the op as normswap ran it up to round 50 (a replica here): the signs, then the two matmuls of
  ``hadamard.hadamard_matmuls`` (full) or the one of ``hadamard.block_matmul`` (block), then the scale, with the
  factors read from the module on each call;
* ``op``: what normswap's hook runs now (``OnlineHadamard.transform`` on a module holding the op's buffers);
* candidates, each with its constants prepared outside the timing: ``dense`` (one ``x @ M``, ``M = D·H/sqrt(n)``
  as an ``n × n`` matrix), ``factored`` (the signs, then the matmul(s) by factors with the scale folded in: one
  elementwise op less than ``before``), ``factored-t`` (full only: the ``K`` part first, on a transposed copy,
  then the ``2^m`` part on the copy back: two large matmuls instead of one per row), ``grouped`` (block only:
  one batched matmul by ``n/b`` matrices ``D_g·H_b/sqrt(b)`` holding the signs, the input read through a
  transposed view).

Each (kind, width, rows) cell is timed in ABBA rounds (``before``, each other form, ``before``, the others in
reverse, ``before``): a form's ratio is its two timings over the mean of ``before``'s three, and ``before (A/A)``
is ``before``'s last timing over its first (the machine's noise). A timing is the time per call of the fastest
of 5 loops sized to ``--ms`` milliseconds in all. Prints the median ratio and its range over the rounds, and
``before``'s time per call in microseconds; writes every round to ``--json``.

    python benchmarks/online_op_speed.py --rounds 9 --json online_op_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from normswap.rotation import hadamard
from normswap.rotation.rotate import HADAMARD_BUFFER, SIGNS_BUFFER, OnlineHadamard, _install_online

KINDS = ("full", "b32")
FORMS = ("op", "dense", "factored", "factored-t", "grouped")


def op_module(n: int, kind: str, seed: int = 0) -> nn.Module:
    """A bare module holding one online op's buffers (signs, stored factor) as ``rotate`` installs them."""
    module = nn.Module()
    signs = hadamard.random_signs(n, seed).float()
    factor = hadamard.sylvester(32) if kind == "b32" else hadamard.small_factor(n)
    _install_online(module, factor.float(), signs, width=n)
    return module


def before(module: nn.Module, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
    """The op as normswap ran it up to round 50 (``OnlineHadamard.transform`` then): the factors read from the
    module on each call, the ``2^m`` factor converted once per dtype (``cache``, as its ``pow2_copies``)."""
    signs = getattr(module, SIGNS_BUFFER, None)
    if signs is not None:
        x = x * signs.to(x.dtype)
    small = getattr(module, HADAMARD_BUFFER)
    if hadamard.is_block_factor(small.shape[0]):
        return hadamard.block_matmul(x, small)
    m = x.shape[-1] // small.shape[0]
    cache = {} if cache is None else cache
    pow2 = cache.get(x.dtype)
    if pow2 is None:
        pow2 = cache[x.dtype] = hadamard.sylvester(m).to(x.dtype)
    return hadamard.hadamard_matmuls(x, small, pow2)


def candidates(module: nn.Module, kind: str, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """``{form: call}`` for the forms of the module doc, constants prepared here."""
    n = x.shape[-1]
    signs = getattr(module, SIGNS_BUFFER).to(x.dtype)
    small = getattr(module, HADAMARD_BUFFER).double()
    eye = torch.eye(n, dtype=torch.float64)
    dense = before(module, eye).to(x.dtype).contiguous()  # D·H/sqrt(n) as a matrix
    hook = OnlineHadamard()
    pow2_cache: dict = {}
    out: dict[str, Callable[[], torch.Tensor]] = {
        "before": lambda: before(module, x, pow2_cache),
        "op": lambda: hook.transform(module, x),
        "dense": lambda: x @ dense,
    }
    if kind == "b32":
        b = small.shape[0]
        hb = (small * b**-0.5).to(x.dtype)
        g = n // b
        groups = (signs.double().reshape(g, b, 1) * small * b**-0.5).to(x.dtype).contiguous()  # D_g H_b/sqrt(b)
        out["factored"] = lambda: ((x * signs).reshape(-1, g, b) @ hb).reshape(x.shape)
        out["grouped"] = lambda: torch.matmul(x.reshape(-1, g, b).transpose(0, 1), groups).transpose(0, 1) \
            .reshape(x.shape)
    else:
        k = small.shape[0]
        m = n // k
        pow2 = (hadamard.sylvester(m) * n**-0.5).to(x.dtype)
        kt = small.t().contiguous().to(x.dtype)
        hk = small.to(x.dtype)
        out["factored"] = lambda: torch.matmul(kt, (x * signs).reshape(-1, k, m) @ pow2).reshape(x.shape)
        # the K part first on a transposed copy ((R, m, k) @ H_K), then the 2^m part on the copy back: two GEMMs
        out["factored-t"] = lambda: (((x * signs).reshape(-1, k, m).transpose(1, 2) @ hk).transpose(1, 2)
                                     @ pow2).reshape(x.shape)
    return out


def timer(fn: Callable[[], object], ms: float, loops: int = 5) -> Callable[[], float]:
    """Seconds per call of ``fn``: the fastest of ``loops`` loops of about ``ms / loops`` milliseconds each (sized
    once; the fastest loop is the one least disturbed by other jobs on a loaded machine)."""
    t0 = time.perf_counter()
    for _ in range(5):
        fn()
    per = (time.perf_counter() - t0) / 5
    calls = max(3, int(ms / loops / 1e3 / max(per, 1e-7)))

    def seconds() -> float:
        best = float("inf")
        for _ in range(loops):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t) / calls)
        return best
    return seconds


def abba(run: dict[str, Callable[[], float]], rounds: int) -> tuple[dict[str, list[float]], list[float]]:
    """Ratios to ``before`` per round (see the module doc), and ``before``'s mean seconds per round."""
    names = [n for n in run if n != "before"]
    ratios: dict[str, list[float]] = {n: [] for n in names} | {"before (A/A)": []}
    base_s = []
    for _ in range(rounds):
        base = [run["before"]()]
        t = {n: run[n]() for n in names}
        base.append(run["before"]())
        for n in reversed(names):
            t[n] += run[n]()
        base.append(run["before"]())
        for n in names:
            ratios[n].append((t[n] / 2) / (sum(base) / 3))
        ratios["before (A/A)"].append(base[2] / base[0])
        base_s.append(sum(base) / 3)
    return ratios, base_s


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[384, 768, 1536, 3072])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 128, 1024])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--ms", type=float, default=20.0, help="milliseconds per timing")
    ap.add_argument("--grad", action="store_true", help="time with gradients enabled (default: inference mode)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results: dict = {"threads": 1, "rounds": args.rounds, "ms": args.ms, "grad": args.grad, "cells": []}
    print("| kind | width | rows | before, us/call | " + " | ".join(args.forms) + " | before (A/A) |")
    print("|---" * (len(args.forms) + 5) + "|")
    for kind in args.kinds:
        for n in args.widths:
            module = op_module(n, kind)
            for rows in args.rows:
                x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows))
                forms = candidates(module, kind, x)
                ref = before(module, x.double()).float()
                for name, fn in forms.items():  # every form computes the op
                    err = float((fn() - ref).abs().max())
                    assert err <= 1e-4, (kind, n, rows, name, err)
                with torch.inference_mode(not args.grad):
                    run = {name: timer(forms[name], args.ms) for name in ("before", *args.forms) if name in forms}
                    ratios, base_s = abba(run, args.rounds)
                cell = {"kind": kind, "width": n, "rows": rows, "before_us": [s * 1e6 for s in base_s],
                        "ratios": ratios}
                results["cells"].append(cell)
                med = {k: statistics.median(v) for k, v in ratios.items()}
                rng = {k: f"{min(v):.2f}-{max(v):.2f}" for k, v in ratios.items()}
                print(f"| {kind} | {n} | {rows} | {statistics.median(base_s) * 1e6:.1f} | "
                      + " | ".join(f"{med[f]:.2f} ({rng[f]})" if f in med else "–" for f in args.forms)
                      + f" | {med['before (A/A)']:.2f} ({rng['before (A/A)']}) |", flush=True)
                if args.json:
                    args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
