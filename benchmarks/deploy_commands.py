"""Every deployment command of docs/deployment.md, docs/rotation.md and the README, run as written on tiny local
models (GPT-2, DINOv2, BERT and Whisper shapes, LayerNorm γ/β and LayerScale randomised, saved with
``save_pretrained`` and converted with ``normswap convert``): does it run, does the artefact load in its engine, and
does it give the original's outputs (float) or an error of the original's size (quantized, one draw on a random tiny
model: a sanity check, not a quantization figure).

    python benchmarks/deploy_commands.py --work /tmp/deploy --pkgs /tmp/pkgs/ct2:/tmp/pkgs/ov:/tmp/pkgs/torchao \\
        --out docs/results/deploy_commands55.json

``--pkgs``: directories (``pip install --target DIR``) holding the engines normswap does not install (ctranslate2,
openvino + nncf, torchao); a step whose engine is missing is recorded as skipped. Each step is one JSON entry:
the command, ``ok``, its figures, or the error's last line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
# deployment.md's Whisper wrapper (an explicit decoder mask: the TorchScript exporter has no aten::diff)
from bench_quant_whisper import TeacherForced  # noqa: E402

STEPS: list[tuple[str, Callable[[Path], dict[str, Any]]]] = []


def step(command: str) -> Callable[[Callable[[Path], dict[str, Any]]], Callable[[Path], dict[str, Any]]]:
    def register(fn: Callable[[Path], dict[str, Any]]) -> Callable[[Path], dict[str, Any]]:
        STEPS.append((command, fn))
        return fn

    return register


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def one_minus_cos(y: np.ndarray, ref: np.ndarray) -> float:
    a, b = y.reshape(-1, y.shape[-1]), ref.reshape(-1, ref.shape[-1])
    return float(np.mean(1 - (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)))


def sh(args: list[str], cwd: Path) -> None:
    """A command line as the docs write it; raises with its last stderr line when it fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path[1:]])}
    p = subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env)
    if p.returncode:
        raise RuntimeError(f"{' '.join(args[:4])} ... exit {p.returncode}: "
                           f"{(p.stderr.strip().splitlines() or [''])[-1][:300]}")


def ort_run(path: str | Path, feed: dict[str, np.ndarray], output: str | None = None) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run([output] if output else None, {k: v for k, v in feed.items() if k in names})[0]


