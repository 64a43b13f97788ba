"""Where a Post-LN encoder's mean carry sits on the per-tensor int8 grids of its MLP (a markdown table).

For each FFN output dense ``down`` (centered, as the conversion writes it) and FFN first dense ``up`` of
a BERT/MPNet-layout transformers directory: ``max|w|/rms``, the smallest row peak in per-tensor steps
(``max|w|/127``), the carry column ``1/s`` in steps for the power-of-two choice of the first commit and
its rounding, ``1/s`` now (``MeanCarry.scale_for``: whole steps, or fewer where the per-tensor gain
allows), the carry rows ``s/d`` in ``up``'s steps before and now, the carry row's length ``s/√d`` over
the longest real ``up`` row (at most 1/2 by construction), and ``P = 1/(d·step_down·step_up)``: the
carry's gain after per-tensor quantization is a whole multiple of ``1/P``. ``up`` is the checkpoint's
(the conversion's centered readers move its range by a few %). Weights only, no inputs; seconds on CPU.

    python benchmarks/carry_grid.py --model DIR
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from normswap.analysis.plan import MeanCarry


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    args = ap.parse_args(argv)
    from transformers import AutoModel

    model = AutoModel.from_pretrained(args.model).float().eval()
    print("| layer | `down` max/rms | smallest row peak (steps) | `1/s`, power of two (steps) | its rounding "
          "| `1/s` now (steps) | `s/d` in `up` (steps), before → now | carry row / longest `up` row | `P` |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, mod in model.named_modules():
        if not name.endswith("output.dense") or "attention" in name:
            continue
        w = mod.weight.detach().double()
        w = w - w.mean(0, keepdim=True)  # centered, as the conversion writes it
        up = model.get_submodule(name.replace("output.dense", "intermediate.dense")).weight.detach().double()
        d = w.shape[0]
        peaks = w.abs().amax(1)
        step, ustep = float(w.abs().max()) / 127, float(up.abs().max()) / 127
        old = 2.0 ** -math.ceil(-math.log2(float(peaks.min())))
        new = 1 / MeanCarry.scale_for(w, up)
        row_share = 1 / (new * math.sqrt(d)) / float(up.norm(dim=1).max())
        rounding = abs(round(old / step) * step - old) / old
        rms = float(w.pow(2).mean().sqrt())
        print(f"| {name.split('.')[2]} | {float(w.abs().max()) / rms:.0f} | {float(peaks.min()) / step:.2f} "
              f"| {old / step:.2f} | {rounding:.0%} | {new / step:.2f} "
              f"| {1 / (old * d) / ustep:.2f} → {1 / (new * d) / ustep:.2f} | {row_share:.2f} "
              f"| {1 / (d * step * ustep):.2f} |")


if __name__ == "__main__":
    main()
