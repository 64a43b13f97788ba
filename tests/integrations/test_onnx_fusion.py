"""An exported converted model runs on ONNX Runtime's fused RMS kernel, one fused op per norm.

Before issue 40 the dynamo exporter's default opset wrote each RMSNorm as ``aten.rms_norm``'s
decomposition (``Pow``, ``ReduceMean``, ``Add``, ``Sqrt``, ``Reciprocal``, ``Mul``, ``Mul``), which neither
ORT's session optimiser nor ``onnxruntime.transformers.optimizer`` fuses, and onnxscript's optimiser
deleted BERT's and ViT's ``+ 1e-12`` altogether: the converted model ran unfused, slower than its
original's fused ``LayerNormalization``. Counts come from the graph ORT itself writes out
(``SessionOptions.optimized_model_filepath``, through ``normswap.integrations.onnx.fused_norm_ops``).
"""

from __future__ import annotations

import collections
import logging

import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import normswap  # noqa: E402
from normswap.backends.portable import ONNXSCRIPT_MIN_EPS  # noqa: E402
from normswap.integrations.onnx import FUSED_RMS_OPS, fused_norm_ops  # noqa: E402
from tests.integrations.compat import (  # noqa: E402
    MODELS,
    agreement,
    export_onnx,
    first_output,
    norm_op_counts,
    rms_norm_count,
    tensor_inputs,
)
from tests.zoo import APPROXIMATE, EXACT, build  # noqa: E402

TOL = 1e-5  # float32 through a 2-layer model; an unfused or mis-fused norm (wrong eps, no weight) is far off


@pytest.fixture(scope="module", params=MODELS)
def converted(request, onnx_exports):
    """``(name, model, inputs, export)``: ``export(**kwargs)`` exports once per set of arguments and
    returns the file (the session and the optimizer tests read the same default-opset export; the model
    and its exports are shared with test_onnx_export.py within a process)."""
    name = request.param
    model, inputs = onnx_exports.model(name)
    return name, model, inputs, lambda **kwargs: onnx_exports.export(name, **kwargs)


def _export(model: nn.Module, inputs: dict, path, **kwargs) -> None:
    export_onnx(model, inputs, path, **kwargs)


def _run(path, inputs: dict) -> torch.Tensor:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feed = {i.name: t.numpy() for i, t in zip(sess.get_inputs(), tensor_inputs(inputs).values(), strict=True)}
    return torch.from_numpy(sess.run(None, feed)[0])


def _fused_eps(path) -> list[float]:
    """The epsilon of every fused norm in ORT's optimised graph."""
    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(path) + ".opt"
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return [a.f for n in onnx.load(options.optimized_model_filepath).graph.node if n.op_type in FUSED_RMS_OPS
            for a in n.attribute if a.name == "epsilon"]


def _eps_of(model: nn.Module) -> set[float]:
    return {m.eps for m in model.modules() if isinstance(m, normswap.RMSNorm)}


# dynamo=True without an opset: torch 2.13 writes opset 20, below RMSNormalization's 23
@pytest.mark.parametrize("export", [{"dynamo": True}, {"dynamo": False, "opset_version": 18}],
                         ids=["dynamo-default-opset", "legacy-18"])
def test_every_norm_fuses_in_the_ort_session(converted, export):
    name, model, inputs, exported = converted
    path = exported(**export)
    ops = fused_norm_ops(path)
    n, centering = norm_op_counts(model)
    assert ops["SimplifiedLayerNormalization"] == n, (name, ops)
    assert ops["LayerNormalization"] + ops["SkipLayerNormalization"] == centering, (name, ops)
    assert ops["Pow"] == 0 and ops["RMSNormalization"] == 0, (name, ops)
    (eps,) = _eps_of(model)
    kept = max(eps, ONNXSCRIPT_MIN_EPS) if export["dynamo"] else eps
    assert _fused_eps(path) == pytest.approx([kept] * n, rel=1e-6)  # ORT read the eps (its default is 1e-5)
    with torch.no_grad():
        ref = first_output(model(**inputs))
    assert agreement(_run(path, inputs), ref)["max_rel"] < TOL