class Body(torch.nn.Module):
    """deployment.md's exporter wrapper: tensors in, the last hidden state out."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


class Calibration:
    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds = list(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return self.feeds.pop(0) if self.feeds else None

    def __iter__(self):
        return iter(list(self.feeds))


# ------------------------------------------------------------------------------------ models
def build(work: Path) -> None:
    import transformers

    from normswap import presets

    torch.manual_seed(0)

    def randomised(m: torch.nn.Module) -> torch.nn.Module:
        with torch.no_grad():
            for mod in m.modules():
                if isinstance(mod, torch.nn.LayerNorm):
                    mod.weight.uniform_(0.5, 1.5)
                    mod.bias.normal_(0, 0.2)
                if type(mod).__name__.endswith("LayerScale"):
                    mod.lambda1.uniform_(0.01, 2.0)
        return m.eval()

    t = transformers
    randomised(t.GPT2LMHeadModel(t.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128))) \
        .save_pretrained(work / "gpt2")
    randomised(t.Dinov2Model(t.Dinov2Config(image_size=56, patch_size=14, hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=128))) \
        .save_pretrained(work / "dinov2")
    randomised(t.BertModel(t.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=128))) \
        .save_pretrained(work / "bert")
    presets.save("tiny-whisper", work / "whisper")  # a tokenizer too: CTranslate2's converter reads it


CONVERSIONS = [
    ["gpt2", "--out", "gpt2-rms"],
    ["gpt2", "--out", "gpt2-compat", "--format", "compat"],
    ["gpt2", "--out", "gpt2-rot-compat", "--rotate", "hadamard", "--format", "compat"],
    ["dinov2", "--out", "dinov2-compat", "--format", "compat"],
    ["dinov2", "--out", "dinov2-native"],
    ["dinov2", "--out", "dinov2-online", "--rotate", "none", "--online-hadamard"],
    ["whisper", "--out", "whisper-compat", "--format", "compat"],
    ["whisper", "--out", "whisper-native"],
    ["bert", "--out", "minilm-int8", "--per-norm-centering", "--no-mean-carry"],
]


@step("normswap convert MODEL --out DIR [options] (the conversions the steps below start from)")
def conversions(work: Path) -> dict[str, Any]:
    for args in CONVERSIONS:
        sh([sys.executable, "-m", "normswap", "convert", *args, "-q"], work)
    return {"converted": [" ".join(a) for a in CONVERSIONS]}


def gpt2_reference(work: Path) -> tuple[Any, dict[str, np.ndarray], np.ndarray]:
    import transformers

    orig = transformers.AutoModel.from_pretrained(work / "gpt2").eval()
    ids = torch.randint(0, 1000, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = Body(orig)(ids, torch.ones_like(ids)).numpy()
    return orig, {"input_ids": ids.numpy(), "attention_mask": np.ones_like(ids.numpy())}, ref


# ------------------------------------------------------------------------------------ ONNX Runtime
def _fused(path: Path) -> dict[str, int]:
    from normswap.integrations.onnx import fused_norm_ops

    return {k: v for k, v in fused_norm_ops(str(path)).items() if v}


@step("deployment.md Export: AutoModel.from_pretrained('gpt2-rms') after import normswap; torch.onnx.export("
      "Body(model), dynamo=True, dynamic_shapes) / opset_version=23 / dynamo=False; fused_norm_ops")
def onnx_export(work: Path) -> dict[str, Any]:
    import transformers

    import normswap

    orig, feed, ref = gpt2_reference(work)
    model = transformers.AutoModel.from_pretrained(work / "gpt2-rms").eval()
    norms = sum(isinstance(m, normswap.RMSNorm) for m in model.modules())
    ids = torch.randint(0, 1000, (2, 16))
    batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=1024)
    out: dict[str, Any] = {"class": type(model).__name__, "rms_norms": norms}
    for name, kw in (("gpt2-rms.onnx", {}), ("gpt2-rms-23.onnx", {"opset_version": 23})):
        torch.onnx.export(Body(model).eval(), (ids, torch.ones_like(ids)), str(work / name), dynamo=True,
                          dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}), **kw)
        out[name] = {"rel_err_vs_original": rel(ort_run(work / name, feed), ref), "ops": _fused(work / name)}
    torch.onnx.export(Body(model).eval(), (ids, torch.ones_like(ids)), str(work / "gpt2-rms-legacy.onnx"),
                      dynamo=False, input_names=["input_ids", "attention_mask"],
                      dynamic_axes={"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"}})
    out["gpt2-rms-legacy.onnx"] = {"rel_err_vs_original": rel(ort_run(work / "gpt2-rms-legacy.onnx", feed), ref),
                                   "ops": _fused(work / "gpt2-rms-legacy.onnx")}
    torch.onnx.export(Body(orig).eval(), (ids, torch.ones_like(ids)), str(work / "gpt2-orig.onnx"), dynamo=True,
                      dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
    return out


@step("python -m onnxruntime.transformers.optimizer --input gpt2-rms.onnx --output gpt2-rms-opt.onnx "
      "--model_type bert; fuse_norms(...) on the export and on the optimizer's output; --model_type gpt2")
def ort_optimizer(work: Path) -> dict[str, Any]:
    from normswap.integrations.onnx import fuse_norms

    _, feed, ref = gpt2_reference(work)
    cmd = [sys.executable, "-m", "onnxruntime.transformers.optimizer", "--input", "gpt2-rms.onnx", "--output",
           "gpt2-rms-opt.onnx", "--model_type"]
    sh(cmd + ["bert"], work)
    fuse_norms(str(work / "gpt2-rms.onnx"), str(work / "gpt2-rms-fused.onnx"))
    fuse_norms(str(work / "gpt2-rms-opt.onnx"), str(work / "gpt2-rms-opt-fused.onnx"))
    out = {name: {"rel_err_vs_original": rel(ort_run(work / name, feed), ref), "ops": _fused(work / name)}
           for name in ("gpt2-rms-opt.onnx", "gpt2-rms-fused.onnx", "gpt2-rms-opt-fused.onnx")}
    try:
        sh(cmd[:-1] + ["--output", "gpt2-rms-opt2.onnx", "--model_type", "gpt2"], work)
        out["model_type gpt2"] = "runs"
    except RuntimeError as exc:  # the docs: fails on a dynamic-shape GPT-2 export, original or converted
        out["model_type gpt2"] = str(exc).rsplit(": ", 1)[-1]
    return out


@step("deployment.md Writing the quantized artefacts: python -m normswap convert dinov2 --out dinov2-compat "
      "--format compat; the heredoc's torch.onnx.export(opset 17, dynamo=False); quantize_dynamic; "
      "python -m onnxruntime.quantization.matmul_nbits_quantizer ... --block_size 32 --symmetric True "
      "[--quant_method hqq]; the original through the same commands")
def ort_quantizers(work: Path) -> dict[str, Any]:
    import transformers
    from onnxruntime.quantization import QuantType, quantize_dynamic

    x = torch.randn(16, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    out: dict[str, Any] = {}
    outputs: dict[str, np.ndarray] = {}
    for tag, d in (("original", "dinov2"), ("compat", "dinov2-compat")):
        model = transformers.AutoModel.from_pretrained(work / d).eval()
        f = work / f"dinov2-{tag}.onnx"
        torch.onnx.export(model, (torch.randn(1, 3, 224, 224),), str(f), input_names=["pixel_values"],
                          output_names=["last_hidden_state", "pooler_output"],
                          dynamic_axes={"pixel_values": {0: "batch"}}, opset_version=17, dynamo=False)
        if tag == "original":
            with torch.no_grad():
                ref = model(pixel_values=x).last_hidden_state.numpy()
        quantize_dynamic(str(f), str(f.with_suffix(".int8.onnx")), weight_type=QuantType.QInt8, per_channel=False)
        for suffix, extra in ((".q4.onnx", []), (".hqq.onnx", ["--quant_method", "hqq"])):
            sh([sys.executable, "-m", "onnxruntime.quantization.matmul_nbits_quantizer", "--input_model", f.name,
                "--output_model", f.with_suffix(suffix).name, "--block_size", "32", "--symmetric", "True", *extra],
               work)
        feed = {"pixel_values": x.numpy()}
        outputs[tag] = ort_run(f, feed, "last_hidden_state")
        for q in ("int8", "q4", "hqq"):
            outputs[f"{tag} {q}"] = ort_run(f.with_suffix(f".{q}.onnx"), feed, "last_hidden_state")
    out["compat float rel_err_vs_original"] = rel(outputs["compat"], ref)
    out["compat ops"] = _fused(work / "dinov2-compat.onnx")
    for q in ("int8", "q4", "hqq"):
        e, eo = one_minus_cos(outputs[f"compat {q}"], ref), one_minus_cos(outputs[f"original {q}"], ref)
        out[f"{q} 1-cos (compat, original, ratio)"] = [e, eo, e / eo]
    return out


@step("ct2-transformers-converter --model whisper-compat --output_dir whisper-ct2-int8 --quantization int8 "
      "(and without --quantization; the original the same way); ctranslate2.models.Whisper(...).encode")
def ctranslate2_whisper(work: Path) -> dict[str, Any]:
    import shutil

    import ctranslate2
    import transformers

    exe = shutil.which("ct2-transformers-converter")
    if exe is None:
        raise RuntimeError("ct2-transformers-converter is not on PATH")
    out: dict[str, Any] = {}
    w = transformers.WhisperForConditionalGeneration.from_pretrained(work / "whisper").eval()
    feats = torch.randn(2, w.config.num_mel_bins, 2 * w.config.max_source_positions,
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        enc = w.model.encoder(feats).last_hidden_state.numpy()
    for src in ("whisper", "whisper-compat"):
        for quant in ("int8", None):
            dst = f"{src}-ct2-{quant or 'float'}"
            sh([exe, "--model", src, "--output_dir", dst, *(["--quantization", quant] if quant else []), "--force"],
               work)
            m = ctranslate2.models.Whisper(str(work / dst), device="cpu")
            got = np.array(m.encode(ctranslate2.StorageView.from_array(feats.numpy()), to_cpu=True))
            out[dst] = {"encoder rel_err_vs_original": rel(got, enc), "encoder 1-cos": one_minus_cos(got, enc)}
    return out


@step("deployment.md native block: AutoModelForSpeechSeq2Seq.from_pretrained('whisper-native', dtype=float32, "
      "attn_implementation='eager') after import normswap; the TeacherForced export; MatMulNBitsQuantizer(GPTQ, "
      "perchannel=True); the static QDQ recipe (nodes_to_exclude: activation MatMuls and /fc2/); torchao "
      "Int8DynamicActivationInt8WeightConfig")
def whisper_native(work: Path) -> dict[str, Any]:
    import onnx
    import transformers
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization import matmul_nbits_quantizer as mq

    import normswap  # noqa: F401 - registers normswap_whisper

    g = torch.Generator().manual_seed(4)
    results: dict[str, Any] = {}
    for tag, d in (("original", "whisper"), ("native", "whisper-native"), ("compat", "whisper-compat")):
        model = transformers.AutoModelForSpeechSeq2Seq.from_pretrained(
            work / d, dtype=torch.float32, attn_implementation="eager").eval()
        mels = model.config.num_mel_bins, 2 * model.config.max_source_positions
        if tag == "original":
            feats, dec = torch.randn(4, *mels, generator=g), torch.randint(0, 50, (4, 6), generator=g)
            calib = [{"input_features": torch.randn(1, *mels, generator=g).numpy(),
                      "decoder_input_ids": torch.randint(0, 50, (1, 6), generator=g).numpy()} for _ in range(4)]
        f = work / f"whisper-{tag}.onnx"
        torch.onnx.export(TeacherForced(model), (torch.randn(1, *mels), torch.ones(1, 4, dtype=torch.long)), str(f),
                          input_names=["input_features", "decoder_input_ids"], output_names=["logits"],
                          dynamo=False, opset_version=17, dynamic_axes={"input_features": {0: "batch"},
                                                                        "decoder_input_ids": {0: "batch", 1: "tokens"}})
        with torch.no_grad():
            logits = TeacherForced(model)(feats, dec)
        if tag == "original":
            ref = logits

        def kl(y: np.ndarray, ref: torch.Tensor = ref) -> float:
            p, q = torch.log_softmax(ref, -1), torch.log_softmax(torch.from_numpy(np.asarray(y)), -1)
            return float((p.exp() * (p - q)).sum(-1).mean())

        feed = {"input_features": feats.numpy(), "decoder_input_ids": dec.numpy()}
        r: dict[str, Any] = {"float rel_err_vs_original": rel(ort_run(f, feed), ref.numpy()), "ops": _fused(f)}
        q = mq.MatMulNBitsQuantizer(str(f), block_size=32, is_symmetric=True,
                                    algo_config=mq.GPTQWeightOnlyQuantConfig(Calibration(calib), perchannel=True))
        q.process()
        q.model.save_model_to_file(str(f.with_suffix(".gptq.onnx")), use_external_data_format=False)
        r["gptq kl"] = kl(ort_run(f.with_suffix(".gptq.onnx"), feed))
        graph = onnx.load(str(f), load_external_data=False).graph
        weights = {t.name for t in graph.initializer}
        in_float = [n.name for n in graph.node if n.op_type == "MatMul"
                    and (not weights.intersection(n.input) or "/fc2/" in n.name)]
        r["fc2 nodes matched"] = sum("/fc2/" in n for n in in_float)
        quantize_static(str(f), str(f.with_suffix(".qdq.onnx")), Calibration(calib), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=["MatMul"], nodes_to_exclude=in_float, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
        r["qdq kl"] = kl(ort_run(f.with_suffix(".qdq.onnx"), feed))
        try:
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

            quantize_(model, Int8DynamicActivationInt8WeightConfig())
            with torch.no_grad():
                r["torchao kl"] = kl(TeacherForced(model)(feats, dec).numpy())
        except ImportError as exc:
            r["torchao"] = f"skipped: {exc}"
        results[tag] = r
    for tag in ("native", "compat"):
        results[f"{tag} / original"] = {k: results[tag][k] / results["original"][k]
                                        for k in ("gptq kl", "qdq kl", "torchao kl") if k in results[tag]}
    return results


@step("deployment.md Static QDQ of a native checkpoint: normswap.integrations.onnx.quantize_static(vit-native.onnx, "
      "..., calibration_reader); stem_float_nodes")
def native_qdq(work: Path) -> dict[str, Any]:
    import transformers

    from normswap.integrations.onnx import quantize_static, stem_float_nodes

    x = torch.randn(8, 3, 56, 56, generator=torch.Generator().manual_seed(5))
    out: dict[str, Any] = {}
    for tag, d in (("original", "dinov2"), ("native", "dinov2-native")):
        m = transformers.AutoModel.from_pretrained(work / d).eval()
        f = work / f"vit-{tag}.onnx"
        torch.onnx.export(m, (torch.randn(1, 3, 56, 56),), str(f), input_names=["pixel_values"],
                          output_names=["last_hidden_state", "pooler_output"],
                          dynamic_axes={"pixel_values": {0: "batch"}}, opset_version=17, dynamo=False)
        with torch.no_grad():
            if tag == "original":
                ref = m(pixel_values=x).last_hidden_state.numpy()
        calib = Calibration([{"pixel_values": torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(i))
                              .numpy()} for i in range(8)])
        added = quantize_static(str(f), str(f.with_suffix(".qdq.onnx")), calib)
        out[tag] = {"float rel_err_vs_original": rel(ort_run(f, {"pixel_values": x.numpy()}, "last_hidden_state"),
                                                     ref),
                    "added to nodes_to_exclude": added, "stem_float_nodes": stem_float_nodes(str(f)),
                    "qdq 1-cos": one_minus_cos(ort_run(f.with_suffix(".qdq.onnx"), {"pixel_values": x.numpy()},
                                                       "last_hidden_state"), ref)}
    out["native / original qdq"] = out["native"]["qdq 1-cos"] / out["original"]["qdq 1-cos"]
    return out


@step("deployment.md Post-LN: normswap convert bert --out minilm-int8 --per-norm-centering --no-mean-carry; "
      "its ONNX export in ORT (op + RMSNorm fused into LayerNormalization) and OpenVINO (MVN)")
def post_ln(work: Path) -> dict[str, Any]:
    import transformers

    import normswap

    orig = transformers.AutoModel.from_pretrained(work / "bert").eval()
    conv = transformers.AutoModel.from_pretrained(work / "minilm-int8").eval()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = Body(orig)(ids, mask).numpy()
    f = work / "minilm-int8.onnx"
    torch.onnx.export(Body(conv), (ids, mask), str(f), input_names=["input_ids", "attention_mask"], dynamo=False,
                      opset_version=17,
                      dynamic_axes={"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"}})
    out: dict[str, Any] = {"rms_norms": sum(isinstance(m, normswap.RMSNorm) for m in conv.modules()),
                           "rel_err_vs_original": rel(ort_run(f, {"input_ids": ids.numpy(),
                                                                  "attention_mask": mask.numpy()}), ref),
                           "ORT ops": _fused(f)}
    try:
        import openvino as ov

        c = ov.Core().compile_model(ov.convert_model(str(f)), "CPU")
        layers = collections.Counter(op.get_rt_info()["layerType"].astype(str)
                                     for op in c.get_runtime_model().get_ops())
        out["OpenVINO"] = {k: layers[k] for k in ("RMS", "MVN")}
    except ImportError as exc:
        out["OpenVINO"] = f"skipped: {exc}"
    return out


@step("deployment.md OpenVINO: ov.convert_model('gpt2-rms.onnx') / convert_model(Body(model), example_input=...); "
      "save_model; compile_model; layerType counts; NNCF compress_weights int8, INT4_ASYM g128 + ADJUST, "
      "nncf.quantize(TRANSFORMER)")
def openvino_nncf(work: Path) -> dict[str, Any]:
    import nncf
    import openvino as ov
    import transformers

    _, feed, ref = gpt2_reference(work)
    f32 = {"INFERENCE_PRECISION_HINT": "f32"}

    def layer_counts(compiled: Any) -> dict[str, int]:
        c = collections.Counter(op.get_rt_info()["layerType"].astype(str)
                                for op in compiled.get_runtime_model().get_ops())
        return {k: c[k] for k in ("RMS", "MVN")}

    ov_model = ov.convert_model(str(work / "gpt2-rms.onnx"))
    ov.save_model(ov_model, str(work / "gpt2-rms.xml"))
    compiled = ov.Core().compile_model(ov_model, "CPU", config=f32)
    out: dict[str, Any] = {"from onnx": {"layers": layer_counts(compiled),
                                         "rel_err_vs_original": rel(compiled(feed)[0], ref)}}
    model = transformers.AutoModel.from_pretrained(work / "gpt2-rms").eval()
    ids = torch.randint(0, 1000, (2, 16))
    pt = ov.Core().compile_model(ov.convert_model(Body(model), example_input=(ids, torch.ones_like(ids))), "CPU",
                                 config=f32)
    out["from PyTorch"] = {"layers": layer_counts(pt), "rel_err_vs_original": rel(
        pt((feed["input_ids"], feed["attention_mask"]))[0], ref)}
    g = torch.Generator().manual_seed(7)
    feeds = [{"input_ids": torch.randint(0, 1000, (1, 16), generator=g).numpy(),
              "attention_mask": np.ones((1, 16), dtype=np.int64)} for _ in range(20)]
    for tag, m in (("converted", ov_model), ("original", ov.convert_model(str(work / "gpt2-orig.onnx")))):
        int8 = nncf.compress_weights(m)
        int4 = nncf.compress_weights(m, mode=nncf.CompressWeightsMode.INT4_ASYM, group_size=128,
                                     advanced_parameters=nncf.AdvancedCompressionParameters(
                                         group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST))
        static = nncf.quantize(m, nncf.Dataset(feeds), model_type=nncf.ModelType.TRANSFORMER)
        ov.save_model(int4, str(work / f"model-int4-{tag}.xml"), compress_to_fp16=False)
        out[tag] = {k: one_minus_cos(ov.Core().compile_model(q, "CPU", config=f32)(feed)[0], ref)
                    for k, q in (("int8 weights", int8), ("int4", int4), ("static int8", static))}
    return out


@step("README / cli.md: a --format compat checkpoint (plain, and --rotate hadamard) loaded by stock transformers "
      "in a fresh process that never imports normswap")
def compat_stock(work: Path) -> dict[str, Any]:
    code = r"""
