"""Names and config classes of converted checkpoints: the leaf of ``normswap.checkpoint``.

``normswap_<base>`` model types, the manifest key, the generated config classes and the lookups
that both the writer and the model-class registry (``checkpoint.hf``) need. It imports nothing
else from normswap's checkpoint package, so the writer can use it without importing the
registry (whose generated classes call the writer when they save).
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from normswap.errors import NormswapError

PREFIX = "normswap_"
MANIFEST_KEY = "normswap"
# manifest key: paths of modules the source checkpoint had no tensors for and its pipeline never used
# (``source.leave_out_unused``); loading sets them to ``None`` again, as ``add_pooling_layer=False`` does
LEFT_OUT_KEY = "left_out"


def drop_modules(model: nn.Module, paths: list[str]) -> list[tuple[nn.Module, str, nn.Module]]:
    """Set each submodule at ``paths`` to ``None`` (transformers models skip a ``None`` pooler);
    returns ``(parent, name, module)`` for each one dropped (one already ``None`` is skipped), so a
    caller can put them back."""
    dropped = []
    for path in paths:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        module = getattr(parent, name)
        if module is None:
            continue
        setattr(parent, name, None)
        dropped.append((parent, name, module))
    return dropped

_CONFIGS: dict[str, type] = {}


def base_type(model_type: str) -> str | None:
    """``normswap_gpt2`` -> ``gpt2``; ``None`` for a type that is not ours."""
    return model_type[len(PREFIX) :] if model_type.startswith(PREFIX) else None


def known_type(base: str) -> bool:
    """Whether transformers knows the model type ``base`` (stock, or registered with ``AutoConfig``): what a
    native checkpoint's generated config class derives from. A model of any other type (custom code built on
    ``PreTrainedModel``, a ``trust_remote_code`` model) is saved as a custom module."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return bool(base) and not base.startswith(PREFIX) and base in CONFIG_MAPPING


def base_config_class(base: str) -> type:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not known_type(base):
        raise NormswapError(f"unknown base model type {base!r}: this transformers version does not know it")
    return CONFIG_MAPPING[base]


def config_class_for(base: str) -> type:
    """The ``normswap_<base>`` config class (created once per process)."""
    if base in _CONFIGS:
        return _CONFIGS[base]
    base_cls = base_config_class(base)
    name = f"Normswap{base_cls.__name__}"
    cls = type(
        name,
        (base_cls,),
        {
            "model_type": PREFIX + base,
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"{base_cls.__name__} of a normswap-converted checkpoint (manifest in its config).",
        },
    )
    setattr(sys.modules[__name__], name, cls)  # picklable by qualified name
    _CONFIGS[base] = cls
    register_conversion_mapping(PREFIX + base, base)
    return cls


def register_conversion_mapping(new_key: str, base_key: str) -> None:
    """Reuse the base's checkpoint key renames (v4 names on disk) for our type/class name."""
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:  # pragma: no cover - transformers < 5
        return
    mapping = get_checkpoint_conversion_mapping(base_key)
    if mapping is not None:
        register_checkpoint_conversion_mapping(new_key, mapping, overwrite=True)


def manifest_of(config: Any) -> dict | None:
    manifest = getattr(config, MANIFEST_KEY, None)
    return manifest if isinstance(manifest, dict) and manifest.get("plan") is not None else None


def prefix_of(model: nn.Module) -> str:
    prefix = getattr(model, "base_model_prefix", "") or ""
    return prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""


def one_class(target: Any, architectures: list[str] | None = None) -> Any:
    """An ``AutoModel*`` mapping's entry as one class: some configs map to several (DeiT's classifier with
    and without its teacher); transformers then takes the one ``config.architectures`` names (as is, or
    as the ``Normswap<Class>`` of a converted checkpoint), else the first."""
    if not isinstance(target, (tuple, list)):
        return target
    names = set(architectures or ())
    for cls in target:
        if cls.__name__ in names or f"Normswap{cls.__name__}" in names:
            return cls
    return target[0] if target else None


def auto_classes() -> list[type]:
    from transformers.models.auto import modeling_auto

    out = []
    for name in dir(modeling_auto):
        obj = getattr(modeling_auto, name)
        if name.startswith("AutoModel") and isinstance(obj, type) and hasattr(obj, "_model_mapping"):
            out.append(obj)
    return out
