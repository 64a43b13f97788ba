"""Is a graph being captured for export, and a way to step outside the capture.

Kept free of normswap imports: the CPU kernel build and the export path (:mod:`normswap.backends.portable`) use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_is_jit_tracing = torch._C._is_tracing  # what torch.jit.is_tracing() calls, without its scripting check


def exporting() -> bool:
    """True under ``torch.export`` (and so the dynamo ONNX exporter) or ``torch.jit.trace`` (and so the
    legacy ONNX exporter). False in eager mode and under plain ``torch.compile``.

    Costs two flag reads (~0.3 us). Under compilation it reads the flag ``torch.export`` sets
    (``torch.compiler._is_exporting_flag``, which ``torch.compiler.is_exporting()`` returns) rather than
    calling ``is_exporting()``: Dynamo replaces that call by the constant True, under plain
    ``torch.compile`` too, in torch 2.11 and earlier (pytorch/pytorch#176347), which sent every compiled
    normswap RMSNorm to the export path (stock aten ops instead of the fused backends). Dynamo reads a
    module attribute as a constant (with a guard), and never reaches the jit check (which it cannot trace).
    """
    if torch.compiler.is_compiling():
        flag = getattr(torch.compiler, "_is_exporting_flag", None)
        return torch.compiler.is_exporting() if flag is None else bool(flag)
    return _is_jit_tracing()


@contextlib.contextmanager
def outside_tracing() -> Iterator[None]:
    """Run real tensor code while a graph is being captured: no fake/functional dispatch modes, no
    ``torch.jit`` trace recording, no autograd.

    For one-time work that must see real data, e.g. the CPU kernel's first-use build and self-test,
    when that first use happens inside ``torch.export`` (fake tensors have no data pointer) or
    ``torch.jit.trace`` (the self-test's ops would be recorded into the user's graph).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    state = torch._C._get_tracing_state()
    if state is not None:
        torch._C._set_tracing_state(None)
    try:
        with _disable_current_modes(), torch.no_grad():
            yield
    finally:
        if state is not None:
            torch._C._set_tracing_state(state)
