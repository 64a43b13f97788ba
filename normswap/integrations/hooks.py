"""Callbacks ``normswap.patch`` runs on a model it has just converted.

A leaf module: ``normswap.api`` calls :func:`after_patch`; higher layers (``normswap.integrations.saving``)
register here when ``import normswap`` installs its hooks, so the API imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Called in order with the converted model after a successful ``patch``.
AFTER_PATCH: list[Callable[[Any], object]] = []


def register_after_patch(fn: Callable[[Any], object]) -> None:
    """Add ``fn`` to :data:`AFTER_PATCH` (once)."""
    if fn not in AFTER_PATCH:
        AFTER_PATCH.append(fn)


def after_patch(model: Any) -> None:
    """Run every registered callback on ``model``."""
    for fn in AFTER_PATCH:
        fn(model)
