"""``AutoModel*.from_pretrained`` understands ``normswap_*`` checkpoints: normswap's one import-time hook.

``import normswap`` calls :func:`install`. transformers resolves a checkpoint's ``model_type`` through
``CONFIG_MAPPING``; normswap replaces that mapping's extra entries (``_extra_content``, where
``AutoConfig.register`` puts its types) by a dict that resolves a ``normswap_<base>`` key on first
lookup, by generating and registering the classes for that base (:func:`normswap.checkpoint.hf.register`).
Nothing else of transformers is touched, and no normswap model class exists until a checkpoint asks
for one.

``import normswap`` must not pay for importing transformers: when transformers' registry module is
not imported yet, one finder on ``sys.meta_path`` waits for it, patches it the moment it has run,
and removes itself. This module imports nothing but the standard library at import time.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from typing import Any

log = logging.getLogger("normswap")

CONFIG_AUTO = "transformers.models.auto.configuration_auto"


class LazyRegistry(dict):
    """Replaces ``CONFIG_MAPPING._extra_content``: ``normswap_<base>`` keys resolve on first lookup."""

    def _resolve(self, key: object) -> bool:
        if not isinstance(key, str) or dict.__contains__(self, key):
            return dict.__contains__(self, key)
        from normswap.checkpoint.hf import base_type, register

        base = base_type(key)
        if not base:
            return False
        try:
            register(base)
        except Exception as exc:  # noqa: BLE001 - unknown base: let transformers report the unknown type
            log.debug("normswap: cannot register %s: %s", key, exc)
            return False
        return dict.__contains__(self, key)

    def __contains__(self, key: object) -> bool:
        return self._resolve(key)

    def __getitem__(self, key: str) -> Any:
        self._resolve(key)
        return dict.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if self._resolve(key) else default


def installed() -> bool:
    """Whether transformers' config registry resolves ``normswap_*`` types now."""
    mapping = getattr(sys.modules.get(CONFIG_AUTO), "CONFIG_MAPPING", None)
    return isinstance(getattr(mapping, "_extra_content", None), LazyRegistry)


def patch_registry() -> None:
    mapping = getattr(sys.modules.get(CONFIG_AUTO), "CONFIG_MAPPING", None)
    extra = getattr(mapping, "_extra_content", None)
    if isinstance(extra, dict) and not isinstance(extra, LazyRegistry):
        mapping._extra_content = LazyRegistry(extra)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of transformers' config registry module so the registry
    is patched right after that module runs, then leaves ``sys.meta_path``."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != CONFIG_AUTO:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            if not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchAfter(spec.loader)
            if spec is not None:
                return spec
        return None


class _PatchAfter(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        patch_registry()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def install() -> None:
    """Make ``AutoConfig``/``AutoModel*`` understand ``normswap_*`` model types (idempotent): now, if
    transformers' registry is imported, else the moment it is."""
    if CONFIG_AUTO in sys.modules:
        patch_registry()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
