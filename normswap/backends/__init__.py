"""RMSNorm backends and the rule that picks one.

A backend is a module with ``name``, ``available() -> (bool, reason)``,
``supports(x, weight, bias) -> bool`` and ``rms_norm(x, normalized_shape, weight, bias, eps)``.
They all compute the same function (see ``eager`` for the cast order); they differ in speed.

``auto`` asks :func:`select` for the fastest available backend for this device, dtype and shape.
The environment variable ``NORMSWAP_BACKEND`` overrides ``auto`` globally (e.g. ``eager`` to rule
out a kernel while debugging).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from normswap.backends import eager, native
from normswap.errors import NormswapError

BACKENDS: dict[str, ModuleType] = {"eager": eager, "native": native}
ENV_VAR = "NORMSWAP_BACKEND"


def register(module: ModuleType) -> None:
    """Add a backend module (see the module docstring for the interface)."""
    BACKENDS[module.name] = module


def names() -> list[str]:
    return ["auto", *BACKENDS]


def check_name(backend: str) -> str:
    if backend != "auto" and backend not in BACKENDS:
        raise NormswapError(f"unknown RMSNorm backend {backend!r}; choose one of {', '.join(names())}")
    return backend


def select(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> ModuleType:
    """The ``auto`` rule: the fastest backend that is available and supports these tensors.

    CUDA: ``native`` (PyTorch's fused kernel). Elsewhere: ``eager``.
    """
    if x.is_cuda and native.available()[0]:
        return native
    return eager


def resolve(
    backend: str, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> ModuleType:
    """Backend module for a call. Falls back to ``auto`` when the requested one cannot run here."""
    if backend == "auto":
        backend = os.environ.get(ENV_VAR, "auto") or "auto"
    if backend != "auto":
        module = BACKENDS.get(backend)
        if module is None:
            raise NormswapError(f"unknown RMSNorm backend {backend!r}; choose one of {', '.join(names())}")
        if module.available()[0] and module.supports(x, weight, bias):
            return module
    return select(x, weight, bias)
