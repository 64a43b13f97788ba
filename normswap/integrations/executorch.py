"""ExecuTorch (XNNPACK): export every ``normswap.RMSNorm`` of a model in a form XNNPACK delegates whole.

What ``torch.export`` records for a ``normswap.RMSNorm`` by default (``aten.rms_norm``, decomposed into ``pow``,
``mean``, ``add``, ``rsqrt``, ``mul``) is the form ONNX Runtime fuses, and the default must stay so. ExecuTorch's
XNNPACK partitioner takes no 3-D ``mean``: each norm's ``mean`` and ``+ eps`` then run as ExecuTorch's portable
kernels between two delegate calls (timed all in one process that looked ~2% slower than the original at short
inputs; each program timed in its own processes, neither form differs from the original measurably: round 57).
Inside :func:`delegable_norms` the same norms export as ``x**2`` times a constant ``1/n`` column (XNNPACK's
fully-connected op, eps as its bias), so the whole norm joins its neighbours' delegate.

Usage (the form is only recorded while the model is exported; eager calls are unchanged)::

    from normswap.integrations.executorch import delegable_norms

    with delegable_norms(model):
        ep = torch.export.export(model, example_inputs)
    edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])

Or at lowering time, on a program exported with the default form: ``delegable_program(program)`` rewrites every
``aten.rms_norm`` in it into the same form (the same ``.pte`` once lowered). After PT2E quantization this is the
form to use: the quantizer then sees the default form (one ``aten.rms_norm``, which it leaves alone) and the
rewrite only changes float ops, so static int8 keeps the default form's error (docs/results/quantization.md, round
57). Neither is automatic: nothing at export time tells an XNNPACK lowering from AOTInductor or from ExecuTorch's
other backends, which take ``rms_norm`` whole (docs/deployment.md).

With PT2E quantization export inside the context (the graph ``prepare_pt2e`` takes keeps the form); the default
``"addmm"`` form's reduction is left in float by ExecuTorch's ``XNNPACKQuantizer`` (dynamic and static: it annotates
``linear``, not ``addmm``; ``mul``, not ``pow``), as the original's ``layer_norm`` is. Under static int8 it does
annotate the form's two ``mul`` (``x * rstd``, ``* weight``), which the default form hides inside one
``aten.rms_norm``; measured on DINOv2-small, static int8 prefers the default form (docs/deployment.md). Needs no
ExecuTorch import: this only changes what ``torch.export`` records.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from normswap.backends.portable import DELEGABLE_FORMS, delegable_rms_norm
from normswap.backends.rows import compute_dtype
from normswap.nn.rmsnorm import RMSNorm

__all__ = ["DELEGABLE_FORMS", "delegable_norms", "delegable_program"]

_BUFFERS = ("export_mean_weight", "export_eps")


def _constants(norm: RMSNorm, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``1/n`` column (a row for ``"linear"``, whose weight is ``(out, in)``) and the eps of ``norm``, in the
    compute dtype of its parameters (float32, float64 for a float64 norm) and on their device."""
    param = next((p for p in (norm.weight, norm.bias) if p is not None), None)
    dtype = compute_dtype(param.dtype) if param is not None else torch.float32
    device = param.device if param is not None else None
    size = math.prod(norm.normalized_shape)
    shape = (1, size) if form == "linear" else (size, 1)
    return (torch.full(shape, 1.0 / size, dtype=dtype, device=device),
            torch.full((1,), norm.eps, dtype=dtype, device=device))


@contextlib.contextmanager
def delegable_norms(model: nn.Module, form: str = "addmm") -> Iterator[int]:
    """Switch every ``normswap.RMSNorm`` in ``model`` to a form ExecuTorch's XNNPACK backend delegates whole,
    for what ``torch.export`` (or ``torch.jit.trace``) records inside the ``with`` block; yields how many.

    ``form``: one of :data:`DELEGABLE_FORMS`. ``"addmm"`` (the default) computes the mean of squares as
    ``addmm(eps, x**2, 1/n column)``: one fully-connected op with eps as its bias, and left in float by
    ExecuTorch's ``XNNPACKQuantizer``. ``"linear"`` (``F.linear``, the same op once lowered) is quantized
    by that quantizer (its input ``x**2`` becomes int8), so it is for float programs only; ``"mm"`` adds eps
    as a separate op. Outputs equal the default form's up to the rounding of ``1/n``.

    Each norm gets two constant buffers (not persistent: ``state_dict`` is unchanged) and the form for the
    duration of the block; both are removed on exit, also when the export raises. Eager calls inside the
    block are unaffected. Raises ``ValueError`` for an unknown form, a model without ``normswap.RMSNorm``
    (convert it first) or one already inside ``delegable_norms``.
    """
    if form not in DELEGABLE_FORMS:
        raise ValueError(f"delegable_norms: unknown form {form!r} (one of {', '.join(DELEGABLE_FORMS)})")
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    if not norms:
        raise ValueError(f"delegable_norms: {type(model).__name__} has no normswap.RMSNorm "
                         "(convert it first, e.g. normswap.patch(model))")
    if any("export_form" in vars(n) for n in norms):
        raise ValueError("delegable_norms: the model is already inside delegable_norms")
    try:
        for norm in norms:
            mean_weight, eps = _constants(norm, form)
            norm.register_buffer(_BUFFERS[0], mean_weight, persistent=False)
            norm.register_buffer(_BUFFERS[1], eps, persistent=False)
            norm.export_form = form
        yield len(norms)
    finally:
        for norm in norms:
            vars(norm).pop("export_form", None)
            for name in _BUFFERS:
                if hasattr(norm, name):
                    delattr(norm, name)


