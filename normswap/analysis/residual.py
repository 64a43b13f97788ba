"""Where a Post-LN norm's output is also a residual: the writer that the residual add sums it with.

A Post-LN block (BERT, RoBERTa, ELECTRA, MPNet, BART's encoder) reads a norm's output ``n = γ⊙u + β``
twice: its Linear readers (``q/k/v``, or the FFN's first dense) compute ``R n + r``, and the residual
add computes ``W h + c + n``, which the next norm reads. Both take ``β`` out of ``n`` exactly:
``R n + r = R(γ⊙u) + (r + Rβ)`` and ``W h + c + n = (W h + (c + β)) + γ⊙u``. So where every other
reader of ``n`` is such an add, and the add's other operand is one Linear writer's output read by
nothing else, β can leave the norm (:class:`normswap.analysis.plan.ResidualFold`); the next stream is the
same sum, value for value. :func:`residual_writers` finds that writer on the traced graph.
"""

from __future__ import annotations

from normswap.analysis.dataflow import IDENTITY_OPS
from normswap.analysis.streams import Analyzer, writer_kind
from normswap.analysis.trace import ModuleCall, ValueRef

PLAIN_ADDS = ("add", "__add__", "__radd__")  # out of place: an in-place add would write the norm's output


def residual_writers(an: Analyzer, call: ModuleCall, reader_ids: set[int]) -> tuple[list[tuple[str, str]], str]:
    """The Linear writers the residual adds sum with norm call ``call``'s output, as ``[(path, kind)]``,
    and '' ; or ``([], why not)``.

    Every consumer of the output (through identity ops: dropout, casts) must be inside one of the
    Linear reader calls ``reader_ids`` or a plain out-of-place add of two tensors of the output's
    shape whose other operand is, through identity ops each read once, the output of a Linear /
    Conv1D call with a bias, called once in the forward, and read by nothing else."""
    graph = an.graph
    out_vid = an.norm_output(call)
    if out_vid is None:
        return [], "no tensor output"
    writers: list[tuple[str, str]] = []
    stack, seen = [out_vid], set()
    while stack:
        vid = stack.pop()
        if vid in seen:
            continue
        seen.add(vid)
        if vid in an.output_values:
            return [], f"its output is the model output `{an.output_values[vid]}`"
        for index in graph.values[vid].consumers:
            op = graph.ops[index]
            if any(c.id in reader_ids for c in graph.ancestors_calls(op.call)):
                continue
            if op.name in IDENTITY_OPS and op.args and op.args[0] == ValueRef(vid) and len(op.outputs) == 1:
                stack.append(op.outputs[0])
                continue
            writer, why = _add_writer(an, op, vid)
            if writer is None:
                return [], why
            writers.append(writer)
    if not writers:
        return [], "no residual add reads its output"
    return writers, ""


def _add_writer(an: Analyzer, op: object, vid: int) -> tuple[tuple[str, str] | None, str]:
    """``op`` as a residual add of ``vid`` and one Linear writer's output: ``((path, kind), '')`` or
    ``(None, why not)``."""
    graph = an.graph
    where = f"`{op.name}`" + (f" in `{graph.calls[op.call].path}`" if op.call is not None else "")
    refs = [a for a in op.args if isinstance(a, ValueRef)]
    if op.name not in PLAIN_ADDS or op.kwargs or len(op.args) != 2 or len(refs) != 2 or len(op.outputs) != 1:
        return None, f"output also read by {where} (not a Linear, not a residual add)"
    other = refs[1].id if refs[0].id == vid else refs[0].id
    shape = graph.values[vid].shape
    if other == vid or graph.values[other].shape != shape or graph.values[op.outputs[0]].shape != shape:
        return None, f"output also read by {where}, which broadcasts or adds it twice"
    v = other
    while True:  # back through dropout and casts, each read by the next step alone
        if len(graph.values[v].consumers) != 1:
            return None, f"the other term of {where} is also read elsewhere"
        prod = graph.producer(graph.values[v])
        calls = [c for c in an.by_output.get(v, []) if writer_kind(c.module) in ("linear", "conv1d")]
        if calls:
            break
        if prod is None or prod.name not in IDENTITY_OPS or not prod.args or not isinstance(prod.args[0], ValueRef):
            return None, f"the other term of {where} is not a Linear's output"
        v = prod.args[0].id
    wcall = calls[0]  # innermost
    module = wcall.module
    if getattr(module, "bias", None) is None:
        return None, f"`{wcall.path}`, the other term of {where}, has no bias"
    if len(an.calls_per_path.get(wcall.path, [])) != 1:
        return None, f"`{wcall.path}` is called more than once"
    return (wcall.path, writer_kind(module)), ""
