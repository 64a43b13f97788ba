"""How big a converted checkpoint's manifest is, and its adapter bases' side file (round 55).

Round 54 recorded the vectors an adapter on an edited Linear needs (γ / β / λ / balance) as JSON floats inside
``config.json``, one copy per Linear; round 55 keeps the structure there and the vectors, once per norm site /
λ, in ``normswap_adapter_bases.safetensors``. This writes two checkpoints with whichever normswap is on
``PYTHONPATH`` (run it once per branch) and records the sizes of ``config.json``, of the manifest's
``adapter_bases`` part (JSON, compact), of the side file and of the weights:

* ``gpt2-2x1024``: a random GPT-2 (2 layers, width 1024, 8 heads, vocabulary 1000), LayerNorm γ ~ U(0.5, 1.5),
  β ~ N(0, 0.3), seed 0, ``normswap.patch`` then ``normswap.save`` (the lead's check of round 54);
* ``dinov2-small``: ``normswap convert DINOV2 --out DIR`` of the real checkpoint (``--dinov2``).

    PYTHONPATH=$PWD python benchmarks/adapter_bases_size.py --dinov2 /tmp/ck50/dinov2-small \
        --work /tmp/adapt55/size-after --label after --json docs/results/adapter_bases55_sizes.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SIDECAR = "normswap_adapter_bases.safetensors"


def sizes(out: Path) -> dict:
    cfg = json.loads((out / "config.json").read_text())
    bases = cfg.get("normswap", {}).get("plan", {}).get("adapter_bases", {})
    weights = sum(p.stat().st_size for p in out.glob("model*.safetensors"))
    side = out / SIDECAR
    return {
        "config_json_bytes": (out / "config.json").stat().st_size,
        "adapter_bases_json_bytes": len(json.dumps(bases, separators=(",", ":"))) if bases else 0,
        "adapter_bases_linears": len(bases),
        "sidecar_bytes": side.stat().st_size if side.is_file() else 0,
        "weights_bytes": weights,
    }


def gpt2(out: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import normswap

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=1024, n_head=8, vocab_size=1000, n_positions=64)).eval()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.normal_(0, 0.3)
    normswap.patch(m)
    normswap.save(m, out, overwrite=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dinov2", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = {}
    gpt2(args.work / "gpt2")
    rows["gpt2-2x1024"] = sizes(args.work / "gpt2")
    dino = args.work / "dino"
    # run from the work directory: `python -m` puts the current directory first on sys.path, and from the
    # repository root that would be this checkout's normswap whatever PYTHONPATH says
    cmd = [sys.executable, "-m", "normswap", "convert", str(args.dinov2.resolve()), "--out", str(dino), "--overwrite"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=os.environ, cwd=args.work)
    rows["dinov2-small"] = sizes(dino)
    import normswap

    record = json.loads(args.json.read_text()) if args.json.is_file() else {}
    record[args.label] = {"normswap": normswap.__file__, "models": rows}
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({args.label: rows}, indent=1))


if __name__ == "__main__":
    main()
