"""ONNX Runtime's GPTQ (``MatMulNBitsQuantizer`` + ``GPTQWeightOnlyQuantConfig``): how to call it, what is wrong
with it in ONNX Runtime 1.32, and a patched copy to measure what GPTQ would do if it worked.

ONNX Runtime's GPTQ is a vendored copy of Intel Neural Compressor's
(``onnxruntime/quantization/neural_compressor/weight_only.py``). Three things make it unusable as shipped,
and a fourth makes it unfit for rotated models:

1. **The setting** ``perchannel=False`` (what the Whisper benchmark passed) is not "per-block scales": the
   vendored ``find_params`` then flattens each group of ``group_size`` input rows over *every* output column
   and gives it one scale, so a 4-bit grid spans a whole 32 × N band and most weights round to 0. Use the
   default ``perchannel=True`` (one scale per group and output column, what ``MatMulNBits`` stores).
2. **The error feedback is dropped** (an ONNX Runtime bug). ``Hinv = cholesky(inv(H)).T`` is upper triangular,
   but the updates read its lower part: ``W1[i:, :] -= Hinv1[i:, i] ⊗ err`` (only the diagonal entry is
   non-zero, so a row just becomes its own rounding) and ``W[i2:, :] -= Hinv[i2:, i1:i2] @ Err1`` (an all-zero
   block). GPTQ reduces to round-to-nearest. The weight layout is ``[in, out]`` (``MatMul``'s ``B``), so the
   reference's ``Hinv1[i, i:]`` and ``Hinv[i1:i2, i2:]`` become ``Hinv1[i, i:]`` and ``Hinv[i1:i2, i2:].T`` here.
3. **The result is rounded twice** (an ONNX Runtime bug). GPTQ's values lie on its grid (``k · 2·max/15``,
   ``k ∈ −8…7``); ``gptq_quantize`` then re-quantizes them with ``quant_tensor`` on another grid
   (``2·max|Q|/15`` with the codes offset by 8, which never holds a group's own extremes), so every weight
   is rounded a second time. (With ``actorder=True`` the groups are also formed in the permuted order while
   ``MatMulNBits`` blocks follow the stored order.)

4. **``nodes_to_exclude`` is ignored** (ONNX Runtime 1.32): ``MatMulNBitsQuantizer`` marks the listed nodes
   ``"fp32"`` for RTN only; its GPTQ path rounds every weight ``MatMul`` (a rotation's ``Qᵀ`` included).

:func:`patched` swaps in :func:`gptq_fixed` (2 fixed; with ``actorder=True`` it rounds in act-order on static
groups, which ``MatMulNBits`` can store) and :func:`encode_exact` (3 fixed: the codes of GPTQ's own grid are
stored as they are) for the duration of a ``with`` block, and :func:`gptq_quantize_one_pass` (the same
Hessians from one calibration pass per batch instead of one per ``MatMul`` input); :func:`quantize` builds the
quantizer with the right setting (1), a reader the GPTQ path can iterate and the excluded nodes kept float (4).

    python benchmarks/ort_gptq.py --repro                                 # the bug on one random layer
    python benchmarks/ort_gptq.py --model DIR --texts 256 --json out.json  # a sentence encoder, original vs converted
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_utils import BatchReader  # noqa: E402 (the benchmarks folder is on the path only now)

# the patched GPTQ's settings by mode name: ``-act`` rounds rows in act-order with static groups (gptq_fixed)
PATCHED = {"nbits-gptq-patched": {"actorder": False}, "nbits-gptq-patched-act": {"actorder": True}}
MODES = ("nbits-rtn", "nbits-gptq", *PATCHED)


class IterableReader(BatchReader):
    """A calibration reader the GPTQ path accepts: it ``deepcopy``s the reader and iterates it (``for data in
    reader``), which ONNX Runtime's ``CalibrationDataReader`` protocol (``get_next``) alone does not give."""

    def __iter__(self) -> Iterator[dict]:
        return iter(list(self.batches))


