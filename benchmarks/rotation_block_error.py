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
but unturned tensor's, median over the layers; and the same with λ set to 1 (the turn alone). For the
writers also the error as the next readers see it: ``‖R·Q·ΔW'‖ / ‖R·ΔW‖`` with ``R`` the readers that take the
stream next (``fc1·diag(γ2)`` after ``o_proj``; the next layer's ``q/k/v_proj·diag(γ1)`` after ``fc2``),
``ΔW'`` the turned writer's rounding error and ``ΔW`` the unturned one's: the first-order error the rounding
puts into the next matmuls' outputs (the norm between divides both by about the same rms).

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
    seen: dict[str, list[float]] = {}  # writers: the error as the next readers see it, turned / unturned
    layers = list(model.encoder.layer)

    def seen_ratio(folded: torch.Tensor, reader: torch.Tensor) -> float:
        d_unturned = fake_quant(folded, 4, 1, args.group, "full") - folded
        turned = q.T @ folded
        d_turned = fake_quant(turned, 4, 1, args.group, "full") - turned
        return float((reader @ q @ d_turned).norm() / (reader @ d_unturned).norm())

    with torch.no_grad():
        for i, layer in enumerate(layers):
            att0, mlp0 = layer.attention, layer.mlp
            reads_o = mlp0.fc1.weight.double() * layer.norm2.weight.double()[None, :]
            seen.setdefault("o_proj", []).append(
                seen_ratio(layer.layer_scale1.lambda1.double()[:, None] * att0.o_proj.weight.double(), reads_o))
            if i + 1 < len(layers):
                nxt = layers[i + 1]
                reads_f = torch.cat([getattr(nxt.attention, n).weight.double() for n in ("q_proj", "k_proj", "v_proj")])
                reads_f = reads_f * nxt.norm1.weight.double()[None, :]
                seen.setdefault("fc2", []).append(
                    seen_ratio(layer.layer_scale2.lambda1.double()[:, None] * mlp0.fc2.weight.double(), reads_f))
        for layer in layers:
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
    spans = [float(layer.layer_scale1.lambda1.detach().abs().max() / layer.layer_scale1.lambda1.detach().abs().min())
             for layer in model.encoder.layer]
    print(f"{args.model.name}: LayerScale λ1 max/min per layer, median {statistics.median(spans):.3g}")
    print("\n| tensor | turned / unturned rounding error, folds in | the same, λ = γ = 1 (the turn alone) |")
    print("|---|---|---|")
    for name, vals in rows.items():
        print(f"| {name} | {statistics.median(v[0] for v in vals):.3f} "
              f"({min(v[0] for v in vals):.2f}-{max(v[0] for v in vals):.2f}) | "
              f"{statistics.median(v[1] for v in vals):.3f} |")
    print("\n| writer | turned / unturned error as the next readers see it (median, range over layers) |")
    print("|---|---|")
    for name, vals in seen.items():
        print(f"| {name} | {statistics.median(vals):.3f} ({min(vals):.2f}-{max(vals):.2f}) |")


if __name__ == "__main__":
    main()
