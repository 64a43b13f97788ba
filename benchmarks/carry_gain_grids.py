"""The mean carry's gain after each int8 weight grid's rounding, from the weights alone (round 65; no data).

The carry adds ``-mean(h)`` through neurons with ``up`` rows ``±s/d`` (on the even, then the odd features) and
``down`` columns ``∓1/s``: after rounding, feature ``i`` receives ``-g_i·mean(h)`` with
``g_i = d·ρ̃·ã_i`` (``ρ̃`` the rounded row entry, ``ã_i`` the rounded column entry of ``down``'s row ``i``), and the
RMSNorm reading the sum sees ``(1 − g)·mean(h)`` in every token. This prints, per carry (layer) of the default
conversion (``normswap.patch``, β kept: what ``normswap convert`` writes), the gain error of ``up``'s rounding alone
(``d·ρ̃/s − 1``), of ``down``'s alone (``s·ã − 1``, largest over rows) and of both, on each grid:

* ``s8-pt``: symmetric int8 per tensor, step ``max|w|/127`` (ONNX Runtime ``quantize_dynamic`` default, U8S8);
* ``u8-pt``: asymmetric uint8 per tensor, ``[min(w,0), max(w,0)]`` in 255 steps, whole zero point (``weight_type=
  QUInt8``, U8U8; ONNX Runtime's ``compute_scale_zp``, the scale stored in float32);
* ``s8-pc`` / ``u8-pc``: the same per output row (``per_channel=True``);
* ``nncf``: NNCF's ``compress_weights`` INT8_ASYM per row (the same grid as ``u8-pc``, NNCF's float32 arithmetic).

``--scale`` re-plans each carry's ``s`` by ``MeanCarry.scale_for`` of the code imported (the float model is unchanged
for every ``s``: exact), so one run compares the ``s`` a branch chooses with the ``s`` the model was converted with.

    python benchmarks/carry_gain_grids.py --model DIR [--model DIR ...] --json gains.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from carry_row_grids import nncf_int8_asym  # noqa: E402

GRIDS = ("s8-pt", "u8-pt", "s8-pc", "u8-pc", "nncf")


def ort_u8(w: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """ONNX Runtime's asymmetric uint8 weight grid (``compute_scale_zp`` + ``quantize_nparray``), dequantized."""
    a = w.detach().cpu().float().numpy()
    lo = np.minimum(a.min(axis=1, keepdims=True) if per_channel else a.min(), 0).astype(np.float64)
    hi = np.maximum(a.max(axis=1, keepdims=True) if per_channel else a.max(), 0).astype(np.float64)
    scale = (hi - lo) / 255
    scale = np.where(scale > 0, scale, 1.0)  # an all-zero row (the carry's padding): ONNX Runtime's scale 1
    zero = np.round(0 - lo / scale)
    scale = np.asarray(scale, dtype=np.float32)
    q = np.clip(np.round(a / scale) + zero, 0, 255)
    return torch.from_numpy(((q - zero) * scale).astype(np.float32))


def ort_s8(w: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """ONNX Runtime's symmetric int8 weight grid, step ``max|w|/127`` (per tensor or per output row), dequantized."""
    a = w.detach().cpu().float().numpy()
    peak = np.abs(a).max(axis=1, keepdims=True) if per_channel else np.abs(a).max()
    scale = np.asarray(np.where(peak > 0, peak.astype(np.float64) * 2 / 254, 1.0), dtype=np.float32)
    q = np.clip(np.round(a / scale), -127, 127)
    return torch.from_numpy((q * scale).astype(np.float32))


def rounded(w: torch.Tensor, grid: str) -> torch.Tensor:
    if grid == "nncf":
        return nncf_int8_asym(w.detach().float())
    kind, per = grid.split("-")
    return (ort_u8 if kind == "u8" else ort_s8)(w, per == "pc")


def carry_gains(up_w: torch.Tensor, down_w: torch.Tensor, hidden: int, d: int, s: float
                ) -> dict[str, dict[str, float]]:
    """Per grid: the gain error of ``up``'s rounding alone, of ``down``'s alone (largest over rows) and of both
    (largest and mean over rows), for a carry whose neurons sit at ``hidden..hidden+3``."""
    out = {}
    for grid in GRIDS:
        uq, dq = rounded(up_w, grid).double(), rounded(down_w, grid).double()
        # the row entry of each pair (even features: row hidden, odd: row hidden + 2), its ± rows averaged
        rho = torch.stack([(uq[hidden, 0] - uq[hidden + 1, 0]) / 2, (uq[hidden + 2, 1] - uq[hidden + 3, 1]) / 2])
        col = torch.stack([(dq[:, hidden + 1] - dq[:, hidden]) / 2, (dq[:, hidden + 3] - dq[:, hidden + 2]) / 2])
        g_up = rho * d / s  # [2]
        g_down = col * s  # [2, d]
        g = g_up[:, None] * g_down
        out[grid] = {"up": float((g_up - 1).abs().max()), "down": float((g_down - 1).abs().max()),
                     "both": float((g - 1).abs().max()), "both_mean": float((g.mean() - 1).abs()),
                     "up_steps": float(s / d / (float(uq.abs().max()) or 1))}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, action="append", required=True)
    ap.add_argument("--scale", action="store_true",
                    help="re-plan each carry's s by the imported MeanCarry.scale_for (widened tensors rewritten)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoModel

    import normswap
    from normswap.analysis.plan import MeanCarry
    from normswap.surgery.edits import carried

    result: dict[str, Any] = {}
    for path in args.model:
        model = AutoModel.from_pretrained(path).float().eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = normswap.patch(model, tokenizer=str(path), beta_placement="keep")
        rows = []
        print(f"\n{path.name}: {len(report.plan.mean_carries)} carries")
        print("| layer | s | up entry / up peak | " + " | ".join(f"{g} up / down / both" for g in GRIDS) + " |")
        for i, c in enumerate(report.plan.mean_carries):
            up = model.get_submodule(c.up).weight.detach()
            down = model.get_submodule(c.down).weight.detach()
            s = float(c.scale)
            if args.scale:
                real_up, real_down = up[:c.hidden], down[:, :c.hidden]
                s_new = MeanCarry.scale_for(real_down, real_up.double())
                c2 = copy.copy(c)
                c2.scale = s_new
                up = carried(real_up, c2, "up.weight")
                down = carried(real_down, c2, "down.weight")
                s = s_new
            gains = carry_gains(up, down, c.hidden, c.features, s)
            rows.append({"carry": c.down, "scale": s, "scale_converted": float(c.scale), "gains": gains})
            print(f"| {i} | {s:.4g} | {gains['s8-pt']['up_steps']:.4f} | " + " | ".join(
                f"{gains[g]['up']:.3f} / {gains[g]['down']:.3f} / {gains[g]['both']:.3f}" for g in GRIDS) + " |")
        worst = {g: max(r["gains"][g]["both"] for r in rows) for g in GRIDS}
        print("| largest | | | " + " | ".join(f"{worst[g]:.3f}" for g in GRIDS) + " |")
        result[path.name] = rows
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
