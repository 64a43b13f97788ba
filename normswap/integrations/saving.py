"""``save_pretrained`` on a model converted in memory writes a native normswap checkpoint.

Before this, ``normswap.patch(model); model.save_pretrained(d)`` (or ``Trainer.save_model``, which calls
it) wrote the stock config with RMSNorm weights under LayerNorm names: the directory loaded back with
LayerNorms and without the β that stayed on the RMSNorms (logits off by ~3.5e-2 on a tiny GPT-2).

:func:`install_save_hooks` (run by ``normswap.patch`` once the model is converted) gives the model
the class a loaded native checkpoint has (``Normswap<Class>``, a subclass of its own class whose
``save_pretrained`` stores every parameter and adds the manifest, ``model_type = normswap_<base>``,
``auto_map`` and the modeling file). The object, its modules, parameters and config are unchanged;
only ``type(model)`` becomes that subclass. ``normswap.load``, ``AutoModel*.from_pretrained`` after
``import normswap`` and ``trust_remote_code=True`` all read what it writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

_SUBCLASSES: dict[type, type] = {}


def _save_pretrained(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """``save_pretrained`` that writes a complete native normswap checkpoint (``Trainer`` uses it too)."""
    from normswap.checkpoint import writer

    if kwargs.get("state_dict") is None:
        kwargs["state_dict"] = writer.state_dict_for_save(self)
    ours = next(c for c in type(self).__mro__ if c in _SUBCLASSES.values())
    result = super(ours, self).save_pretrained(save_directory, *args, **kwargs)
    if kwargs.get("is_main_process", True):
        writer.finish_native_dir(self, Path(save_directory))
    return result


def saving_class(cls: type, base: str) -> type:
    """The class a converted instance of ``cls`` (a transformers model class) should have.

    For a stock transformers class it is the very class ``normswap.load`` builds for that
    architecture. For anything else (a user's subclass) it is a subclass with the same saving
    behaviour.
    """
    import transformers

    from normswap.checkpoint import hf

    if getattr(transformers, cls.__name__, None) is cls:
        return hf.model_class_for(base, cls.__name__)
    if cls not in _SUBCLASSES:
        name = f"Normswap{cls.__name__}"
        _SUBCLASSES[cls] = type(name, (cls,), {
            "config_class": hf.config_class_for(base),
            "save_pretrained": _save_pretrained,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"{cls.__name__} converted by normswap (save_pretrained writes a native checkpoint).",
        })
        globals()[name] = _SUBCLASSES[cls]
    return _SUBCLASSES[cls]


def install_save_hooks(model: nn.Module) -> bool:
    """Make ``model.save_pretrained`` write a native normswap checkpoint. Returns True when it did
    something: False for models without ``save_pretrained``/``config.model_type`` (plain modules), for
    model types transformers does not know (custom code on ``PreTrainedModel``: no native checkpoint could
    rebuild them; ``normswap.save`` writes both as custom modules) and for models that already save natively."""
    from normswap.checkpoint import hf

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not model_type or not callable(getattr(model, "save_pretrained", None)):
        return False
    if hf.base_type(getattr(type(model).config_class, "model_type", "") or "") is not None:
        return False  # already a normswap class (a loaded checkpoint, or patched before)
    base = hf.base_type(model_type) or model_type
    if not hf.known_type(base):
        return False  # custom code with its own model type: normswap.save writes it as a custom module
    model.__class__ = saving_class(type(model), base)
    return True
