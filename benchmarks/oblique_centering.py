"""Is an oblique centering of the writers exact? (issue 40, round 54: a proposed fold for per-row int8 engines.)

The conversion centers each writer's output rows, ``W' = C·diag(λ)·W`` with ``C = I − 11ᵀ/d``, so that the stream
is zero-mean and an RMSNorm computes the LayerNorm it replaces. The proposal: any ``P = I − v1ᵀ/(1ᵀv)`` also gives
``1ᵀP = 0`` (a zero-mean writer output), and with ``v_i`` = row ``i``'s scale a tiny-λ row would take a small share
of the column sums instead of ``1/d`` of them. It is not exact: the next norm must see ``C·x`` for every stream
``x = Σ_k y_k``, and ``Σ_k P_k y_k − C Σ_k y_k = Σ_k (1ᵀy_k)(1/d − v_k/1ᵀv_k)``, which vanishes for all writer
outputs only if every ``v_k ∝ 1`` (a writer whose outputs span the stream, as DINOv2's ``o_proj`` and ``fc2`` do,
leaves no other choice). This script shows it on a tiny DINOv2 replica in float64 (LayerNorm γ/β and LayerScale λ
randomised, as the tests build it): the largest output difference against the original for ``v = 1`` (the
conversion's centering), ``v`` = each row's ``max|w|`` and ``v = |λ|``.

    PYTHONPATH=$PWD python benchmarks/oblique_centering.py
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "benchmarks"))


@torch.no_grad()
def oblique(model: torch.nn.Module, folded: torch.nn.Module, how: str) -> torch.nn.Module:
    """``folded`` (the conversion with ``layer_scale="fold"``) with each writer's rows ``diag(λ)W`` (from
    ``model``, the original) centered by ``P = I − v1ᵀ/(1ᵀv)`` instead, weight and bias with the same ``v``."""
    out = copy.deepcopy(folded)
    for mine, theirs in zip(out.encoder.layer, model.encoder.layer, strict=True):
        for lin, scale in (("attention.o_proj", "layer_scale1"), ("mlp.fc2", "layer_scale2")):
            src, lam = theirs.get_submodule(lin), theirs.get_submodule(scale).lambda1.double()
            w, b = src.weight.double() * lam[:, None], src.bias.double() * lam
            v = {"ones": torch.ones_like(lam), "rowmax": w.abs().amax(1), "lambda": lam.abs()}[how]
            dst = mine.get_submodule(lin)
            dst.weight.copy_(w - v[:, None] * w.sum(0, keepdim=True) / v.sum())
            dst.bias.copy_(b - v * b.sum() / v.sum())
    return out


def main() -> dict[str, float]:
    from test_int8w_dinov2 import _tiny_dino, _tokens

    import normswap

    model = _tiny_dino()
    px = torch.randn(3, 3, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ref = _tokens(model, px)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folded = copy.deepcopy(model)
        normswap.patch(folded, beta_placement="keep", layer_scale="fold")
    out = {"conversion (layer_scale=fold)": float((_tokens(folded, px) - ref).abs().max())}
    for how in ("ones", "rowmax", "lambda"):
        out[f"oblique, v = {how}"] = float((_tokens(oblique(model, folded, how), px) - ref).abs().max())
    for name, diff in out.items():
        print(f"{name:32s} max |output − original| = {diff:.3g}  (output rms {float(ref.pow(2).mean().sqrt()):.3g})")
    return out


if __name__ == "__main__":
    main()
