"""Does a LoRA on a converted checkpoint act as the same LoRA on the original? (round 55, any transformers model)

Loads ``--model`` (a converted directory) with ``normswap.load`` and ``--reference`` (the original checkpoint)
with ``AutoModel*`` of the class the converted one was saved as, both in float64, puts the same random LoRA
(rank 8, ``B`` drawn, scaled by ``--scale``, seed fixed) on ``--targets`` of both, and reports on random valid
inputs (``normswap.inputs.hf_example_inputs``, ``--seeds`` draws) the relative max difference of the outputs
(logits or last hidden state): converted adapter model vs original adapter model, merged vs unmerged, the base
models against each other, and how much the adapter moves the original. Round 55 wrote it to check the adapter
bases a ``--low-memory`` conversion records (Whisper tiny.en), which DINOv2 cannot stream.

    PYTHONPATH=$PWD python benchmarks/adapter_bases_check.py --model W_LOW --reference WHISPER \
        --targets q_proj k_proj v_proj out_proj fc1 fc2 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch


def _out(model, probe):  # noqa: ANN001, ANN202
    with torch.no_grad():
        out = model(**probe)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--reference", type=Path, required=True)
    ap.add_argument("--targets", nargs="+", required=True)
    ap.add_argument("--scale", type=float, default=0.05)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import peft
    import transformers

    import normswap
    from normswap.inputs import hf_example_inputs

    converted = normswap.load(args.model, dtype=torch.float64)
    stock = getattr(transformers, json.loads((args.model / "config.json").read_text())["normswap"]["architecture"])
    original = stock.from_pretrained(args.reference, dtype=torch.float64).eval()
    cfg = peft.LoraConfig(r=8, target_modules=args.targets, init_lora_weights=False)
    torch.manual_seed(1)
    ref = peft.get_peft_model(copy.deepcopy(original), cfg)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.mul_(args.scale)
    lora = peft.get_peft_model(converted, copy.deepcopy(cfg))
    lora.load_state_dict({k: v for k, v in ref.state_dict().items() if "lora_" in k}, strict=False)
    wrapped = sorted({n.rsplit(".lora_A", 1)[0] for n, _ in lora.named_modules() if n.endswith(".lora_A")})
    rows = []
    for seed in range(args.seeds):
        probe = hf_example_inputs(original, seed=seed)
        probe = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in probe.items()}
        with lora.disable_adapter():
            base_conv = _out(lora, probe)
        got, want = _out(lora, probe), _out(ref, probe)
        rows.append({"seed": seed, "adapter_vs_reference_adapter": _rel(got, want),
                     "base_vs_reference_base": _rel(base_conv, _out(original, probe)),
                     "reference_adapter_vs_reference_base": _rel(want, _out(original, probe))})
    merged = lora.merge_and_unload()
    for seed, row in enumerate(rows):
        probe = hf_example_inputs(original, seed=seed)
        probe = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in probe.items()}
        row["merged_vs_reference_adapter"] = _rel(_out(merged, probe), _out(ref, probe))
    record = {"model": str(args.model), "reference": str(args.reference), "targets": args.targets,
              "wrapped": len(wrapped), "scale": args.scale, "rows": rows,
              "max": {k: max(r[k] for r in rows) for k in rows[0] if k != "seed"}}
    print(json.dumps(record["max"], indent=1), f"({len(wrapped)} Linears wrapped)")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