def delegable_program(program: torch.export.ExportedProgram, form: str = "addmm",
                      dynamic_shapes: object = None) -> torch.export.ExportedProgram:
    """The exported ``program`` with every ``aten.rms_norm`` rewritten into ``form`` (see :func:`delegable_norms`):
    the rewrite at lowering time, for a program already exported with the default form.

    ``torch.export`` cannot tell an ExecuTorch export from an AOTInductor or ONNX one (ONNX Runtime fuses the default
    form; inductor compiles ``aten.rms_norm`` as one kernel), so the default export keeps ``aten.rms_norm``. Whoever
    lowers to XNNPACK knows; call this between ``torch.export.export`` and ``to_edge_transform_and_lower``. It
    rewrites any ``aten.rms_norm`` (a ``normswap.RMSNorm``'s, ``torch.nn.RMSNorm``'s or ``F.rms_norm``'s), needs no
    ExecuTorch and no ``normswap`` at run time: the program is unlifted (``program.module()``), each norm's ``1/n``
    column and eps are added as non-persistent buffers (``normswap_mean_weight_<i>``, ``normswap_eps_<i>``) and it
    is exported again with ``program.example_inputs``; ``dynamic_shapes`` is passed to that export (a program
    exported with dynamic shapes needs them again). ``eps=None`` is the input dtype's machine epsilon, as in
    ``aten.rms_norm``. Returns ``program`` itself when it holds no ``aten.rms_norm``; raises ``ValueError`` for an
    unknown form, a program without example inputs or one with dynamic shapes and no ``dynamic_shapes`` (exported
    again without them it would silently become static). Outputs equal the default form's up to the rounding of
    ``1/n``.
    """
    if form not in DELEGABLE_FORMS:
        raise ValueError(f"delegable_program: unknown form {form!r} (one of {', '.join(DELEGABLE_FORMS)})")
    rms = torch.ops.aten.rms_norm.default
    if not any(n.op == "call_function" and n.target is rms for n in program.graph.nodes):
        return program
    if program.example_inputs is None:
        raise ValueError("delegable_program: the program has no example inputs to export it again with "
                         "(export it with torch.export.export)")
    if program.range_constraints and dynamic_shapes is None:
        raise ValueError("delegable_program: the program was exported with dynamic shapes; pass the same "
                         "dynamic_shapes (or export inside delegable_norms instead)")
    module = program.module()
    graph = module.graph
    for i, node in enumerate([n for n in graph.nodes if n.op == "call_function" and n.target is rms]):
        x, shape, weight, eps = (list(node.args) + [None, None])[:4]
        eps = node.kwargs.get("eps", eps)
        weight = node.kwargs.get("weight", weight)
        dtype = x.meta["val"].dtype
        cdt = compute_dtype(dtype)
        size = math.prod(shape)
        eps = torch.finfo(dtype).eps if eps is None else float(eps)
        col = torch.full((1, size) if form == "linear" else (size, 1), 1.0 / size, dtype=cdt)
        names = (f"normswap_mean_weight_{i}", f"normswap_eps_{i}")
        module.register_buffer(names[0], col, persistent=False)
        module.register_buffer(names[1], torch.full((1,), eps, dtype=cdt), persistent=False)
        with graph.inserting_before(node):
            mean_weight, eps_node = (graph.get_attr(name) for name in names)
            new = graph.call_function(delegable_rms_norm, (x, tuple(shape), weight, None, mean_weight, eps_node,
                                                           form))
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.lint()
    module.recompile()
    args, kwargs = program.example_inputs
    return torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes)