def test_opset_23_writes_rms_normalization(converted):
    import onnx

    name, model, inputs, exported = converted
    path = exported(dynamo=True, opset_version=23)
    ops = collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    n, centering = norm_op_counts(model)
    assert ops["RMSNormalization"] == n and ops["LayerNormalization"] == centering and ops["Sqrt"] == 0, ops
    assert fused_norm_ops(path)["RMSNormalization"] == n  # ORT keeps its own kernel for the op
    (eps,) = _eps_of(model)
    assert _fused_eps(path) == pytest.approx([eps] * n, rel=1e-6)  # an attribute: no optimiser can drop it
    with torch.no_grad():
        ref = first_output(model(**inputs))
    assert agreement(_run(path, inputs), ref)["max_rel"] < TOL


def test_transformers_optimizer_fuses_every_norm(converted, tmp_path):
    """``optimize_model`` with the model's own type fuses each norm, the ones after a residual ``Add``
    into ``SkipSimplifiedLayerNormalization``."""
    from onnxruntime.transformers.optimizer import optimize_model

    name, model, inputs, exported = converted
    path = exported(dynamo=True)
    logging.disable(logging.WARNING)
    try:
        optimised = optimize_model(str(path), model_type=name, num_heads=0, hidden_size=0)
    finally:
        logging.disable(logging.NOTSET)
    ops = collections.Counter(n.op_type for n in optimised.model.graph.node)
    n, centering = norm_op_counts(model)
    assert ops["SimplifiedLayerNormalization"] + ops["SkipSimplifiedLayerNormalization"] == n, ops
    assert ops["LayerNormalization"] + ops["SkipLayerNormalization"] == centering, ops
    assert ops["SkipSimplifiedLayerNormalization"] >= 1 and ops["Pow"] == 0, ops
    out = tmp_path / "optimised.onnx"
    optimised.save_model_to_file(str(out))
    with torch.no_grad():
        ref = first_output(model(**inputs))
    assert agreement(_run(out, inputs), ref)["max_rel"] < TOL
    # every residual Add the original's LayerNorms absorb (SkipLayerNormalization), the converted
    # model's RMSNorms absorb too (SkipSimplifiedLayerNormalization): the same Skip count (the original's
    # export and optimize_model's graph of it, made once a model: _original_skips)
    original = _original_skips(name, inputs, exported(dynamo=True).parent)
    assert ops["SkipSimplifiedLayerNormalization"] == original["optimize_model"], (ops, original)


