"""One online Hadamard op in its exported forms: exported to ONNX and run by ONNX Runtime (CPU provider, one
thread), and in torch eager. Float32.

Forms (``--forms``, the first the reference, ``before``): ``butterfly``, the fast Walsh–Hadamard transform
(``hadamard.fwht``: what the op exported and ran in eager above order 256 up to round 51, about six graph nodes
per stage); ``matmuls``, round 51's stock form, ``H_K ⊗ H_{2^m}`` (``H_K ⊗ H_r ⊗ H_256`` above order 256) as two or
three matmuls, the signs and the scale as ``Mul`` nodes (``hadamard.hadamard_matmuls``); ``split``, the product's
stock form now (the op's hook; round 52): the eager form's split ``(H_K ⊗ H_{2^m/b}) ⊗ H_b`` as two matmuls, the
scale in ``H_b`` (``hadamard.split_matmuls``); in eager the hook runs its eager form
(``normswap.rotation.eager_op.EagerOp``), which ``op`` times too. Each (width, rows) cell: the ONNX graph's node
count per form, then ABBA rounds (``before``, the others, ``before``, the others in reverse, ``before``), each
form's two timings over the mean of ``before``'s three, and ``before (A/A)``, its last timing over its first
(``online_op_speed.abba``). A timing is the fastest of 5 loops of ``--ms`` ms / 5.

    python benchmarks/online_op_export_speed.py --rounds 7 --json docs/results/online_op_export_speed.json
    python benchmarks/online_op_export_speed.py --forms matmuls split --widths 384 1536 512 2048 --rows 1 520
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import nn

from normswap.rotation import hadamard
from normswap.rotation.rotate import HADAMARD_BUFFER, SIGNS_BUFFER, _install_online

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_op_speed import abba, timer  # noqa: E402

FORMS = ("butterfly", "matmuls", "split")


class Form(nn.Module):
    """``x·D·H/sqrt(n)`` in one stock form, with the op's buffers of a module built by the product: ``butterfly``
    and ``matmuls`` replicated here (round 51's forms), ``split`` the product's own (the op's hook, which runs its
    stock form while a graph is captured; in eager its :class:`EagerOp`)."""

    def __init__(self, n: int, form: str) -> None:
        super().__init__()
        holder = nn.Module()
        _install_online(holder, hadamard.small_factor(n).float(), hadamard.random_signs(n, 0).float(), width=n)
        self.register_buffer("small", getattr(holder, HADAMARD_BUFFER))
        self.register_buffer("signs", getattr(holder, SIGNS_BUFFER))
        pow2, rest = hadamard.pow2_factors(n // self.small.shape[0])  # round 51: H_{2^m}, or H_256 and H_r above 256
        self.register_buffer("pow2", pow2.float())
        self.register_buffer("rest", None if rest is None else rest.float())
        self.form = form
        self.holder = holder
        self.hook = next(iter(holder._forward_hooks.values()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "split":
            return self.hook.transform(self.holder, x)
        x = x * self.signs
        if self.form == "butterfly":
            return hadamard.fwht(x, self.small)
        return hadamard.hadamard_matmuls(x, self.small, self.pow2, rest=self.rest)


def measure(n: int, rows: int, tmp: Path, rounds: int, ms: float, names: tuple[str, ...] = FORMS[:2]) -> dict:
    """One (width, rows) cell: node counts, then ONNX Runtime's and eager's ABBA ratios to the first of ``names``
    (``before``)."""
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    forms = {("before" if i == 0 else name): Form(n, name).eval() for i, name in enumerate(names)}
    x = torch.randn(rows, n)
    want = forms["before"](x)
    ort_runs, nodes = {}, {}
    for name, module in forms.items():
        path = tmp / f"{name}-{n}-{rows}.onnx"
        torch.onnx.export(module, (x,), str(path), dynamo=True, optimize=True)
        nodes[name] = len(onnx.load(str(path)).graph.node)
        session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        feed = {session.get_inputs()[0].name: x.numpy()}
        assert np.abs(session.run(None, feed)[0] - want.numpy()).max() < 1e-4, (name, n)
        ort_runs[name] = timer(partial(session.run, None, feed), ms)
    holder = nn.Module()
    _install_online(holder, hadamard.small_factor(n).float(), hadamard.random_signs(n, 0).float(), width=n)
    hook = next(iter(holder._forward_hooks.values()))
    with torch.inference_mode():
        torch.testing.assert_close(hook.transform(holder, x), want, atol=1e-4, rtol=0)
        eager_runs = {name: timer(partial(m, x), ms) for name, m in forms.items()}
        eager_runs["op"] = timer(partial(hook.transform, holder, x), ms)
        (ort_ratios, ort_s), (eager_ratios, eager_s) = abba(ort_runs, rounds), abba(eager_runs, rounds)
    return {"width": n, "rows": rows, "before": names[0], "nodes": nodes, "ort": ort_ratios, "eager": eager_ratios,
            "ort_butterfly_us": statistics.median(ort_s) * 1e6, "eager_butterfly_us": statistics.median(eager_s) * 1e6}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ms", type=float, default=40.0)
    ap.add_argument("--forms", nargs="+", default=list(FORMS[:2]), choices=FORMS,
                    help="the forms timed, the first the reference (its figures are named before/butterfly)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results: dict = {"cells": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.widths:
            for rows in args.rows:
                cell = measure(n, rows, Path(tmp), args.rounds, args.ms, tuple(args.forms))
                results["cells"].append(cell)
                for engine in ("ort", "eager"):
                    parts = ", ".join(f"{k} {statistics.median(v):.3f} ({min(v):.2f}-{max(v):.2f})"
                                      for k, v in cell[engine].items())
                    print(f"width {n:5d} rows {rows:4d} {engine:5s} nodes {cell['nodes']}: {parts}; butterfly "
                          f"{cell[engine + '_butterfly_us']:.0f} us", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
