"""Where ExecuTorch's ``XNNPACKQuantizer`` (static int8) quantizes inside DINOv2-small's RMSNorms, per export form.

For ``normswap convert``'s conversion (``executorch_dinov2.variant(..., "native")``) exported with the default form
(one ``aten.rms_norm`` per norm) and inside ``delegable_norms`` (``addmm``), with and without
``quantizer.set_module_type(normswap.RMSNorm, None)`` (``nf``): the ``quantize_per_tensor`` nodes of the
``convert_pt2e`` graph whose input is produced inside a norm or read inside one, by the op that produces it, and
the norm ops fed by a ``dequantize``. With ``nf``, also whether the form's extra quantize shares its input's
scale (then it is lossless) and how far the two forms' quantized outputs are apart on ``--inputs`` random images,
both in the PT2E reference graph and lowered to XNNPACK, next to each one's ``1 − cos`` against float32, and how far
the default form's reference output moves when the input is scaled by ``1 + 1e-6``. Calibrated
on ``--calib`` random images (structure, not accuracy: the accuracy runs are ``executorch_dinov2.py``).

    PYTHONPATH=.:benchmarks:$ET OMP_NUM_THREADS=1 python benchmarks/executorch_static_observers.py DINOV2_SMALL \\
        --json docs/results/executorch57_static_observers.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def inside(node: torch.fx.Node) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return bool(stack) and str(list(stack.values())[-1][1]).endswith("RMSNorm")


def is_q(node: torch.fx.Node) -> bool:
    t = str(node.target)
    return node.op == "call_function" and "quantize_per_tensor" in t and "dequantize" not in t


def is_dq(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and "dequantize" in str(node.target)


def cos_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(1 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--calib", type=int, default=4)
    ap.add_argument("--inputs", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import transformers as tf
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from executorch_dinov2 import Cls, lower_program, variant
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    import normswap
    from normswap.integrations.executorch import delegable_norms

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Cls(variant(tf.Dinov2Model.from_pretrained(args.model).eval(), "native")).eval()
    shape = (1, 3, args.image, args.image)
    calib = [torch.randn(shape) for _ in range(args.calib)]
    test = [torch.randn(shape) for _ in range(args.inputs)]
    with torch.no_grad():
        ref = [model(x) for x in test]
    result: dict = {"image": args.image, "structure": {}, "outputs": {}}
    outs: dict = {}
    for nf in (False, True):
        for form in ("default", "addmm"):
            with delegable_norms(model, form) if form != "default" else contextlib.nullcontext():
                graph = torch.export.export(model, (calib[0],)).module()
            q = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True,
                                                                                 is_dynamic=False))
            if nf:
                q.set_module_type(normswap.RMSNorm, None)
            graph = prepare_pt2e(graph, q)
            for x in calib:
                graph(x)
            graph = convert_pt2e(graph)
            quantized, fed, shared = collections.Counter(), collections.Counter(), []
            for n in graph.graph.nodes:
                if is_q(n) and isinstance(n.args[0], torch.fx.Node):
                    src = n.args[0]
                    if inside(src) or any(inside(u) for u in src.users):
                        quantized[str(src.target)] += 1
                        if src.target == torch.ops.aten.reshape.default:  # the form's extra quantize
                            before = src.args[0]
                            while isinstance(before, torch.fx.Node) and not is_dq(before) and before.args:
                                before = before.args[0]  # through shared-scale ops to the dequantize
                            shared.append(is_dq(before) and float(before.args[1]) == float(n.args[1]))
                elif n.op == "call_function" and inside(n) and not is_dq(n) and any(is_dq(a) for a in n.args):
                    fed[str(n.target)] += 1
            key = f"{form}{', nf' if nf else ''}"
            result["structure"][key] = {"quantized": dict(quantized), "fed_by_dequantize": dict(fed),
                                        "extra_quantize_shares_scale": shared}
            print(f"{key}: quantize after {dict(quantized)}; norm ops fed by a dequantize {dict(fed)}; "
                  f"reshape quantizes sharing their input's scale: {sum(shared)}/{len(shared)}", flush=True)
            if nf:
                with torch.no_grad():
                    ref_graph = [graph(x) for x in test]
                    if form == "default":  # how far a float-rounding-sized change of the input moves the output
                        nudged = [graph(x * (1 + 1e-6)) for x in test]
                meth, _, _ = lower_program(torch.export.export(graph, (calib[0],)))
                outs[form] = (ref_graph, [meth.execute([x])[0] for x in test])
    for i in range(len(test)):
        row = {}
        for where, j in (("reference", 0), ("lowered", 1)):
            a, b = outs["default"][j][i], outs["addmm"][j][i]
            row[where] = {"default": cos_err(a, ref[i]), "addmm": cos_err(b, ref[i]),
                          "max_diff": float((a - b).abs().max()), "ref_max": float(ref[i].abs().max())}
        row["default, input x (1 + 1e-6)"] = {"max_diff": float((nudged[i] - outs["default"][0][i]).abs().max())}
        result["outputs"][str(i)] = row
        print(f"input {i}: {row}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
