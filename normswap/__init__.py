"""normswap: convert LayerNorm to RMSNorm in Hugging Face and custom PyTorch models.

Exact where the math allows (every writer of a norm's input stream centered by fp64 weight
surgery), honest where it doesn't (Post-LN norms are marked approximate, with measured error).

The public names below are imported on first use, so ``import normswap`` (and ``normswap --help``)
does not pay for torch and transformers until something needs them. One hook takes effect at
``import normswap``: ``AutoModel*.from_pretrained`` understands ``normswap_*`` checkpoints
(:mod:`normswap.integrations.auto_registry`; installed the moment transformers' config registry is
imported, at once if it already is). Everything else a converted model needs from the libraries
around it is set up by the call that converts or loads it (:mod:`normswap.api`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

from normswap.errors import NormswapError
from normswap.integrations import auto_registry

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "ConvertOptions": "normswap.options",
    "Report": "normswap.pipeline",
    "patch": "normswap.api",
    "plan": "normswap.api",
    "convert": "normswap.checkpoint",
    "load": "normswap.checkpoint",
    "save": "normswap.checkpoint",
    "RMSNorm": "normswap.nn.rmsnorm",
    "rms_norm": "normswap.nn.rmsnorm",
    "Plan": "normswap.analysis.plan",
    "plan_of": "normswap.analysis.plan",
    "Rotation": "normswap.rotation.rotate",
    "rotate": "normswap.rotation.rotate",
}

__all__ = ["NormswapError", "__version__", *sorted(_LAZY)]


class _Package(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            # ``import normswap`` used to import most submodules; keep ``normswap.api`` & co. working
            if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
                return importlib.import_module(f"{__name__}.{name}")
            raise AttributeError(f"module 'normswap' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        types.ModuleType.__setattr__(self, name, value)
        return value

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(_LAZY))


sys.modules[__name__].__class__ = _Package


auto_registry.install()
