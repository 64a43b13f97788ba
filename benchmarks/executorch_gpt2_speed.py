"""ExecuTorch (XNNPACK) float32 time of a GPT-2-shaped decoder: the normswap conversion against the original.

A random GPT-2 (width 768, 12 heads, ``--layers`` layers, LayerNorm γ/β randomised) and its ``normswap.patch``
conversion are exported with ``torch.export`` (no cache: one prefill of ``T`` tokens), lowered with ExecuTorch's
``to_edge_transform_and_lower`` + ``XnnpackPartitioner`` and run by ExecuTorch's runtime, one thread. Prints what
stays outside the XNNPACK delegate in each program (XNNPACK takes neither ``layer_norm`` nor a 3-D ``mean``) and
the converted / original time over ABBA rounds (median, and the second-lowest / second-highest round).

    PYTHONPATH=.:ET_PKGS python benchmarks/executorch_gpt2_speed.py --layers 2 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch


class LastHidden(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).last_hidden_state


def timed(meth, ids: torch.Tensor, n: int) -> float:
    """Seconds per call of ``meth`` on ``ids``, over ``n`` calls after one warm-up call."""
    meth.execute([ids])
    t = time.perf_counter()
    for _ in range(n):
        meth.execute([ids])
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 128])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from executorch_dinov2 import lower
    from transformers import GPT2Config, GPT2Model

    import normswap

    torch.manual_seed(0)
    torch.set_num_threads(1)
    original = GPT2Model(GPT2Config(n_layer=args.layers, n_embd=768, n_head=12, n_positions=256)).eval()
    for m in original.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.normal_(0, 0.1)
    converted = copy.deepcopy(original)
    normswap.patch(converted)
    result = {"layers": args.layers, "cells": {}}
    for tokens in args.tokens:
        ids = torch.randint(0, 50257, (1, tokens))
        (m_o, out_o), (m_c, out_c) = (lower(LastHidden(m).eval(), ids) for m in (original, converted))
        diff = float((m_o.execute([ids])[0] - m_c.execute([ids])[0]).abs().max())
        print(f"T={tokens}: max |converted − original| {diff:.1e}\n  outside the delegate, original: {out_o}"
              f"\n  converted: {out_c}")
        ratios = []
        for r in range(args.rounds):
            pair = [(0, m_o), (1, m_c)] if r % 2 == 0 else [(1, m_c), (0, m_o)]
            times = [0.0, 0.0]
            for k, meth in pair + pair[::-1]:
                times[k] += timed(meth, ids, max(2, 160 // tokens))
            ratios.append(times[1] / times[0])
        ratios.sort()
        cell = {"median": statistics.median(ratios), "low": ratios[1], "high": ratios[-2], "max_diff": diff}
        result["cells"][str(tokens)] = cell
        print(f"  converted / original: {cell['median']:.3f} ({cell['low']:.3f}-{cell['high']:.3f})")
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
