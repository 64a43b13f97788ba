"""Why a rotation can cost block-wise 4-bit weights: the rounding error each fold and the turn leave in a
real DINOv2 checkpoint's weights, tensor by tensor, with no model run.

A rotation needs LayerScale λ folded into the writers' rows (``o_proj``, ``fc2``: ``diag(λ)·W``) and the
norms' γ into the readers' columns (``q/k/v_proj``, ``fc1``: ``W·diag(γ)``), then turns the stream:
writers ``Qᵀ·diag(λ)·W``, readers ``W·diag(γ)·Q``. ONNX Runtime's ``MatMulNBits`` rounds each output row in
blocks of 32 inputs on its full grid (scale = the block's signed maximum / −8). Before the turn each writer
row has its own scales, so a row scaled by a small λ is rounded as finely as its own values; the turn mixes
every row into every other, and each rotated row's blocks then take their scale from the rows with the
largest λ. This script rounds each tensor as the quantizer does (:func:`normswap.rotation.learn.fake_quant`,
``grid="full"``) and prints the Frobenius norm of the rounding error in the stream's own basis (the turn is
orthogonal, so ``‖error‖`` of ``Qᵀ·diag(λ)·W`` is the error the stream receives), as a ratio to the folded
but unturned tensor's, median over the layers; and the same with λ set to 1 (the turn alone).

    python benchmarks/rotation_block_error.py --model /tmp/held46/dinov2-focus
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from normswap.rotation.learn import fake_quant
from normswap.rotation.rotate import rotation_matrix


def err(w: torch.Tensor, group: int) -> float:
    """Frobenius norm of the block-wise 4-bit rounding error of ``w`` (``[out, in]``, blocks along ``in``)."""
    return float((fake_quant(w, 4, 1, group, "full") - w).norm())


def main(argv: list[str] | None = None) -> None:
    import transformers as tf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a Dinov2Model directory")
    ap.add_argument("--group", type=int, default=32)
    args = ap.parse_args(argv)
    model = tf.Dinov2Model.from_pretrained(args.model).eval()
    d = model.config.hidden_size
    q, _ = rotation_matrix(d, "hadamard", seed=0)
    q = q.double()
    rows: dict[str, list[tuple[float, float]]] = {}
    with torch.no_grad():
        for layer in model.encoder.layer:
            att, mlp = layer.attention, layer.mlp
            lam1, lam2 = layer.layer_scale1.lambda1.double(), layer.layer_scale2.lambda1.double()
            writers = {"o_proj": (att.o_proj.weight.double(), lam1), "fc2": (mlp.fc2.weight.double(), lam2)}
            for name, (w, lam) in writers.items():
                folded = lam[:, None] * w
                base = err(folded, args.group)
                rows.setdefault(name, []).append((err(q.T @ folded, args.group) / base,
                                                  err(q.T @ w, args.group) / err(w, args.group)))
            g1, g2 = layer.norm1.weight.double(), layer.norm2.weight.double()
            readers = {"q_proj": (att.q_proj.weight.double(), g1), "k_proj": (att.k_proj.weight.double(), g1),
                       "v_proj": (att.v_proj.weight.double(), g1), "fc1": (mlp.fc1.weight.double(), g2)}
            for name, (w, g) in readers.items():
                folded = w * g[None, :]
                base = err(folded, args.group)
                rows.setdefault(name, []).append((err(folded @ q, args.group) / base, err(w @ q, args.group)
                                                  / err(w, args.group)))
    spans = [float(layer.layer_scale1.lambda1.abs().max() / layer.layer_scale1.lambda1.abs().min())
             for layer in model.encoder.layer]
    print(f"{args.model.name}: LayerScale λ1 max/min per layer, median {statistics.median(spans):.3g}")
    print("\n| tensor | turned / unturned rounding error, folds in | the same, λ = γ = 1 (the turn alone) |")
    print("|---|---|---|")
    for name, vals in rows.items():
        print(f"| {name} | {statistics.median(v[0] for v in vals):.3f} "
              f"({min(v[0] for v in vals):.2f}-{max(v[0] for v in vals):.2f}) | "
              f"{statistics.median(v[1] for v in vals):.3f} |")


if __name__ == "__main__":
    main()
