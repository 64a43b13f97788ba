"""Verdicts of the vision models whose plans used to depend on the image resolution (issue 22).

For each model (tiny random config, fp64, LayerNorm γ/β randomised): the verdict counts that
``normswap.plan`` gives at the configured size (32 px) and at 48 px (``interpolate_pos_encoding=True``
where the forward takes it), then ``normswap.patch(mode="exact")`` at 48 px and the worst relative
error of the converted model against the original at 32 and 64 px. Prints a markdown table
(docs/results/field-shapes.md).

    PYTHONPATH=. python benchmarks/field_shapes_table.py
"""

from __future__ import annotations

import collections
import copy
import sys
import warnings
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import normswap  # noqa: E402
from normswap.pipeline import default_dtype  # noqa: E402
from normswap.surgery.verify import compare  # noqa: E402
from tests.zoo import float64_casts, randomise  # noqa: E402

V = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
         intermediate_size=64)
MODELS = {  # name -> (class, config, does forward take interpolate_pos_encoding)
    "ViT (`interpolate_pos_encoding=True`)": (tf.ViTModel, lambda: tf.ViTConfig(**V), True),
    "DeiT (`interpolate_pos_encoding=True`)": (tf.DeiTModel, lambda: tf.DeiTConfig(**V), True),
    "CLIP-vision": (tf.CLIPVisionModel, lambda: tf.CLIPVisionConfig(**V), True),
    "SigLIP-vision": (tf.SiglipVisionModel, lambda: tf.SiglipVisionConfig(**V), True),
    "DINOv2 (interpolates by itself)": (tf.Dinov2Model, lambda: tf.Dinov2Config(
        **{k: v for k, v in V.items() if k != "intermediate_size"}, mlp_ratio=2), False),
    "BEiT, absolute positions, mean pooling": (tf.BeitModel, lambda: tf.BeitConfig(
        **V, use_mean_pooling=True, use_absolute_position_embeddings=True), False),
}


def pixels(size: int, flag: bool, seed: int) -> dict:
    x = {"pixel_values": torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(seed),
                                     dtype=torch.float64)}
    if flag and size != 32:
        x["interpolate_pos_encoding"] = True
    return x


def counts(plan: normswap.Plan) -> str:
    c = collections.Counter(s.verdict for s in plan.sites)
    return ", ".join(f"{n} {v}" for v, n in sorted(c.items()))


def main() -> None:
    warnings.simplefilter("ignore")
    print("| model | at 32 px (config) | at 48 px | converted at 48 px: error at 32 / 64 px |")
    print("|---|---|---|---|")
    for name, (cls, config, flag) in MODELS.items():
        torch.manual_seed(0)
        model = randomise(cls(config()))
        original = copy.deepcopy(model)
        row = [counts(normswap.plan(model, pixels(s, flag, 0))) for s in (32, 48)]
        report = normswap.patch(model, pixels(48, flag, 1), mode="exact")
        errors = []
        for size in (32, 64):
            x = pixels(size, flag, 2)
            with torch.no_grad(), default_dtype(torch.float64), float64_casts():
                figs = compare(original(**x), model(**x), set(report.plan.changed_outputs))
            errors.append(f"{figs['worst_rel_error_any_output']:.1e}")
        print(f"| {name} | {row[0]} | {row[1]} | {' / '.join(errors)} |", flush=True)


if __name__ == "__main__":
    main()
