"""ExecuTorch (XNNPACK) on the real DINOv2-small: a held-out engine, float32 speed and int8 error.

Variants: ``original``; ``native`` (``normswap.patch(beta_placement="keep")``, what ``normswap convert`` writes);
``wop`` / ``wauto`` (``writer_centering="op"`` / ``"auto"``); a ``+FORM`` suffix (``native+addmm``) exports that
variant inside ``normswap.integrations.executorch.delegable_norms(model, FORM)`` (each RMSNorm's mean of squares as
a matrix product, which XNNPACK delegates); ``native+rewrite`` quantizes the default form and rewrites the quantized
program's norms into the ``addmm`` form before lowering (``delegable_program``). Each is exported with
``torch.export``, lowered to XNNPACK with ExecuTorch's own ``to_edge_transform_and_lower`` + ``XnnpackPartitioner``
and run by ExecuTorch's runtime. Quantized: ExecuTorch's ``XNNPACKQuantizer`` through torchao's PT2E flow
(``prepare_pt2e`` / ``convert_pt2e``), ``--schemes``: ``dyn`` (dynamic int8 activations, int8 weights per channel,
the on-device default), ``static`` (static int8 activations, weights per channel, calibrated on ``--calib`` crops of
held-out photographs) and ``static-nf`` (the same with ``quantizer.set_module_type(normswap.RMSNorm, None)``: each
RMSNorm's elementwise ops left in float, as XNNPACKQuantizer leaves the original's ``layer_norm``). Error: ``1 −
cos`` of the CLS embedding against the float32 original, per crop; ratio to the original with a 95% interval that
resamples photographs (``quant_utils.cluster_bootstrap``). Speed: float32 per-image time, ABBA rounds against the
original, medians.

    PYTHONPATH=.:ET_PKGS python benchmarks/executorch_dinov2.py DINOV2_SMALL --photos SKIMAGE/data --images 256
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


class Cls(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, px: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=px).last_hidden_state[:, 0]


def variant(original, name):
    import normswap

    if name == "original":
        return original
    model = copy.deepcopy(original)
    opts = {"native": {}, "wop": {"writer_centering": "op"}, "wauto": {"writer_centering": "auto"}}[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(model, beta_placement="keep", **opts)
    return model


# every program's buffer and loaded program, kept alive: a method whose program was freed crashes the process
KEEP: list = []


def lower(module, example, quant=None, calib=None, rewrite=False):
    """``module`` exported, PT2E-quantized when ``quant`` (calibrated on ``calib``), lowered to XNNPACK; returns
    the runtime method and the count of each op left outside the delegate. ``rewrite``: the program's
    ``aten.rms_norm`` nodes rewritten into the ``addmm`` form just before lowering (after quantization, so the
    quantizer sees the default form), by ``normswap.integrations.executorch.delegable_program``."""
    if quant is not None:
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
            XNNPACKQuantizer,
            get_symmetric_quantization_config,
        )
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        graph = torch.export.export(module, (example,)).module()
        q = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True,
                                                                             is_dynamic=quant == "dyn"))
        if quant == "static-nf":  # every norm left in float, as the original's LayerNorm is
            import normswap

            q.set_module_type(normswap.RMSNorm, None)
        graph = prepare_pt2e(graph, q)
        for x in calib:
            graph(x[None])
        module = convert_pt2e(graph)
    ep = torch.export.export(module, (example,))
    if rewrite:
        from normswap.integrations.executorch import delegable_program

        ep = delegable_program(ep)
    meth, outside, _ = lower_program(ep)
    return meth, outside


def lower_program(ep):
    """An exported program lowered to XNNPACK; returns the runtime method, the count of each op left outside the
    delegate and the ``.pte`` bytes."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    outside = {}
    for n in edge.exported_program().graph.nodes:
        if n.op == "call_function":
            k = getattr(n.target, "__name__", str(n.target))
            if "delegate" not in k and "getitem" not in k:
                outside[k] = outside.get(k, 0) + 1
    buf = edge.to_executorch().buffer
    prog = Runtime.get().load_program(buf)
    KEEP.extend([buf, prog])
    return prog.load_method("forward"), outside, buf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--photos", type=Path, required=True)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--calib", type=int, default=16)
    ap.add_argument("--calib-photos", default="motorcycle_right.png,gravel.png,brick.png")
    ap.add_argument("--variants", nargs="+", default=["original", "native", "wop", "wauto"])
    ap.add_argument("--schemes", nargs="+", default=["fp32", "dyn", "static"])
    ap.add_argument("--rounds", type=int, default=8, help="ABBA rounds of the float32 timing")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import transformers as tf
    from photo_crops import photo_crops, photographs
    from quant_utils import cluster_bootstrap

    torch.set_num_threads(1)
    held = args.calib_photos.split(",")
    px = photo_crops(args.photos, args.images, args.image, seed=0, exclude=held)
    files = photographs(args.photos, held)
    photo = [files[i].name for i in range(len(files))
             for _ in range(args.images // len(files) + (1 if i < args.images % len(files) else 0))]
    calib = photo_crops(args.photos, args.calib, args.image, seed=1, files=[f for f in photographs(args.photos)
                                                                              if f.name in held])
    original = tf.Dinov2Model.from_pretrained(args.model).eval()
    with torch.no_grad():
        ref = Cls(original)(px)
    from normswap.integrations.executorch import delegable_norms

    result = {"images": len(px), "image": args.image, "photo": photo, "errors": {}, "outside": {}, "speed": {}}
    methods = {}
    for name in args.variants:
        base, _, form = name.partition("+")
        model = Cls(variant(original, base)).eval()
        for scheme in args.schemes:
            t0 = time.perf_counter()
            with delegable_norms(model, form) if form not in ("", "rewrite") else contextlib.nullcontext():
                meth, outside = lower(model, px[:1], None if scheme == "fp32" else scheme, calib,
                                      rewrite=form == "rewrite")
            out = torch.cat([meth.execute([px[i:i + 1]])[0] for i in range(len(px))])
            err = (1 - torch.nn.functional.cosine_similarity(out.double(), ref.double(), dim=-1)).tolist()
            result["errors"][f"{name}/{scheme}"] = err
            result["outside"][f"{name}/{scheme}"] = outside
            if scheme == "fp32":
                methods[name] = meth
            print(f"{name}/{scheme}: 1-cos mean {statistics.mean(err):.3e} ({time.perf_counter() - t0:.0f} s); "
                  f"outside the delegate: {outside}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(result, indent=1))
    print("\n| variant | " + " | ".join(args.schemes) + " |\n|---|" + "---|" * len(args.schemes))
    for name in args.variants:
        cells = []
        for scheme in args.schemes:
            r, lo, hi = cluster_bootstrap(result["errors"][f"{name}/{scheme}"],
                                          result["errors"][f"original/{scheme}"], photo)
            cells.append(f"{r:.3f} ({lo:.2f}-{hi:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    x = px[:1]

    def timed(meth, n=10):
        meth.execute([x])
        t = time.perf_counter()
        for _ in range(n):
            meth.execute([x])
        return (time.perf_counter() - t) / n
    for name in args.variants if "fp32" in args.schemes else ():
        if name == "original":
            continue
        ratios = []
        for r in range(args.rounds):
            order = [("o", methods["original"]), ("v", methods[name])]
            if r % 2:
                order.reverse()
            times = {k: 0.0 for k, _ in order}
            for k, m in order + order[::-1]:
                times[k] += timed(m)
            ratios.append(times["v"] / times["o"])
        ratios.sort()
        result["speed"][name] = {"median": statistics.median(ratios), "low": ratios[0], "high": ratios[-1]}
        print(f"float32 time {name} / original: {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