import json, sys, torch, transformers
assert "normswap" not in sys.modules
g = torch.Generator().manual_seed(8)
out = {}
text = lambda: {"input_ids": torch.randint(0, 1000, (2, 12), generator=g)}
for src, dst, auto, x, key in [
        ("gpt2", "gpt2-compat", "AutoModelForCausalLM", text(), "logits"),
        ("gpt2", "gpt2-rot-compat", "AutoModelForCausalLM", text(), "logits"),
        ("dinov2", "dinov2-compat", "AutoModel", {"pixel_values": torch.randn(2, 3, 56, 56, generator=g)},
         "last_hidden_state"),
        ("whisper", "whisper-compat", "AutoModelForSpeechSeq2Seq",
         {"input_features": torch.randn(2, 8, 32, generator=g),
          "decoder_input_ids": torch.randint(0, 50, (2, 5), generator=g)}, "logits")]:
    a = getattr(transformers, auto).from_pretrained(src).eval()
    b = getattr(transformers, auto).from_pretrained(dst).eval()
    with torch.no_grad():
        ya, yb = getattr(a(**x), key), getattr(b(**x), key)
    out[dst] = {"class": type(b).__name__, "rel_err_vs_original": float((ya - yb).abs().max() / ya.abs().max())}
out["normswap imported"] = "normswap" in sys.modules
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, env=env)
    if p.returncode:
        raise RuntimeError(p.stderr.strip().splitlines()[-1])
    return json.loads(p.stdout.strip().splitlines()[-1])


