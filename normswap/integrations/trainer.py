"""transformers' weight-decay rule treats ``normswap.RMSNorm`` parameters as norm parameters.

transformers 5.x ``Trainer.get_decay_parameter_names`` exempts parameters of ``nn.LayerNorm`` instances
(a literal list inside the method, not a registry) and parameters whose names match ``bias``,
``layernorm``, ``rmsnorm``, ``norm`` or ``*_norm``. A converted GPT-2 keeps its module names
(``ln_1``, ``ln_2``, ``ln_f``), which match neither, so without this its RMSNorm weights would be
decayed while the original's LayerNorm weights were not.

:func:`register` (called by ``normswap.patch`` and by every load of a converted checkpoint; call it
yourself for ``normswap.RMSNorm`` modules you build by hand) wraps that method so it also drops the parameters of
every ``normswap.RMSNorm`` and adds the class to ``transformers.pytorch_utils.ALL_LAYERNORM_LAYERS``
(the list older Trainer versions and third-party code use). It does not import transformers: when
``transformers.trainer`` is not imported yet, a one-shot import hook applies the wrap right after
it is. A subclass that overrides ``get_decay_parameter_names`` keeps its own rule.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

from torch import nn

_TARGET = "transformers.trainer"
_MARK = "_normswap_wrapped"


def norm_parameter_names(model: nn.Module) -> set[str]:
    """Qualified names of the parameters owned by ``normswap.RMSNorm`` modules in ``model``."""
    from normswap.nn.rmsnorm import RMSNorm

    names = set()
    for mname, module in model.named_modules():
        if isinstance(module, RMSNorm):
            for pname, _ in module.named_parameters(recurse=False):
                names.add(f"{mname}.{pname}" if mname else pname)
    return names


def decay_parameter_names(model: nn.Module) -> list[str]:
    """What a Trainer decays in ``model``: transformers' rule, with RMSNorm parameters exempt."""
    from transformers import Trainer

    return Trainer.get_decay_parameter_names(None, model)  # the method does not use self


def _wrap(trainer_module: Any) -> None:
    from normswap.nn.rmsnorm import RMSNorm

    trainer_cls = trainer_module.Trainer
    original = trainer_cls.get_decay_parameter_names
    if not getattr(original, _MARK, False):
        def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
            exempt = norm_parameter_names(model)
            return [n for n in original(self, model) if n not in exempt]

        get_decay_parameter_names.__doc__ = original.__doc__
        get_decay_parameter_names.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(get_decay_parameter_names, _MARK, True)
        trainer_cls.get_decay_parameter_names = get_decay_parameter_names
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    layers = getattr(pytorch_utils, "ALL_LAYERNORM_LAYERS", None)
    if isinstance(layers, list) and RMSNorm not in layers:
        layers.append(RMSNorm)


class _WrapAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when ``transformers.trainer`` is about to load, wraps its loader so the
    decay rule is patched right after the module executes, then removes itself."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[override]
        if fullname != _TARGET:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            try:
                _wrap(module)
            except Exception:  # never break the user's import of transformers
                pass

        loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


_hook = _WrapAfterImport()


def register() -> None:
    """Make transformers' weight-decay rule exempt ``normswap.RMSNorm`` parameters (idempotent)."""
    module = sys.modules.get(_TARGET)
    if module is not None and hasattr(module, "Trainer"):
        _wrap(module)
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
