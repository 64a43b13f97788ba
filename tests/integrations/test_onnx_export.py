"""ONNX export of converted models, both exporters, opsets 18 and 23, run in onnxruntime.

Before issue 15 the legacy exporter (``dynamo=False``) silently turned every RMSNorm into a constant of
zeros (the fused CPU kernel is invisible to a trace), and the dynamo exporter failed with
``No ONNX function found for normswap.cpu_rms_norm``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from tests.integrations.compat import (  # noqa: E402
    MODELS,
    norm_op_counts,
    onnx_agreement,
    onnx_roundtrip,
    rms_norm_count,
    tiny_converted,
)

# float32 rounding through a 2-layer model; a zeroed norm or a wrong decomposition is off by O(1).
TOL = 1e-5


@pytest.fixture(scope="module", params=MODELS)
def converted(request, onnx_exports):
    """``(name, model, inputs, export)``: the model and its exports are shared with test_onnx_fusion.py
    within a process (the same ``torch.onnx.export`` arguments give the same file)."""
    model, inputs = onnx_exports.model(request.param)
    assert rms_norm_count(model) > 0
    return request.param, model, inputs, lambda **kwargs: onnx_exports.export(request.param, **kwargs)


@pytest.mark.parametrize("opset", [18, 23])
@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
def test_onnx_matches_eager(converted, dynamo, opset):
    name, model, inputs, exported = converted
    r = onnx_agreement(model, inputs, exported(dynamo=dynamo, opset_version=opset))
    assert r["nonzero"], f"{name}: onnxruntime returned zeros"
    assert r["inputs"] == sum(isinstance(v, torch.Tensor) for v in inputs.values())
    assert r["max_rel"] < TOL, r
    if dynamo and opset >= 23:
        # one RMSNormalization per converted norm; one that centers its own input (a Post-LN encoder's
        # embeddings' norm, its tables kept) is the original's LayerNormalization
        assert r["rms"] == norm_op_counts(model)[0], r["ops"]
    else:
        assert r["rms"] == 0
        assert {"ReduceMean", "Pow"} <= set(r["ops"]), r["ops"]


def test_legacy_trace_records_no_kernel_constant(tmp_path):
    """The graph must depend on its input: two different inputs give two different outputs."""
    import onnxruntime as ort

    model, inputs = tiny_converted("vit")
    x = inputs["pixel_values"]
    torch.onnx.export(model, (x,), str(tmp_path / "v.onnx"), dynamo=False, opset_version=18)
    sess = ort.InferenceSession(str(tmp_path / "v.onnx"), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    a = torch.from_numpy(sess.run(None, {name: x.numpy()})[0])
    b = torch.from_numpy(sess.run(None, {name: (x * 0.5 + 0.1).numpy()})[0])
    with torch.no_grad():
        ref_b = model(pixel_values=x * 0.5 + 0.1).logits
    assert not torch.equal(a, b)
    assert (b - ref_b).abs().max() < 1e-4


@pytest.mark.parametrize("opset", [18, 23])
def test_onnx_export_ignores_an_explicit_fused_backend(tmp_path, opset):
    """backend="cpu" asked for on every norm: ONNX still gets the portable graph (it failed with
    "No ONNX function found for normswap.cpu_rms_norm")."""
    import normswap

    model, inputs = tiny_converted("vit")
    for m in model.modules():
        if isinstance(m, normswap.RMSNorm):
            m.backend = "cpu"
    r = onnx_roundtrip(model, inputs, dynamo=True, opset=opset, path=tmp_path / "m.onnx")
    assert r["max_rel"] < TOL, r
    assert r["rms"] == (rms_norm_count(model) if opset >= 23 else 0)


@pytest.mark.parametrize("opset", [18, 23])
def test_exported_program_with_fused_op_translates(onnx_exports, opset):
    """A program exported with backend="cpu" holds normswap::cpu_rms_norm; the translation table
    turns it into RMSNormalization (opset 23) or the decomposition (18)."""
    import onnx
    import onnxruntime as ort

    model, inputs, x, ep = onnx_exports.vit_cpu_op()  # the program, checked to hold the op
    path = onnx_exports.translated(opset)  # torch.onnx.export(ep, custom_translation_table=translation_table(opset))
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("RMSNormalization") == (rms_norm_count(model) if opset >= 23 else 0)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    with torch.no_grad():
        ref = model(pixel_values=x).logits
    assert (got - ref).abs().max() <= TOL * ref.abs().max()


def test_half_precision_translation_rounds_once(tmp_path):
    """A float16 program holding normswap::cpu_rms_norm translates, even at opset 23, to float32
    arithmetic and one Cast back (not RMSNormalization, which the ONNX spec rounds before the scale),
    and onnxruntime then agrees with eager to within one float16 rounding of a last-bit rstd difference."""
    import onnx
    import onnxruntime as ort

    import normswap
    from normswap.integrations.onnx import translation_table

    torch.manual_seed(0)
    norm = normswap.RMSNorm(64, eps=1e-5, bias=True, backend="cpu", dtype=torch.float16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(64))
        norm.bias.copy_(0.5 * torch.randn(64))
    x = torch.randn(16, 64).to(torch.float16)
    ep = torch.export.export(norm, (x,))
    assert any("normswap.cpu_rms_norm" in str(n.target) for n in ep.graph.nodes)
    program = torch.onnx.export(ep, dynamo=True, opset_version=23, custom_translation_table=translation_table(23))
    program.save(str(tmp_path / "h.onnx"))
    ops = [n.op_type for n in onnx.load(str(tmp_path / "h.onnx")).graph.node]
    assert "RMSNormalization" not in ops and "Cast" in ops, ops
    sess = ort.InferenceSession(str(tmp_path / "h.onnx"), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    with torch.no_grad():
        want = normswap.backends.eager.rms_norm(x, (64,), norm.weight, norm.bias, 1e-5)
    assert got.dtype == torch.float16
    assert (got.float() - want.float()).abs().max() <= 2 ** -10 * want.float().abs().max()
    assert (got == want).float().mean() > 0.95
