"""docs/deployment.md's native-checkpoint block, run on a tiny Whisper: the native checkpoint ``convert`` writes,
loaded with ``AutoModelForSpeechSeq2Seq`` after ``import normswap``, exported through the documented wrapper with
the TorchScript exporter (one fused RMS kernel per norm, the original's outputs), then the static QDQ recipe whose
``nodes_to_exclude`` matches the exporter's node names (``/fc2/``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

import normswap  # noqa: E402
from normswap import presets  # noqa: E402
from normswap.integrations.onnx import fused_norm_ops  # noqa: E402


class TeacherForced(torch.nn.Module):
    """The wrapper the docs give: tensors in, logits out, an explicit decoder mask."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_features: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_features=input_features, decoder_input_ids=decoder_input_ids, use_cache=False,
                          decoder_attention_mask=torch.ones_like(decoder_input_ids)).logits


class Calibration:
    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self.feeds = list(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return self.feeds.pop(0) if self.feeds else None


def test_the_documented_whisper_export_and_static_qdq_recipe_run_on_a_native_checkpoint(tmp_path):
    normswap.convert("tiny-whisper", tmp_path / "whisper-native")
    model = transformers.AutoModelForSpeechSeq2Seq.from_pretrained(
        tmp_path / "whisper-native", dtype=torch.float32, attn_implementation="eager").eval()
    norms = sum(isinstance(m, normswap.RMSNorm) for m in model.modules())
    assert norms > 0
    mels = model.config.num_mel_bins, 2 * model.config.max_source_positions
    path = str(tmp_path / "whisper.onnx")
    torch.onnx.export(TeacherForced(model), (torch.randn(1, *mels), torch.ones(1, 4, dtype=torch.long)), path,
                      input_names=["input_features", "decoder_input_ids"], output_names=["logits"], dynamo=False,
                      opset_version=17, dynamic_axes={"input_features": {0: "batch"},
                                                      "decoder_input_ids": {0: "batch", 1: "tokens"}})
    ops = fused_norm_ops(path)
    assert ops["SimplifiedLayerNormalization"] == norms and ops["LayerNormalization"] == 0 and ops["Pow"] == 0, ops

    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(3, *mels, generator=gen)
    ids = torch.randint(0, model.config.vocab_size, (3, 5), generator=gen)
    original = presets.build_model("tiny-whisper")
    with torch.no_grad():
        want = TeacherForced(original)(feats, ids).numpy()
    feed = {"input_features": feats.numpy(), "decoder_input_ids": ids.numpy()}
    got = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feed)[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()

    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    graph = onnx.load(path, load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    in_float = [n.name for n in graph.node if n.op_type == "MatMul"
                and (not weights.intersection(n.input) or "/fc2/" in n.name)]
    layers = model.config.encoder_layers + model.config.decoder_layers
    assert sum("/fc2/" in name for name in in_float) == layers  # the exporter's names, as the recipe expects
    out = str(tmp_path / "whisper-qdq.onnx")
    calib = [{"input_features": torch.randn(1, *mels, generator=gen).numpy(),
              "decoder_input_ids": torch.randint(0, model.config.vocab_size, (1, 5), generator=gen).numpy()}
             for _ in range(2)]
    quantize_static(path, out, Calibration(calib), quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
                    nodes_to_exclude=in_float, per_channel=True, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8)
    q = onnx.load(out).graph
    dequantized = {o for n in q.node if n.op_type == "DequantizeLinear" for o in n.output}
    matmuls = {n.name: n for n in q.node if n.op_type == "MatMul"}
    assert all(not dequantized.intersection(matmuls[name].input) for name in in_float)  # left in float
    quantized = [n for n in matmuls.values() if n.name not in in_float]
    assert quantized and all(dequantized.intersection(n.input) for n in quantized)
    y = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, feed)[0]
    assert np.isfinite(y).all() and y.shape == want.shape