class _Stack(nn.Module):
    """Residual blocks around RMSNorms of one kind: ``x + linear(norm(x))`` twice, then a final norm."""

    def __init__(self, make_norm, width: int = 16) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.norms = nn.ModuleList(make_norm() for _ in range(3))
        self.linears = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (1.0 if p.dim() == 1 else 0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, linear in zip(self.norms, self.linears, strict=False):
            x = x + linear(norm(x))
        return self.norms[-1](x)


def _mixed() -> _Stack:
    """A weightless norm, one with a kept bias and one with BERT's eps=1e-12."""
    kinds = iter([lambda: normswap.RMSNorm(16, eps=1e-6, elementwise_affine=False),
                  lambda: normswap.RMSNorm(16, eps=1e-6, bias=True),
                  lambda: normswap.RMSNorm(16, eps=1e-12)])
    return _Stack(lambda: next(kinds)()).eval()


@pytest.mark.parametrize("optimize", [True, False], ids=["onnxscript-optimiser", "optimize=False"])
def test_norm_variants_fuse(optimize, tmp_path):
    """A weightless norm (multiplied by ones to close the pattern), a kept bias (an Add after the fused
    op) and eps=1e-12 all fuse. Under onnxscript's optimiser eps=1e-12 is raised to ONNXSCRIPT_MIN_EPS
    (the optimiser deletes an Add of a smaller scalar); with ``optimize=False`` it is kept exactly. A row
    of zeros stays finite."""
    model = _mixed()
    x = torch.randn(2, 5, 16)
    x[1, 2] = 0.0
    inputs = {"x": x}
    path = tmp_path / "m.onnx"
    _export(model, inputs, path, dynamo=True, optimize=optimize)
    assert fused_norm_ops(path)["SimplifiedLayerNormalization"] == 3
    kept = ONNXSCRIPT_MIN_EPS if optimize else 1e-12
    assert sorted(_fused_eps(path)) == pytest.approx(sorted([1e-6, 1e-6, kept]), rel=1e-6)
    got = _run(path, inputs)
    with torch.no_grad():
        ref = model(x)
    assert torch.isfinite(got).all()
    assert agreement(got, ref)["max_rel"] < TOL


def test_half_precision_fuses_between_casts(tmp_path):
    """A float16 model: the norm's float32 arithmetic between a Cast up and one Cast down (eager's one
    rounding) fuses on the CPU provider into a float32 SimplifiedLayerNormalization."""
    model = _Stack(lambda: normswap.RMSNorm(16, eps=1e-6, bias=True)).eval().half()
    x = torch.randn(2, 5, 16).half()
    path = tmp_path / "m.onnx"
    _export(model, {"x": x}, path, dynamo=True)
    assert fused_norm_ops(path)["SimplifiedLayerNormalization"] == 3
    got = _run(path, {"x": x})
    with torch.no_grad():
        ref = model.float()(x.float())
    assert agreement(got, ref)["max_rel"] < 5e-3  # float16 storage between the ops


def test_translated_fused_backend_program_fuses(onnx_exports):
    """A program exported by ``torch.export`` with ``backend="cpu"`` holds ``normswap::cpu_rms_norm``;
    ``translation_table(18)`` writes it as the graph ORT fuses (it wrote ``Mul(x, x)``/``Reciprocal``)."""
    model, inputs, x, ep = onnx_exports.vit_cpu_op()  # the program, checked to hold the op
    path = onnx_exports.translated(18)  # torch.onnx.export(ep, custom_translation_table=translation_table(18))
    assert fused_norm_ops(path)["SimplifiedLayerNormalization"] == rms_norm_count(model)
    with torch.no_grad():
        ref = model(pixel_values=x).logits
    assert agreement(_run(path, inputs), ref)["max_rel"] < TOL


# ---------------------------------------------------------------- fuse_norms: the Skip fusion with its bias
def _session_graph(path):
    """The graph ORT's session optimiser writes out for ``path`` (CPU provider, its default level)."""
    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(path) + ".session.onnx"
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return onnx.load(options.optimized_model_filepath).graph


def _optimize_model(path, name: str, out) -> str:
    from onnxruntime.transformers.optimizer import optimize_model

    logging.disable(logging.WARNING)
    try:
        optimize_model(str(path), model_type=name, num_heads=0, hidden_size=0).save_model_to_file(str(out))
    finally:
        logging.disable(logging.NOTSET)
    return str(out)


def _unfused_adds(graph) -> list[str]:
    """The ``Add`` nodes in front of a norm op that ORT fuses into the norm in a LayerNorm model: a
    projection's bias (``Add(MatMul, 1-D initializer)``, its ``Cast`` between allowed) read by a norm op,
    and a residual (``Add`` of two activations, neither an embedding ``Gather``) read by a norm op that has
    no skip input. Their names; none should be left."""
    made = {o: n for n in graph.node for o in n.output}
    inits = {t.name: t for t in graph.initializer}
    left = []
    for norm in graph.node:
        if norm.op_type not in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                                "LayerNormalization", "SkipLayerNormalization"):
            continue
        skip = norm.op_type.startswith("Skip")
        for name in norm.input[:2] if skip else norm.input[:1]:
            add = made.get(name)
            if add is None or add.op_type != "Add":
                continue
            parents = [made.get(i) for i in add.input]
            biased = any(i in inits and len(inits[i].dims) == 1 for i in add.input) and any(
                p is not None and (p.op_type == "MatMul" or p.op_type == "Cast" and made.get(p.input[0]) is not None
                                   and made[p.input[0]].op_type == "MatMul") for p in parents)
            residual = not skip and all(p is not None and p.op_type != "Gather" for p in parents) and \
                not any(i in inits for i in add.input)
            if biased or residual:
                left.append(f"{add.name} -> {norm.op_type}")
    return left