@step("deployment.md Speed: torch.compile of a loaded native checkpoint (CPU, the auto backend)")
def compiled(work: Path) -> dict[str, Any]:
    import transformers

    import normswap  # noqa: F401

    g = torch.Generator().manual_seed(9)
    out = {}
    for src, dst, auto, x, key in [
            ("gpt2", "gpt2-rms", transformers.AutoModelForCausalLM,
             {"input_ids": torch.randint(0, 1000, (2, 12), generator=g)}, "logits"),
            ("dinov2", "dinov2-native", transformers.AutoModel,
             {"pixel_values": torch.randn(2, 3, 56, 56, generator=g)}, "last_hidden_state")]:
        a, b = auto.from_pretrained(work / src).eval(), auto.from_pretrained(work / dst).eval()
        with torch.no_grad():
            ya, yc = getattr(a(**x), key), getattr(torch.compile(b)(**x), key)
        out[dst] = {"compiled rel_err_vs_original": float((ya - yc).abs().max() / ya.abs().max())}
    return out


@step("deployment.md Programs exported with a fused backend: NORMSWAP_BACKEND=cpu; torch.export.export; "
      "torch.onnx.export(program, custom_translation_table=translation_table(20))")
def fused_backend_program(work: Path) -> dict[str, Any]:
    import transformers

    import normswap
    from normswap.integrations.onnx import translation_table

    model = transformers.AutoModel.from_pretrained(work / "gpt2-rms").eval()
    for mod in model.modules():
        if isinstance(mod, normswap.RMSNorm):
            mod.backend = "cpu"

    class Ids(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=input_ids, use_cache=False).last_hidden_state

    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        want = Ids(model)(ids).numpy()
    prog = torch.export.export(Ids(model), (ids,))
    ops = sorted({str(n.target) for n in prog.graph.nodes if n.op == "call_function" and "normswap" in str(n.target)})
    torch.onnx.export(prog, (ids,), str(work / "gpt2-fused-backend.onnx"), dynamo=True,
                      custom_translation_table=translation_table(20))
    return {"custom ops in the program": ops, "rel_err_vs_eager": rel(
        ort_run(work / "gpt2-fused-backend.onnx", {"input_ids": ids.numpy()}), want)}


