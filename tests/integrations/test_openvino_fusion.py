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
    if name != "bert":  # Pre-LN, exact: nothing centred, every norm on RMS
        assert layers["RMS"] == norms, (name, route, dict(layers))
    got = torch.from_numpy(compiled([t.numpy() for t in example])[0])
    assert agreement(got, ref)["max_rel"] < TOL