def _counts(graph) -> collections.Counter:
    return collections.Counter(n.op_type for n in graph.node)


_ORIGINAL_SKIPS: dict[str, dict[str, int]] = {}
_ORIGINAL_EXPORTS: dict[str, object] = {}


def _original_export(name: str, inputs: dict, folder):
    """The file of the original's (``build``: seeded, the converted model's source) dynamo export at
    ``inputs``' shapes, made once a process (the Skip counts and the compat test read the same one)."""
    if name not in _ORIGINAL_EXPORTS:
        original = build(APPROXIMATE if name == "bert" else EXACT, name).float().eval()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}-original.onnx"
        _export(original, inputs, path, dynamo=True)
        _ORIGINAL_EXPORTS[name] = path
    return _ORIGINAL_EXPORTS[name]


def _original_skips(name: str, inputs: dict, folder) -> dict[str, int]:
    """The original's ``SkipLayerNormalization`` count in ORT's session graph and after ``optimize_model``
    (its graph: the tiny BERT's optimised original fails ORT's session initialisation, an ORT issue)."""
    if name not in _ORIGINAL_SKIPS:
        path = _original_export(name, inputs, folder)
        import onnx

        optimised = onnx.load(_optimize_model(path, name, folder / f"{name}-original-optimised.onnx")).graph
        _ORIGINAL_SKIPS[name] = {"session": _counts(_session_graph(path))["SkipLayerNormalization"],
                                 "optimize_model": _counts(optimised)["SkipLayerNormalization"]}
    return _ORIGINAL_SKIPS[name]


@pytest.mark.parametrize(("export", "after"), [({"dynamo": True}, "export"), ({"dynamo": True}, "optimize_model"),
                                               ({"dynamo": False, "opset_version": 18}, "export")],
                         ids=["dynamo-default-opset", "dynamo-optimize_model", "legacy-18"])
def test_fuse_norms_lands_on_skip_simplified_with_bias(converted, export, after, tmp_path):
    """``fuse_norms`` on the export (or on ``optimize_model``'s output) puts every residual ``Add`` and
    projection bias in front of a converted norm into ``SkipSimplifiedLayerNormalization``, as ORT puts the
    original's into ``SkipLayerNormalization``: as many Skip ops as the original's most-fused graph
    (``optimize_model``), at least as many as its session graph, no bias or residual ``Add`` left in front
    of a norm in the graph ORT runs, and the same outputs (1e-5)."""
    from normswap.integrations.onnx import fuse_norms

    name, model, inputs, exported = converted
    path = exported(**export)
    source = path if after == "export" else _optimize_model(path, name, tmp_path / "optimised.onnx")
    fused_path = tmp_path / "fused.onnx"
    fuse_norms(source, fused_path)
    graph = _session_graph(fused_path)
    ops = _counts(graph)
    n, centering = norm_op_counts(model)
    assert ops["SimplifiedLayerNormalization"] + ops["SkipSimplifiedLayerNormalization"] == n, ops
    assert ops["Pow"] == 0 and ops["LayerNormalization"] + ops["SkipLayerNormalization"] == centering, ops
    original = _original_skips(name, inputs, path.parent)
    assert ops["SkipSimplifiedLayerNormalization"] == original["optimize_model"], (ops, original)
    assert ops["SkipSimplifiedLayerNormalization"] >= original["session"], (ops, original)
    assert _unfused_adds(graph) == []
    biased = [n for n in graph.node if n.op_type == "SkipSimplifiedLayerNormalization" and len(n.input) == 4]
    if name == "bert" and after == "export":  # Post-LN: each residual Add's other input is MatMul + bias
        # (optimize_model may first turn a MatMul + bias of static shape into a Gemm, its bias inside)
        assert len(biased) == ops["SkipSimplifiedLayerNormalization"], ops
    (eps,) = _eps_of(model)
    kept = max(eps, ONNXSCRIPT_MIN_EPS) if export["dynamo"] else eps
    assert [a.f for n in graph.node if n.op_type in FUSED_RMS_OPS for a in n.attribute
            if a.name == "epsilon"] == pytest.approx([kept] * n, rel=1e-6)
    with torch.no_grad():
        ref = first_output(model(**inputs))
    got = _run(fused_path, inputs)
    assert agreement(got, ref)["max_rel"] < TOL
    assert agreement(got, _run(source, inputs))["max_rel"] < TOL