@step("deployment.md online Hadamards (dinov2-online: --rotate none --online-hadamard): quantize_dynamic("
      "nodes_to_exclude=float_nodes(onnx_file, model)); normswap quantize_static(nodes_to_exclude="
      "qdq_float_nodes(...)); torchao quantize_ on the loaded native model")
def online_ops(work: Path) -> dict[str, Any]:
    import transformers
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from normswap.integrations.onnx import quantize_static
    from normswap.rotation.onnx_nodes import float_nodes, qdq_float_nodes

    x = torch.randn(8, 3, 56, 56, generator=torch.Generator().manual_seed(11))
    out: dict[str, Any] = {}
    for tag, d in (("original", "dinov2"), ("online", "dinov2-online")):
        m = transformers.AutoModel.from_pretrained(work / d).eval()
        with torch.no_grad():
            y = m(pixel_values=x).last_hidden_state.numpy()
        if tag == "original":
            ref = y
        f = work / f"dino-{tag}.onnx"
        torch.onnx.export(m, (torch.randn(1, 3, 56, 56),), str(f), input_names=["pixel_values"],
                          output_names=["last_hidden_state", "pooler_output"],
                          dynamic_axes={"pixel_values": {0: "batch"}}, opset_version=17, dynamo=False)
        keep = float_nodes(str(f), m)
        quantize_dynamic(str(f), str(f.with_suffix(".int8.onnx")), weight_type=QuantType.QInt8, nodes_to_exclude=keep)
        calib = Calibration([{"pixel_values": torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(i))
                              .numpy()} for i in range(8)])
        quantize_static(str(f), str(f.with_suffix(".qdq.onnx")), calib, nodes_to_exclude=qdq_float_nodes(str(f), m))
        feed = {"pixel_values": x.numpy()}
        r = {"eager rel_err_vs_original": rel(y, ref), "float_nodes": len(keep),
             "onnx rel_err_vs_original": rel(ort_run(f, feed, "last_hidden_state"), ref),
             "dynamic int8 1-cos": one_minus_cos(ort_run(f.with_suffix(".int8.onnx"), feed, "last_hidden_state"), ref),
             "static qdq 1-cos": one_minus_cos(ort_run(f.with_suffix(".qdq.onnx"), feed, "last_hidden_state"), ref)}
        try:
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

            quantize_(m, Int8DynamicActivationInt8WeightConfig())
            with torch.no_grad():
                r["torchao W8A8 1-cos"] = one_minus_cos(m(pixel_values=x).last_hidden_state.numpy(), ref)
        except ImportError as exc:
            r["torchao"] = f"skipped: {exc}"
        out[tag] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="an empty working directory")
    ap.add_argument("--pkgs", default="", help="engine directories (pip --target), separated by ':'")
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--only", default="", help="comma-separated step function names (default: all)")
    args = ap.parse_args()
    for d in filter(None, args.pkgs.split(os.pathsep)):
        sys.path.insert(1, d)
        if (Path(d) / "bin").is_dir():
            os.environ["PATH"] = f"{Path(d) / 'bin'}{os.pathsep}{os.environ['PATH']}"
    args.work.mkdir(parents=True, exist_ok=True)
    if not (args.work / "gpt2").exists():
        build(args.work)
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "transformers", "onnxruntime", "onnx", "ctranslate2", "openvino", "nncf", "torchao"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    only = set(filter(None, args.only.split(",")))
    results: dict[str, Any] = {"versions": versions, "steps": []}
    for command, fn in STEPS:
        if only and fn.__name__ not in only:
            continue
        start = time.perf_counter()
        entry: dict[str, Any] = {"step": fn.__name__, "command": command}
        try:
            entry |= {"ok": True, "figures": fn(args.work)}
        except ImportError as exc:
            entry |= {"ok": None, "skipped": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # noqa: BLE001 - recorded, the next step runs
            entry |= {"ok": False, "error": f"{type(exc).__name__}: {str(exc).strip()[:400]}",
                      "where": traceback.format_exc().strip().splitlines()[-3:-1]}
        entry["seconds"] = round(time.perf_counter() - start, 1)
        results["steps"].append(entry)
        print(json.dumps({k: entry.get(k) for k in ("step", "ok", "seconds", "error", "skipped")}), flush=True)
        args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
