"""Where a LayerScale ViT's bf16 error ratio comes from: the conversion taken apart step by step.

A DINOv2-small-shaped model (hidden 384, patch 14, config size 518) with random weights given the
statistics of trained ViTs: LayerScale λ spread over three decades (log-normal around 0.08), LayerNorm
γ/β away from 1/0, and optionally a few *massive channels* (a handful of channels of the CLS token and
of the position embeddings 5-20× larger than the rest, as trained ViTs have). Fed 224-px generated
images (what users feed a 518-px DINOv2), it measures, against the float64 original on the pooled
output, ``rel_rms_error(variant in bf16) / rel_rms_error(original in bf16)`` for:

* ``fold``: LayerScale λ folded into its writer (``W ← diag(λ) W``, ``b ← λ b``, λ ← 1), LayerNorms kept;
* ``fold+center layers``: and the attention/MLP writers centered, LayerNorms kept;
* ``fold+center embeddings``: fold, and only the embeddings centered (CLS, positions, patch conv);
* ``normswap.patch``: the whole default conversion (RMSNorm), as ``normswap convert`` does it.

    python benchmarks/bench_layerscale_bf16.py --layers 6 --seeds 0 1
    python benchmarks/bench_layerscale_bf16.py --layers 6 --no-massive
    python benchmarks/bench_layerscale_bf16.py --layers 6 --tokens   # every token, not the pooled CLS

The primary output of a ``Dinov2Model`` is ``pooler_output``: the CLS token after the final LayerNorm,
8 × 384 numbers for 8 images. Its bf16 error is the rounding of few values, so the ratio scatters
from one random model (or one set of weights) to the next; ``--tokens`` measures every token's state.
"""

from __future__ import annotations

import argparse
import copy
import math
import warnings

import torch


def build(layers: int, seed: int, massive: bool) -> torch.nn.Module:
    import transformers as tf

    cfg = tf.Dinov2Config(hidden_size=384, num_hidden_layers=layers, num_attention_heads=6, intermediate_size=1536,
                          image_size=518, patch_size=14, layerscale_value=1.0)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = tf.Dinov2Model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambda" in name:
                p.copy_(torch.exp(torch.randn(p.shape, generator=g) * 1.5 - 2.5))
            elif "norm" in name:
                p.copy_((1 + 0.5 * torch.randn(p.shape, generator=g)) if name.endswith("weight")
                        else 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
        if massive:
            model.embeddings.cls_token[..., :4] += 20
            model.embeddings.position_embeddings[..., 4:8] += 5
    return model


def writers(model: torch.nn.Module):
    for layer in model.encoder.layer:
        yield layer.attention.o_proj, layer.layer_scale1
        yield layer.mlp.fc2, layer.layer_scale2


@torch.no_grad()
def fold(model: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(model).double()
    for lin, scale in writers(model):
        lam = scale.lambda1.clone()
        lin.weight.mul_(lam[:, None])
        lin.bias.mul_(lam)
        scale.lambda1.fill_(1)
    return model


@torch.no_grad()
def center(model: torch.nn.Module, layers: bool, embeddings: bool) -> torch.nn.Module:
    model = copy.deepcopy(model)
    if layers:
        for lin, _ in writers(model):
            lin.weight.sub_(lin.weight.mean(0, keepdim=True))
            lin.bias.sub_(lin.bias.mean())
    if embeddings:
        e = model.embeddings
        for t in (e.cls_token, e.position_embeddings, e.mask_token):
            t.sub_(t.mean(-1, keepdim=True))
        conv = e.patch_embeddings.projection
        conv.weight.sub_(conv.weight.mean(0, keepdim=True))
        conv.bias.sub_(conv.bias.mean())
    return model


def main() -> None:
    import normswap
    from normswap.inputs import generated_images
    from normswap.pipeline import default_dtype
    from normswap.surgery.verify import compare, dtype_error_ratio

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--no-massive", action="store_true")
    ap.add_argument("--tokens", action="store_true",
                    help="measure on last_hidden_state (every token) instead of the pooled output")
    args = ap.parse_args()
    pixels = generated_images((8, 3, args.size, args.size), torch.Generator().manual_seed(5), torch.float32)
    print("| seed | fold | fold+center layers | fold+center embeddings | normswap.patch | fp32 error (patch) |")
    print("|---|---|---|---|---|---|")
    for seed in args.seeds:
        model = build(args.layers, seed, not args.no_massive)
        with torch.no_grad(), default_dtype(torch.float64):
            ref = copy.deepcopy(model).double()(pixel_values=pixels.double())

        def err(m: torch.nn.Module, dtype: torch.dtype, ref=ref) -> dict:
            with torch.no_grad():
                out = copy.deepcopy(m).to(dtype)(pixel_values=pixels.to(dtype))
            if args.tokens:  # every token's state, not the pooled CLS alone
                return compare({"last_hidden_state": ref.last_hidden_state},
                               {"last_hidden_state": out.last_hidden_state})
            return compare(ref, out)

        base = err(model, torch.bfloat16)
        patched = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            normswap.patch(patched)
        variants = [fold(model), center(fold(model), True, False), center(fold(model), False, True), patched]
        ratios = [dtype_error_ratio(base, err(v.float(), torch.bfloat16)) for v in variants]
        fp32 = err(patched, torch.float32)["rel_rms_error"]
        print(f"| {seed} | " + " | ".join(f"{r:.3f}" if r is not None and math.isfinite(r) else "-" for r in ratios)
              + f" | {fp32:.2e} |", flush=True)


if __name__ == "__main__":
    main()