def test_fuse_norms_pre_ln_residual_read_twice(tmp_path):
    """A Pre-LN stream's sum is read by the norm and by the next block's residual ``Add``: the fused op's
    fourth output (``input_skip_bias_sum``) carries it on, bias included; a weightless norm, a kept β and
    eps=1e-12 (raised to ONNXSCRIPT_MIN_EPS by the exporter's optimiser) fuse too, and the model's input
    names are unchanged."""
    import onnx

    from normswap.integrations.onnx import fuse_norms

    model = _mixed()
    x = torch.randn(3, 5, 16)
    path = tmp_path / "m.onnx"
    _export(model, {"x": x}, path, dynamo=True)
    proto = fuse_norms(path)  # returned, nothing written
    assert not (tmp_path / "m-fused.onnx").exists()
    ops = _counts(proto.graph)
    assert ops["SkipSimplifiedLayerNormalization"] == 2 and ops["SimplifiedLayerNormalization"] == 1, ops
    sums = [n for n in proto.graph.node if n.op_type == "SkipSimplifiedLayerNormalization" and len(n.output) == 4]
    assert len(sums) == 1 and len(sums[0].input) == 4  # the first block's sum is read on; its bias fused
    assert [i.name for i in proto.graph.input] == [i.name for i in onnx.load(str(path)).graph.input]
    assert sorted(a.f for n in proto.graph.node for a in n.attribute if a.name == "epsilon") == \
        pytest.approx(sorted([1e-6, 1e-6, ONNXSCRIPT_MIN_EPS]), rel=1e-6)
    out = tmp_path / "fused.onnx"
    onnx.save(proto, str(out))
    assert _unfused_adds(_session_graph(out)) == []
    with torch.no_grad():
        ref = model(x)
    assert agreement(_run(out, {"x": x}), ref)["max_rel"] < TOL


def test_compat_checkpoint_fuses_as_the_original(tmp_path, onnx_exports):
    """The compat format (stock transformers, LayerNorms kept, every norm exact) lands on the original's
    fused ops in ORT's session, ``SkipLayerNormalization`` included, and ``fuse_norms`` leaves it as it
    is: it never turns a LayerNorm into an RMSNorm, and ORT fuses those itself."""
    import onnx

    from normswap.integrations.onnx import fuse_norms

    original = build(EXACT, "vit").float().eval()
    converted = build(EXACT, "vit")
    normswap.patch(converted)
    normswap.save(converted.float().eval(), tmp_path / "compat", format="compat")
    stock = type(original).from_pretrained(tmp_path / "compat").float().eval()
    inputs = {"pixel_values": torch.randn(2, 3, 32, 32)}
    # the original's export at these shapes (the same seeded build), made once with fuse_norms' Skip counts
    exported = _original_export("vit", inputs, onnx_exports.root / "vit")
    _export(stock, inputs, tmp_path / "c.onnx", dynamo=True)
    norms = ("LayerNormalization", "SkipLayerNormalization", *FUSED_RMS_OPS)
    want = {op: _counts(_session_graph(exported))[op] for op in norms}
    assert want["SkipLayerNormalization"] >= 1
    assert {op: _counts(_session_graph(tmp_path / "c.onnx"))[op] for op in norms} == want
    before = _counts(onnx.load(str(tmp_path / "c.onnx")).graph)
    assert _counts(fuse_norms(tmp_path / "c.onnx", tmp_path / "f.onnx").graph) == before
    with torch.no_grad():
        ref = first_output(original(**inputs))
    assert agreement(_run(tmp_path / "f.onnx", inputs), ref)["max_rel"] < TOL
