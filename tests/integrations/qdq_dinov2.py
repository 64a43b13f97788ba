"""A tiny DINOv2 replica exported and quantized as the static-QDQ benchmarks do: shared by the tests of the
nodes ONNX Runtime's QDQ quantizer must leave in float (the stem op's: ``test_stem_float_nodes.py``; the online
Hadamards': ``test_qdq_float_nodes.py``)."""

from __future__ import annotations

import logging
import warnings

import torch
import transformers as tf

from tests import zoo


def tiny_dinov2() -> torch.nn.Module:
    """A 2-layer, 32-wide DINOv2 on 32-pixel images, LayerNorm γ/β randomised, float32, eval mode."""
    torch.manual_seed(0)
    model = tf.Dinov2Model(tf.Dinov2Config(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, mlp_ratio=2))
    return zoo.randomise(model, 0).float().eval()


def export(model: torch.nn.Module, path, dynamo: bool = False) -> None:
    """``model``'s last hidden state for ``pixel_values`` to ONNX at ``path``: the TorchScript export the
    quantization benchmarks use (opset 17, dynamic batch), or with ``dynamo`` the one the deployment guide names
    first."""
    class Body(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return self.model(pixel_values=pixel_values).last_hidden_state

    px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            if dynamo:
                torch.onnx.export(Body().eval(), (px,), str(path), dynamo=True, verbose=False)
            else:
                torch.onnx.export(Body().eval(), (px,), str(path), dynamo=False, opset_version=17,
                                  input_names=["pixel_values"], dynamic_axes={"pixel_values": {0: "batch"}})
        finally:
            logging.disable(logging.NOTSET)


def quantize_qdq(fp32, out, exclude: list[str]):
    """ONNX Runtime's own ``quantize_static`` (QDQ, uint8 activations, int8 weights, two calibration batches of
    random images) of ``fp32`` into ``out``, leaving ``exclude`` in float; the quantized graph."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(2)
            self.feeds = iter([{"pixel_values": torch.randn(4, 3, 32, 32, generator=g).numpy()} for _ in range(2)])

        def get_next(self):
            return next(self.feeds, None)

    logging.disable(logging.WARNING)
    try:
        quantize_static(str(fp32), str(out), Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8, nodes_to_exclude=exclude)
    finally:
        logging.disable(logging.NOTSET)
    return onnx.load(str(out)).graph
