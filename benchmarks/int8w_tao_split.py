"""torchao's int8 cost on DINOv2-small split into its pieces (round 53), torchao emulated bit for bit.

torchao 0.18's ``Int8DynamicActivationInt8WeightConfig`` on CPU is ``quant_utils.torchao_linear_`` exactly (the
per-image errors of round 52's torchao runs are reproduced to the last stored digit), so any part of it can be
switched off: ``tao-x`` (all of it, = torchao), ``w-tao`` (its weight grid alone, activations float), ``a-tao`` (its
per-token activation grid alone), ``w-127`` (LLM.int8's ``absmax / 127`` weight grid, = ``int8w_dinov2``'s
``sim-sym8``), ``xw`` / ``xr`` (torchao on the writers ``o_proj``/``fc2`` alone / on every other Linear), and the
weight grids on one writer kind (``w-tao-oproj``, ``w-127-oproj``, ``w-tao-fc2``). Variants: the original, the
default conversion (``normswap.patch(beta_placement="keep")``) and the original's null draw 1 (the same function
and row integers, other float noise: :func:`int8w_dinov2.null_draw`), the last for the first three only.

    python benchmarks/int8w_tao_split.py 256 SKIMAGE/data int8w53_split_256.json
"""

from __future__ import annotations

import copy
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

HELD_OUT = ["motorcycle_right.png", "gravel.png", "brick.png"]


def q_127(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LLM.int8's symmetric grid per row: ``absmax / 127``."""
    s = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-30)
    return torch.clamp(torch.round(x / s), -128, 127), s


def simulate(model: torch.nn.Module, wgrid: str | None, agrid: str | None,
             only: Callable[[str], bool] | None = None) -> torch.nn.Module:
    """A copy of ``model`` whose Linears (those ``only`` accepts) round weights on ``wgrid`` and inputs per token on
    ``agrid`` (``"tao"``: :func:`quant_utils.torchao_int8_grid`, ``"127"``: :func:`q_127`, ``None``: float)."""
    from quant_utils import torchao_int8_grid

    grids = {"tao": torchao_int8_grid, "127": q_127}
    q = copy.deepcopy(model)
    for name, m in q.named_modules():
        if type(m) is not torch.nn.Linear or (only is not None and not only(name)):
            continue
        w = m.weight.detach().float()
        wq, ws = grids[wgrid](w) if wgrid else (None, None)

        def fwd(x: torch.Tensor, m: torch.nn.Module = m, w: torch.Tensor = w, wq: torch.Tensor | None = wq,
                ws: torch.Tensor | None = ws) -> torch.Tensor:
            xf = x.float()
            if agrid:
                xq, xs = grids[agrid](xf)
            if wgrid and agrid:
                y = (xq.double() @ wq.double().T).float() * xs * ws.flatten()
            elif wgrid:
                y = xf @ (wq * ws).T
            elif agrid:
                y = (xq * xs) @ w.T
            else:
                y = xf @ w.T
            return (y + m.bias).to(x.dtype) if m.bias is not None else y

        m.forward = fwd
    return q


def main(argv: list[str]) -> None:
    import transformers as tf
    from int8w_dinov2 import errors, null_draw, simulated, tokens_out
    from photo_crops import photo_crops, photographs

    import normswap

    torch.set_num_threads(1)
    n, photos, out = int(argv[0]), Path(argv[1]), Path(argv[2])
    model_dir = argv[3] if len(argv) > 3 else "/tmp/ck50/dinov2-small"
    px = photo_crops(photos, n, 112, seed=1, exclude=HELD_OUT)
    files = photographs(photos, HELD_OUT)
    photo = [f.name for i, f in enumerate(files) for _ in range(n // len(files) + (1 if i < n % len(files) else 0))]
    orig = tf.Dinov2Model.from_pretrained(model_dir).eval()
    nat = copy.deepcopy(orig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(nat, beta_placement="keep")
    models = {"original": orig, "native": nat, "null-1": null_draw(orig, 1)}
    ref = tokens_out(orig, px)
    cfgs: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {
        "tao-x": lambda m: simulated(m, "sim-tao-x"), "w-tao": lambda m: simulate(m, "tao", None),
        "a-tao": lambda m: simulate(m, None, "tao"), "w-127": lambda m: simulate(m, "127", None),
        "xw": lambda m: simulated(m, "sim-tao-xw"), "xr": lambda m: simulated(m, "sim-tao-xr"),
        "w-tao-oproj": lambda m: simulate(m, "tao", None, lambda k: k.endswith("o_proj")),
        "w-127-oproj": lambda m: simulate(m, "127", None, lambda k: k.endswith("o_proj")),
        "w-tao-fc2": lambda m: simulate(m, "tao", None, lambda k: k.endswith("fc2"))}
    res: dict = {"images": n, "image": 112, "photo": photo, "rows": {}}
    for cfg, make in cfgs.items():
        t0 = time.time()
        for v, m in models.items():
            if v == "null-1" and cfg not in ("tao-x", "w-tao", "a-tao"):
                continue
            with torch.no_grad():
                e = errors(ref, tokens_out(make(m), px)).mean(1)
            res["rows"].setdefault(v, {"per_image": {}})["per_image"][cfg] = {"tok": [float(f"{x:.4g}") for x in e]}
        r = res["rows"]
        ratio = sum(r["native"]["per_image"][cfg]["tok"]) / sum(r["original"]["per_image"][cfg]["tok"])
        print(f"{cfg:12s} original {sum(r['original']['per_image'][cfg]['tok']) / n:.3e} native / original "
              f"{ratio:.3f} ({time.time() - t0:.0f} s)", flush=True)
        out.write_text(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1:])
