"""Does a real engine's module swap on a checkpoint with online Hadamards get refused before it computes a wrong
output, in the ways a user swaps: on the model itself, on a deep copy of it, and with the old modules still
referenced?

optimum-quanto's ``quantize(model, weights=qint8)`` + ``freeze(model)`` replaces every ``nn.Linear`` by its
``QLinear`` (the online op's hook and buffers stay on the old module). Per case, on a native checkpoint with online
ops (``normswap convert DINOV2 --out DIR --rotate none --online-hadamard --dtype float32``): how many ops the swap
dropped, whether the next call ran (and its 1 − cos against the float model, every token) or was refused, and
1 − cos once ``carry_online_ops`` put the ops back. Run it with normswap before and after round 51
(``PYTHONPATH``) to compare. Round 52 adds ``a layer called directly``: the swap on the model, then
``model.encoder.layer[0]`` called by itself (past the model's pre-hook) on the embeddings' output, compared with
the float model's first layer. Round 53 adds ``a quantized layer written into _modules``: a deep copy of
``encoder.layer[0]`` quantized and frozen by itself, then written straight into the list's ``_modules``
(``model.encoder.layer._modules["0"] = copy``, no ``setattr``: no torch hook sees it), the model called. Round 55
adds three: ``the MLP's _modules replaced whole`` (``mlp._modules = {**mlp._modules, "fc1": qfc1}``, ``qfc1`` the
``QLinear`` of a quantized deep copy of layer 0's MLP; the model called), ``a QLinear written into the MLP's
_modules, the layer called directly`` (``mlp._modules["fc1"] = qfc1``, then ``model.encoder.layer[0]`` called by
itself before any model call) and ``fc1's hook dictionary replaced whole`` (``fc1._forward_pre_hooks =
OrderedDict()``: no engine, the op's hook gone with its dictionary; the model called).

    PYTHONPATH=QUANTO:$PWD python benchmarks/online_guard_engines.py --model dino-none --photos SKIMAGE/data
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
from collections import OrderedDict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_engines import one_minus_cos  # noqa: E402
from photo_crops import photo_crops  # noqa: E402

CASES = ("the model", "a deep copy", "old modules referenced", "a layer called directly",
         "a quantized layer written into _modules", "the MLP's _modules replaced whole",
         "a QLinear written into the MLP's _modules, the layer called directly", "fc1's hook dictionary replaced whole")
DIRECT = ("a layer called directly", "a QLinear written into the MLP's _modules, the layer called directly")


def main(argv: list[str] | None = None) -> dict:
    from optimum.quanto import freeze, qint8, quantize

    import normswap
    from normswap.errors import NormswapError
    from normswap.rotation import carry

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a native checkpoint with online ops")
    ap.add_argument("--photos", type=Path, required=True, help="scikit-image's skimage/data")
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pixels = photo_crops(args.photos, n=args.images, size=args.image, seed=args.seed)

    def run(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return m(pixel_values=pixels).last_hidden_state

    def first_layer(m: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = m.encoder.layer[0](hidden)
        return out[0] if isinstance(out, tuple) else out

    rows = {}
    for case in CASES:
        model = normswap.load(args.model, dtype=torch.float32).eval()
        call = run
        if case in DIRECT:
            with torch.no_grad():
                hidden = model.embeddings(pixel_values=pixels)
            call = lambda m, hidden=hidden: first_layer(m, hidden)  # noqa: E731
        ref = call(model)
        kept = dict(model.named_modules()) if case == "old modules referenced" else None
        work = copy.deepcopy(model) if case == "a deep copy" else model
        mlp = work.encoder.layer[0].mlp
        if case == "a quantized layer written into _modules":
            block = copy.deepcopy(work.encoder.layer[0])
            quantize(block, weights=qint8)
            freeze(block)
            work.encoder.layer._modules["0"] = block
        elif case in CASES[5:7]:  # the QLinear of a quantized copy of layer 0's MLP, written in without setattr
            block = copy.deepcopy(mlp)
            quantize(block, weights=qint8)
            freeze(block)
            if case == CASES[5]:
                mlp._modules = {**mlp._modules, "fc1": block.fc1}
            else:
                mlp._modules["fc1"] = block.fc1
        elif case == CASES[7]:
            mlp.fc1._forward_pre_hooks = OrderedDict()
        else:
            quantize(work, weights=qint8)
            freeze(work)
        gc.collect()
        row = {"dropped": len(carry.missing_online_ops(work)), "kept": kept is not None}
        try:
            row["ran_1mcos"] = one_minus_cos(ref, call(work))
        except NormswapError as exc:
            row["refused"] = str(exc)
        carry.carry_online_ops(work)
        row["carried_1mcos"] = one_minus_cos(ref, call(work))
        rows[case] = row
        print(f"{args.label or 'run'}, {case}: {row['dropped']} ops dropped; next call "
              + (f"ran, 1 - cos {row['ran_1mcos']:.3g}" if "ran_1mcos" in row else "refused")
              + f"; carried back 1 - cos {row['carried_1mcos']:.3g}")
    result = {"label": args.label, "normswap": str(Path(normswap.__file__).parent), "images": args.images,
              "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