def config(feeds: list[dict], actorder: bool = False) -> Any:
    """``GPTQWeightOnlyQuantConfig`` as it should be called: per-channel group scales (``perchannel=True``, the
    default: one scale per block of 32 input rows and output column, what ``MatMulNBits`` stores), GPTQ's
    own column blocks of 128, damping 1% of the Hessian's mean diagonal (the default), calibrated on
    ``feeds``; ``actorder`` only with :func:`patched` (ONNX Runtime's own act-order breaks the blocks)."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mq

    return mq.GPTQWeightOnlyQuantConfig(IterableReader(feeds), block_size=128, perchannel=True, actorder=actorder)


def quantize(fp32: Path, out: Path, how: str, feeds: list[dict] | None = None,
             nodes_to_exclude: list[str] | None = None) -> Path:
    """``fp32`` as 4-bit ``MatMulNBits`` (blocks of 32, symmetric): ``nbits-rtn`` ONNX Runtime's default
    round-to-nearest, ``nbits-gptq`` its GPTQ as shipped (set up right), ``nbits-gptq-patched`` the same with
    the two bugs fixed (:func:`patched`), ``nbits-gptq-patched-act`` that with act-order and static groups
    (:func:`gptq_fixed`); ``nodes_to_exclude`` stay float."""
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as mq

    if how == "nbits-rtn":
        algo = mq.DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True)
        q = mq.MatMulNBitsQuantizer(onnx.load(str(fp32)), block_size=32, is_symmetric=True, algo_config=algo,
                                    nodes_to_exclude=nodes_to_exclude)
        q.process()
    else:
        assert feeds, "GPTQ needs calibration feeds"
        if how not in ("nbits-gptq", *PATCHED):
            raise ValueError(f"{how}: not one of {', '.join(MODES)}")
        with patched() if how in PATCHED else contextlib.nullcontext():
            algo = config(feeds, **PATCHED.get(how, {}))
            q = Excluding(str(fp32), block_size=32, is_symmetric=True, algo_config=algo,
                          nodes_to_exclude=nodes_to_exclude)
            q.process()
    q.model.save_model_to_file(str(out), use_external_data_format=False)
    for name in ("onnxruntime.quantization.matmul_nbits_quantizer", "onnxruntime.quantization"):
        logging.getLogger(name).setLevel(logging.WARNING)  # the GPTQ path leaves it at INFO (a line per node)
    return out


def _excluding() -> type:
    """``MatMulNBitsQuantizer`` that keeps ``nodes_to_exclude`` float under GPTQ too. ONNX Runtime 1.32 marks
    them ``"fp32"`` in the node config for RTN only; its GPTQ path quantizes every weight ``MatMul`` whatever
    the list says (so a rotation's ``Qᵀ`` would be rounded). Both GPTQ loops skip a node marked ``"fp32"``."""
    from onnxruntime.quantization import matmul_nbits_quantizer as mq

    class _Excluding(mq.MatMulNBitsQuantizer):
        def _generate_q4_node_config(self) -> dict:  # ONNX Runtime's hook (private): the one place to mark them
            cfg = super()._generate_q4_node_config()
            return {**cfg, **dict.fromkeys(self.nodes_to_exclude, "fp32")}

    return _Excluding


def Excluding(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 (a class, built on first use: no ONNX Runtime import here)
    """A :func:`_excluding` quantizer (``MatMulNBitsQuantizer``'s arguments)."""
    return _excluding()(*args, **kwargs)


_GRIDS: list[tuple[np.ndarray, np.ndarray]] = []  # (scale, zero) per group row, per layer: gptq_fixed → encode_exact


def gptq_fixed(W: np.ndarray, H: np.ndarray, num_bits: int = 4, group_size: int = 32,  # noqa: N803
               scheme: str = "asym", blocksize: int = 128, percdamp: float = 0.01, actorder: bool = False,
               mse: bool = False, perchannel: bool = True) -> np.ndarray:
    """ONNX Runtime's ``gptq`` with the error feedback reading the upper Cholesky factor (bug 2), and the grid
    of every group kept for :func:`encode_exact`. ``W`` is ``[in, out]``; returns the fake-quantized weight.

    ``actorder=True``: rows are rounded in decreasing order of the Hessian's diagonal (the input features
    with the most energy first, GPTQ's "act-order"), with *static groups*: every group's grid is fixed up
    front from the unrounded weight in the stored order, so each row still belongs to the ``MatMulNBits``
    block of 32 it is stored in (ONNX Runtime's own ``actorder`` forms groups in the permuted order, which
    no block-wise format can store)."""
    if mse or not perchannel:
        raise NotImplementedError("the patched GPTQ covers perchannel=True, mse=False")
    maxq = 2 ** num_bits - 1
    W = W.astype(np.float64).copy()  # noqa: N806
    H = H.copy()  # noqa: N806

    def find_params(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # per output column, as ONNX Runtime's
        xmin = np.minimum(w.min(0), 0)
        xmax = np.maximum(w.max(0), 0)
        if scheme == "sym":
            xmax = np.maximum(-xmin, xmax)
            xmin = np.where(xmin < 0, -xmax, xmin)
        both0 = (xmin == 0) & (xmax == 0)
        xmin[both0], xmax[both0] = -1, 1
        scale = (xmax - xmin) / maxq
        zero = np.full_like(scale, (maxq + 1) / 2) if scheme == "sym" else np.round(-xmin / scale)
        return scale, zero

    k = W.shape[0]
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    W[dead, :] = 0
    perm = np.arange(k)
    static = []  # actorder: (scale, zero) of every stored-order group, from the unrounded weight
    if actorder:
        static = [find_params(W[g:g + group_size]) for g in range(0, k, group_size)]
        perm = np.argsort(np.diag(H), kind="stable")[::-1]
        W, H = W[perm], H[perm][:, perm]  # noqa: N806
    H[np.arange(k), np.arange(k)] += percdamp * np.mean(np.diag(H))
    Hinv = np.linalg.cholesky(np.linalg.inv(H)).T  # upper: Hinv ᵀHinv = H⁻¹  # noqa: N806
    Q = np.zeros_like(W)  # noqa: N806
    scales, zeros = [], []
    scale, zero = find_params(W[:group_size])
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        W1 = W[i1:i2].copy()  # noqa: N806
        Err1 = np.zeros_like(W1)  # noqa: N806
        Hinv1 = Hinv[i1:i2, i1:i2]  # noqa: N806
        for i in range(i2 - i1):
            if actorder:
                scale, zero = static[perm[i1 + i] // group_size]
            elif (i1 + i) % group_size == 0:
                scale, zero = find_params(W[i1 + i:i1 + i + group_size])
                scales.append(scale)
                zeros.append(zero)
            w = W1[i]
            q = scale * (np.clip(np.round(w / scale) + zero, 0, maxq) - zero)
            Q[i1 + i] = q
            err = (w - q) / Hinv1[i, i]
            W1[i:] -= np.outer(Hinv1[i, i:], err)  # the row of the upper factor (ONNX Runtime: its column)
            Err1[i] = err
        W[i2:] -= Hinv[i1:i2, i2:].T @ Err1  # (ONNX Runtime: Hinv[i2:, i1:i2], the zero lower block)
    if actorder:
        scales, zeros = [g[0] for g in static], [g[1] for g in static]
        Q = Q[np.argsort(perm)]  # noqa: N806 (back to the stored order)
    _GRIDS.append((np.stack(scales), np.stack(zeros)))  # [groups, out]
    return Q


def encode_exact(data: np.ndarray, num_bits: int = 4, group_size: int = 32, scheme: str = "asym",
                 dtype: str = "int", ratio: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``quant_tensor``'s place after GPTQ: the codes of GPTQ's own grid (bug 3: no second rounding).
    ``data`` is the fake-quantized ``Qᵀ`` (``[out, in]``, padded to whole groups), as ``gptq_quantize`` passes it."""
    scale, zero = _GRIDS.pop(0)  # [groups, out]; data rows run (out, group)
    rows = data.reshape(-1, group_size)
    groups = rows.shape[0] // scale.shape[1]
    pad = groups - scale.shape[0]  # a padded last group (in % group_size != 0) is all zeros
    if pad:
        scale = np.concatenate([scale, np.ones((pad, scale.shape[1]))])
        zero = np.concatenate([zero, np.full((pad, zero.shape[1]), zero[-1])])
    s = scale.T.reshape(-1, 1)
    z = zero.T.reshape(-1, 1)
    q = np.clip(np.round(rows / s) + z, 0, 2 ** num_bits - 1)
    return q, s, z.astype("uint8")


def gptq_quantize_one_pass(model: Any, dataloader: Any, weight_config: dict | None = None, num_bits: int = 4,
                           group_size: int = 32, scheme: str = "asym", n_samples: int = 128, percdamp: float = 0.01,
                           blocksize: int = 128, actorder: bool = False, mse: bool = False, perchannel: bool = True,
                           accuracy_level: int = 0, providers: list[str] | None = None) -> Any:
    """ONNX Runtime 1.32's ``gptq_quantize`` with its two loops swapped, nothing else changed: it ran the whole
    calibration set through the model once *per* ``MatMul`` *input*, the activation-by-activation ones included
    (66 passes of every clip for Whisper tiny.en, most of GPTQ's time); here every weight ``MatMul``'s input
    is fetched in one pass per calibration batch
    and each Hessian gets the same updates in the same order (so the same ``H`` to the bit). Every other
    step (the weight config, ``gptq``, the padding, the 4-bit encoding and the ``MatMulNBits`` node) is
    ONNX Runtime's own, looked up in its module at call time, so :func:`patched`'s fixes apply."""
    import onnxruntime as ort
    import onnxruntime.quantization.neural_compressor.weight_only as wo
    from onnx import numpy_helper

    weight_config = weight_config or {}
    model = wo.ONNXModel(model)
    base_dir = str(Path(model.model_path).parent) if model.model_path is not None else ""
    inputs, so = wo.prepare_inputs(model, n_samples, dataloader, providers or ["CPUExecutionProvider"])
    del dataloader
    org_output = copy.deepcopy(model.model.graph.output)
    model.remove_tensors_from_outputs([i.name for i in org_output])

    def quantized(node: Any) -> bool:  # ONNX Runtime's test, and a 2-D weight initializer behind it
        return (node.op_type == "MatMul" and weight_config.get(node.name, {}) != "fp32"
                and weight_config.get(node.name, {}).get("algorithm", "GPTQ") == "GPTQ"
                and model.get_initializer(node.input[1]) is not None
                and len(model.get_initializer(node.input[1]).dims) == 2)

    targets: dict[str, list[tuple[Any, np.ndarray]]] = {}  # input name -> [(node, weight)], graph order
    for node in model.nodes():
        if quantized(node):
            weight = numpy_helper.to_array(model.get_initializer(node.input[1]), base_dir).copy()
            targets.setdefault(node.input[0], []).append((node, weight))
    output_names = list(targets)
    # the graph's outputs as ONNX Runtime sets them (every MatMul's input, weights or not), so that the graph
    # optimiser fuses what it fused there and the activations are the same to the bit; only ours are fetched
    added = list({n.input[0] for n in model.nodes() if n.op_type == "MatMul" and weight_config.get(n.name, {}) != "fp32"
                  and weight_config.get(n.name, {}).get("algorithm", "GPTQ") == "GPTQ"})
    model.add_tensors_to_outputs(added)
    if model.is_large_model:
        raise NotImplementedError("gptq_quantize_one_pass: models over 2 GB (external data) not covered")
    session = ort.InferenceSession(model.model.SerializeToString(), so, providers=providers or
                                   ["CPUExecutionProvider"])
    hs = {name: [np.zeros((w.shape[0], w.shape[0])) for _, w in pairs] for name, pairs in targets.items()}
    nsamples = dict.fromkeys(output_names, 0)  # per input, as ONNX Runtime counts (its first axis)
    for data in inputs:  # one pass per batch: every input's Hessian updated as ONNX Runtime's loop does
        for name, inp in zip(output_names, session.run(output_names, data), strict=True):
            tmp = inp.shape[0]
            inp = np.reshape(inp, (-1, inp.shape[-1]))
            hs[name] = [h * (nsamples[name] / (nsamples[name] + tmp)) for h in hs[name]]
            nsamples[name] += tmp
            inp = np.sqrt(2 / nsamples[name]) * inp
            hs[name] = [h + np.matmul(inp.T, inp) for h in hs[name]]
    for idx, name in enumerate(output_names):
        wo.simple_progress_bar(len(output_names), idx + 1)
        for (node, weight), H in zip(targets[name], hs.pop(name), strict=True):  # noqa: N806
            bits, size, sch = num_bits, group_size, scheme
            if node.name in weight_config:
                bits, size = weight_config[node.name]["bits"], weight_config[node.name]["group_size"]
                sch = weight_config[node.name]["scheme"]
            size = size if size != -1 else weight.shape[0]
            q_weight = wo.gptq(weight, H, num_bits=bits, group_size=size, scheme=sch, blocksize=blocksize,
                               percdamp=percdamp, actorder=actorder, mse=mse, perchannel=perchannel)
            weight_tensor = model.get_initializer(node.input[1])
            shared = model.get_initializer_share_num(node.input[1])
            if bits != 4:
                raise NotImplementedError("gptq_quantize_one_pass: 4-bit MatMulNBits only")
            k_blocks = (weight.shape[0] + size - 1) // size
            q_weight = wo.pad_tensor(q_weight, size, k_blocks)
            q_weight, scale, zp = wo.quant_tensor(q_weight.T, bits, size, sch, "uint")
            q_node, new_inits = wo.make_matmul_weight_only_node(
                node=node, weight_shape=weight.shape, num_bits=bits, group_size=size, k_blocks=k_blocks,
                q_weight=q_weight.astype("uint8"), scale=scale.astype(weight.dtype),
                zero_point=zp if sch == "asym" else None, accuracy_level=accuracy_level)
            model.add_initializers(new_inits)
            model.remove_node(node)
            model.add_node(q_node)
            if shared == 1:
                model.remove_initializer(weight_tensor)
    model.remove_tensors_from_outputs(added)
    model.model.graph.output.MergeFrom(org_output)
    model.topological_sort()
    return model


@contextlib.contextmanager
def patched(one_pass: bool = True) -> Iterator[None]:
    """ONNX Runtime's GPTQ with bugs 2 and 3 fixed, inside the ``with`` block only; with ``one_pass`` its
    calibration in one pass per batch (:func:`gptq_quantize_one_pass`: the same Hessians, a fraction of the
    time), else ONNX Runtime's own loop."""
    import onnxruntime.quantization.matmul_nbits_quantizer as mq
    import onnxruntime.quantization.neural_compressor.weight_only as wo

    saved = wo.gptq, wo.quant_tensor, mq.gptq_quantize
    wo.gptq, wo.quant_tensor = gptq_fixed, encode_exact
    if one_pass:
        mq.gptq_quantize = gptq_quantize_one_pass
    _GRIDS.clear()
    try:
        yield
    finally:
        wo.gptq, wo.quant_tensor, mq.gptq_quantize = saved
        _GRIDS.clear()


def repro(seed: int = 0) -> dict[str, float]:
    """The bugs on one layer: ``W`` [256, 64], inputs with correlated features, layer loss ``‖X (W − Q)‖²``
    relative to ``‖X W‖²`` for round-to-nearest on GPTQ's grid, ONNX Runtime's ``gptq`` and :func:`gptq_fixed`.
    GPTQ's whole point is a lower loss than round-to-nearest on the same grid; ONNX Runtime's equals it."""
    import onnxruntime.quantization.neural_compressor.weight_only as wo

    rng = np.random.default_rng(seed)
    k, n, tokens = 256, 64, 4096
    X = rng.standard_normal((tokens, k)) @ (np.eye(k) + 0.3 * rng.standard_normal((k, k)) / np.sqrt(k))  # noqa: N806
    X[:, :4] *= 10  # a few large input features, as activations have
    W = rng.standard_normal((k, n)).astype(np.float32)  # noqa: N806
    H = 2 * X.T @ X / tokens  # noqa: N806

    def loss(Q: np.ndarray) -> float:  # noqa: N803
        return float(np.sum((X @ (W - Q)) ** 2) / np.sum((X @ W) ** 2))

    def rtn() -> np.ndarray:  # the same grid, no feedback
        out = np.zeros_like(W, dtype=np.float64)
        for g in range(0, k, 32):
            m = np.abs(W[g:g + 32]).max(0)
            s = 2 * m / 15
            out[g:g + 32] = s * (np.clip(np.round(W[g:g + 32] / s) + 8, 0, 15) - 8)
        return out

    kw = {"num_bits": 4, "group_size": 32, "scheme": "sym", "blocksize": 128, "perchannel": True}
    out = {"rtn (GPTQ's grid)": loss(rtn()), "onnxruntime gptq": loss(wo.gptq(W.copy(), H.copy(), **kw)),
           "gptq, feedback fixed": loss(gptq_fixed(W.copy(), H.copy(), **kw))}
    _GRIDS.clear()
    return out


def encoder_main(args: argparse.Namespace) -> dict[str, Any]:
    """A sentence encoder (``bench_quant_encoders``' model, texts, export and metric), original vs converted,
    in each of ``MODES``: 1 − cosine of the pooled embedding against the float32 original, ratio with a 95%
    paired bootstrap interval over texts."""
    import bench_quant_encoders as enc
    import torch
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    original = AutoModel.from_pretrained(args.model).float().eval()
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in tok.model_input_names]
    texts = enc.english(args.texts + enc.CALIBRATION_TEXTS)
    data = enc.batches(tok, texts[:args.texts], args.max_len, names)
    calib = enc.batches(tok, texts[args.texts:args.texts + args.calib], args.max_len, names, size=8)
    feeds = [{k: v.numpy() for k, v in b.items()} for b in calib]
    ref = enc.embed_torch(original, data)
    result: dict[str, Any] = {"model": str(args.model), "texts": args.texts, "calib": args.calib, "cells": {},
                              "per_text": {}}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            model, _ = enc.build(name, original, args.model)
            fp32 = Path(tmp) / f"{name}.onnx"
            enc.export(model, data[0], fp32)
            for how in args.modes:
                got = enc.embed_onnx(quantize(fp32, Path(tmp) / f"{name}.{how}.onnx", how, feeds), data)
                err = (1 - (ref * got).sum(-1)).clamp(min=0).numpy()
                result["per_text"][f"{name}/{how}"] = err.tolist()
                result["cells"][f"{name}/{how}"] = {"err": float(err.mean())}
                print(f"{name:10s} {how:19s} 1-cos {err.mean():.4e}  [{time.time() - t0:.0f} s]", flush=True)
    for key, cell in result["cells"].items():
        name, how = key.split("/")
        if name != "original" and f"original/{how}" in result["per_text"]:
            err, base = np.array(result["per_text"][key]), np.array(result["per_text"][f"original/{how}"])
            cell["ratio"], cell["ci95"] = float(err.mean() / base.mean()), enc.bootstrap(err, base)
    print("| variant | " + " | ".join(args.modes) + " |\n|---|" + "---|" * len(args.modes))
    for name in args.variants:
        cells = []
        for how in args.modes:
            c = result["cells"][f"{name}/{how}"]
            ci = f" ({c['ratio']:.2f}×, {c['ci95'][0]:.2f}-{c['ci95'][1]:.2f})" if "ratio" in c else ""
            cells.append(f"{c['err']:.3e}{ci}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repro", action="store_true", help="the bug on one random layer (seconds, no model)")
    ap.add_argument("--model", type=Path, help="a sentence-transformers directory (transformers format)")
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--calib", type=int, default=32, help="calibration paragraphs (held out), batches of 8")
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--variants", nargs="+", default=["original", "converted"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.repro:
        for seed in range(3):
            print(f"seed {seed}: " + ", ".join(f"{k} {v:.4e}" for k, v in repro(seed).items()))
    if args.model:
        encoder_main(args)


if __name__ == "__main__":
    main()
