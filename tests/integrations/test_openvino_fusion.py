"""A converted model runs on OpenVINO's fused RMS kernel, one ``RMS`` layer per norm, through both of
OpenVINO's import routes (``openvino.convert_model`` of the PyTorch module, and of the ONNX file the
deployment docs export).

OpenVINO is not a normswap dependency (nor a CI one: a 60 MB wheel), so this file is skipped where it is
not installed; run it with ``pip install openvino`` (or a ``--target`` directory on ``PYTHONPATH``). It
guards the exported norm pattern from the other side: a change made for one engine's fusion (ONNX
Runtime's) must not lose OpenVINO's (``RMSFusion``, which matches ``x / Sqrt(ReduceMean(x²) + eps) · γ``).
Counts come from the compiled model's runtime graph (``compiled.get_runtime_model()``), i.e. what the
CPU plugin executes after its transformations.
"""

from __future__ import annotations

import collections
import logging
import warnings

import pytest
import torch

ov = pytest.importorskip("openvino", reason="OpenVINO is an optional engine: pip install openvino")

from tests.integrations.compat import (  # noqa: E402
    MODELS,
    Positional,
    agreement,
    rms_norm_count,
    tensor_inputs,
    tiny_converted,
)

TOL = 1e-5  # float32 (the CPU plugin's bf16 default is turned off), 2-layer replicas


def _compiled(ov_model):
    return ov.Core().compile_model(ov_model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1})


def _layers(compiled) -> collections.Counter:
    ops = compiled.get_runtime_model().get_ops()
    return collections.Counter(op.get_rt_info()["layerType"].astype(str) for op in ops)


@pytest.mark.parametrize("route", ["torch", "onnx"])
@pytest.mark.parametrize("name", MODELS)
def test_every_converted_norm_runs_on_openvinos_rms_kernel(name, route, tmp_path):
    model, inputs = tiny_converted(name)
    body = Positional(model, inputs).eval()
    example = tuple(tensor_inputs(inputs).values())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # the exporter's progress lines
        try:
            if route == "torch":
                ov_model = ov.convert_model(body, example_input=example)
            else:
                path = tmp_path / f"{name}.onnx"
                torch.onnx.export(body, example, str(path), dynamo=True)
                ov_model = ov.convert_model(str(path))
        finally:
            logging.disable(logging.NOTSET)
        ref = body(*example)
    compiled = _compiled(ov_model)
    layers = _layers(compiled)
    norms = rms_norm_count(model)
    assert norms > 0
    # the BERT replica's MLM-head norm has a centering op (x - mean(x)) just before it in the exported
    # graph (one Sub, one extra ReduceMean): through the ONNX route OpenVINO rightly fuses the pair into
    # its LayerNorm kernel (MVN); either way one fused layer per norm
    assert layers["RMS"] + layers["MVN"] == norms, (name, route, dict(layers))
    if name == "gpt2":  # Pre-LN, exact, no op before a norm: every norm on RMS
        assert layers["RMS"] == norms, (name, route, dict(layers))
    elif name == "vit":  # the stem op (stem_centering="op", the default since round 47) sits right before the first
        # norm: through the ONNX route OpenVINO fuses that pair into MVN (round 55), through the torch route it does not
        assert layers["RMS"] >= norms - 1 and layers["MVN"] <= 1, (name, route, dict(layers))
    got = torch.from_numpy(compiled([t.numpy() for t in example])[0])
    assert agreement(got, ref)["max_rel"] < TOL


def _tiny_dinov2(writer_centering: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A 2-layer DINOv2 replica (LayerScale writers, γ/β/λ and biases randomised) and its conversion."""
    import copy

    import transformers as tf

    import normswap

    torch.manual_seed(0)
    config = tf.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                             image_size=32, patch_size=8)
    original = tf.Dinov2Model(config).eval()
    with torch.no_grad():
        for name, p in original.named_parameters():
            if p.dim() == 1 and ("norm" in name or "lambda" in name or name.endswith("bias")):
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.5 * torch.randn(p.shape) if "lambda" not in name else torch.rand(p.shape) * 2)
    converted = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(converted, beta_placement="keep", writer_centering=writer_centering)
    return original, converted.eval()


@pytest.mark.parametrize("writer_centering", ["weights", "op", "auto"])
def test_writer_centering_ops_leave_every_norm_fused_and_cost_one_mean_each(writer_centering, tmp_path):
    """``--writer-centering op``/``auto`` add a mean subtraction after each writer (after its LayerScale). In
    OpenVINO's CPU plugin (ONNX route, as the NNCF benchmarks export) every converted norm still runs as one fused
    layer (``RMS``; the stem's op fuses with the first norm into ``MVN``), and each centering op runs as exactly
    one unfused ``Reduce`` (its ``Subtract`` merged into the elementwise chain): the cost round 55 timed."""
    original, converted = _tiny_dinov2(writer_centering)
    ops = sum(len(getattr(m, "_normswap_hooks", {})) for m in converted.modules())
    assert ops == (1 if writer_centering == "weights" else 5)  # the stem op, and one per writer (2 per layer)
    px = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    layers = {}
    for label, model in (("original", original), ("converted", converted)):
        path = tmp_path / f"{label}.onnx"
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (px,), str(path), input_names=["pixel_values"], dynamo=False, opset_version=17)
        compiled = _compiled(ov.convert_model(str(path)))
        layers[label] = _layers(compiled)
        got = torch.from_numpy(compiled([px.numpy()])[0])
        with torch.no_grad():
            ref = original(pixel_values=px).last_hidden_state
        assert agreement(got, ref)["max_rel"] < TOL, label
    norms = rms_norm_count(converted)
    assert norms == 5
    assert layers["original"]["MVN"] == norms and layers["original"]["RMS"] == 0
    assert layers["converted"]["RMS"] == norms - 1 and layers["converted"]["MVN"] == 1, dict(layers["converted"])
    assert layers["converted"]["Reduce"] - layers["original"]["Reduce"] == ops, dict(layers["converted"])
