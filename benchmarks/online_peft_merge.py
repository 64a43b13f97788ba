"""PEFT's ``merge_and_unload`` on a real checkpoint with online Hadamards: does the merged model compute what the
adapter model computed?

A native checkpoint with online ops (``normswap convert DINOV2 --out DIR --rotate none --online-hadamard``) is
loaded, a LoRA adapter is put on ``--targets`` (by default the MLP Linears, which hold an op, and q / v, which
read the op shared after ``norm1``), its ``B`` matrices drawn at random and scaled by ``--scale`` (an adapter as a
fine-tune leaves it: ``B = 0`` at initialisation would make every merge trivially exact), and the adapter is
merged. Per photograph crop: 1 − cos (every token, float32) of the merged model against the adapter model
(the merge's error) and of the adapter model against the base (how much the adapter changes the model, for
scale). Run it with normswap before and after round 51 (``PYTHONPATH``) to compare.

``--method`` (round 52): ``lora`` (above), ``ia3`` (its scales drawn as ``1 + scale·N(0, 1)``; ``fc1`` / ``fc2``
feedforward: the scale is on the Linear's input, the op's side), ``loha`` / ``lokr`` (PEFT's random
initialisation, ``init_weights=False``, every factor drawn). ``wrapped`` in the JSON lists the modules the
adapter went on (a target name that matches no module is left out by PEFT silently: transformers 5.24's DINOv2
calls its projections ``q_proj`` / ``k_proj`` / ``v_proj``, not ``query`` / ``value``).

``--reference DIR`` (round 53): a model without online ops computing the same function (the original
checkpoint), loaded with ``AutoModel``; the adapter's values are copied onto the same modules there, and the
JSON adds the adapter model against that reference adapter model (``reference_1mcos``: what an adapter trained
on the original computes on the converted model) and the two base models against each other
(``reference_base_1mcos``: the conversion's own float32 rounding, for scale). Targets that read an op shared
after a norm (``q_proj`` / ``k_proj`` / ``v_proj`` on DINOv2) read the turned tensor before round 53.

``--reference-native`` (round 54): load ``--reference`` with ``normswap.load`` (a native checkpoint converted
*without* online ops, ``normswap convert DINOV2 --out DIR``), so that the comparison isolates the online ops from
the conversion's own folds (the writers' rows, ``o_proj`` and ``fc2``, hold the centering and DINOv2's
LayerScale, so an adapter there computes something else than on the original checkpoint whatever the ops do).
Targets ``v_proj`` / ``o_proj`` hold the per-head Hadamard of the values, which adapters there ignored before
round 54.

    python benchmarks/online_peft_merge.py --model dino-none --photos SKIMAGE/data --images 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_engines import per_image  # noqa: E402
from photo_crops import photo_crops  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    import peft

    import normswap
    from normswap.rotation import carry

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a native checkpoint with online ops")
    ap.add_argument("--photos", type=Path, required=True, help="scikit-image's skimage/data")
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--targets", nargs="+", default=["fc1", "fc2", "query", "value"])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--scale", type=float, default=0.05, help="the random B matrices' scale")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--method", choices=("lora", "ia3", "loha", "lokr"), default="lora")
    ap.add_argument("--reference", type=Path, help="the same model without online ops (the original checkpoint)")
    ap.add_argument("--reference-native", action="store_true",
                    help="load --reference with normswap.load (a native conversion without online ops)")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pixels = photo_crops(args.photos, n=args.images, size=args.image, seed=args.seed)
    model = normswap.load(args.model, dtype=torch.float32).eval()
    with torch.no_grad():
        base = model(pixel_values=pixels).last_hidden_state
    torch.manual_seed(args.seed)
    config = {
        "lora": lambda: peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=args.targets),
        "ia3": lambda: peft.IA3Config(target_modules=args.targets,
                                      feedforward_modules=[t for t in args.targets if t in ("fc1", "fc2")]),
        "loha": lambda: peft.LoHaConfig(r=args.rank, alpha=args.rank, target_modules=args.targets,
                                        init_weights=False),
        "lokr": lambda: peft.LoKrConfig(r=args.rank, alpha=args.rank, target_modules=args.targets,
                                        init_weights=False),
    }[args.method]()
    lora = peft.get_peft_model(model, config)
    wrapped = sorted(n for n, m in lora.named_modules() if hasattr(m, "base_layer") and not hasattr(m, "model"))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(args.scale * torch.randn_like(p))
            elif "ia3_l" in name:
                p.copy_(1 + args.scale * torch.randn_like(p))
        adapted = lora(pixel_values=pixels).last_hidden_state
    reference = {}
    if args.reference is not None:
        import copy

        from transformers import AutoModel

        ref_model = (normswap.load(args.reference, dtype=torch.float32) if args.reference_native else
                     AutoModel.from_pretrained(args.reference, dtype=torch.float32)).eval()
        with torch.no_grad():
            ref_base = ref_model(pixel_values=pixels).last_hidden_state
        ref_lora = peft.get_peft_model(ref_model, copy.deepcopy(config))
        names = ("lora_", "ia3_", "hada_", "lokr_")
        values = {n: p for n, p in lora.named_parameters() if any(k in n for k in names)}
        ref_params = dict(ref_lora.named_parameters())
        assert set(values) <= set(ref_params), sorted(set(values) - set(ref_params))[:3]
        with torch.no_grad():
            for n, p in values.items():
                ref_params[n].copy_(p)
            ref_adapted = ref_lora(pixel_values=pixels).last_hidden_state
        reference = {"reference": str(args.reference), "reference_native": args.reference_native,
                     "reference_1mcos": per_image(adapted, ref_adapted).tolist(),
                     "reference_base_1mcos": per_image(base, ref_base).tolist()}
        print(f"{args.label or 'run'}: adapter model vs the same adapter on the reference: 1 - cos mean "
              f"{statistics.mean(reference['reference_1mcos']):.3g} (max {max(reference['reference_1mcos']):.3g}); "
              f"base vs reference base {statistics.mean(reference['reference_base_1mcos']):.3g}")
    merged = lora.merge_and_unload()
    with torch.no_grad():
        out = merged(pixel_values=pixels).last_hidden_state
    merge_err, adapter_change = per_image(out, adapted).tolist(), per_image(adapted, base).tolist()
    ops = sum(carry.holds_op(m) for m in merged.modules())
    result = {"label": args.label, "normswap": str(Path(normswap.__file__).parent), "peft": peft.__version__,
              "method": args.method, "targets": args.targets, "wrapped": wrapped, "rank": args.rank,
              "scale": args.scale, "images": args.images,
              "ops_after_merge": ops, "merge_1mcos": merge_err, "adapter_1mcos": adapter_change, **reference}
    print(f"{args.label or 'run'}: {args.method} on {len(wrapped)} modules; {ops} ops on their modules after the "
          "merge; merged vs adapter model 1 - cos "
          f"mean {statistics.mean(merge_err):.3g} (max {max(merge_err):.3g}); adapter vs base mean "
          f"{statistics.mean(adapter_change):.3g}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
