"""normswap: convert LayerNorm to RMSNorm in Hugging Face and custom PyTorch models.

Exact where the math allows (every writer of a norm's input stream centered by fp64 weight
surgery), honest where it doesn't (Post-LN norms are marked approximate, with measured error).

The public names below are imported on first use, so ``import normswap`` (and ``normswap --help``)
does not pay for torch and transformers until something needs them. Two hooks still take effect
at ``import normswap``: ``AutoModel*.from_pretrained`` understands ``normswap_*`` checkpoints, and
transformers' Trainer exempts RMSNorm parameters from weight decay; both are installed the moment
transformers is imported (at once, if it already is).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from typing import Any

from normswap.errors import NormswapError

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "ConvertOptions": "normswap.options",
    "Report": "normswap.api",
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


def _install_hooks() -> None:
    from normswap.checkpoint.hf import install_lazy_registration
    from normswap.integrations import saving, trainer

    install_lazy_registration()
    trainer.register()
    saving.register()  # patch() gives HF models a save_pretrained that writes a native checkpoint


class _OnTransformers(importlib.abc.MetaPathFinder):
    """Installs the hooks when ``transformers`` is first imported, then steps aside."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == "transformers":
            sys.meta_path.remove(self)
            _install_hooks()
        return None


if "transformers" in sys.modules:
    _install_hooks()
elif not any(type(f).__name__ == "_OnTransformers" for f in sys.meta_path):
    sys.meta_path.insert(0, _OnTransformers())
