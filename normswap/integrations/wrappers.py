"""Models that wrap a transformers model: what ``normswap.plan`` / ``normswap.patch`` convert inside them.

A ``sentence_transformers`` model (``SentenceTransformer``, ``CrossEncoder``, ``SparseEncoder``) is a
pipeline of modules (``Transformer`` → ``Pooling`` → ``Normalize``, …) around one transformers model,
and it carries that model's tokenizer. Its LayerNorms all live in that transformers model, whose
inputs normswap can build from the config and whose tokenizer gives real text for the calibration
and the verification probe. So ``patch(SentenceTransformer(...))`` converts that inner model in
place (the pipeline object then computes with it) instead of asking for ``example_inputs``.

``torch.compile(model)`` returns an ``OptimizedModule`` that holds the model as ``_orig_mod``: that
model is converted in place, and the compiled object recompiles on its next call (its guards see the
new modules).

A leaf module (no normswap imports; transformers only inside :func:`inner_model`): :mod:`normswap.pipeline`
calls :func:`inner_model`, and nothing here imports ``sentence_transformers`` (the wrapper is
recognised by the module its class comes from).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

WRAPPER_PACKAGES = ("sentence_transformers",)


@dataclass
class Wrapped:
    """The transformers model inside a wrapper, where it sits, and the wrapper's tokenizer."""

    model: nn.Module
    path: str  # its name among the wrapper's modules, e.g. "0.auto_model"
    wrapper: str  # the wrapper's class name
    tokenizer: Any = None


def is_wrapper(model: nn.Module) -> bool:
    """True for a model object of a known wrapping library (see :data:`WRAPPER_PACKAGES`)."""
    return type(model).__module__.split(".")[0] in WRAPPER_PACKAGES


def peft_part(model: nn.Module) -> str | None:
    """Where ``model`` holds PEFT adapters, as a message's subject (``"PeftModel is a PEFT model
    (PeftModel)"``, ``"module `h.0.attn.c_attn` is a PEFT adapter layer (Linear)"``), else None.
    ``patch`` refuses such a model (adapters must be merged first), and ``save`` too: PEFT's own
    ``save_pretrained`` writes the adapters alone."""
    for name, module in model.named_modules():
        if hasattr(module, "peft_config") or hasattr(module, "lora_A"):  # PeftModel / a LoRA layer
            where = f"module `{name}` is a PEFT adapter layer" if name else f"{type(model).__name__} is a PEFT model"
            return f"{where} ({type(module).__name__})"
    return None


def is_compiled(model: nn.Module) -> bool:
    """True for what ``torch.compile(module)`` returns (an ``OptimizedModule`` around ``_orig_mod``)."""
    return type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module)


_PARALLEL = ("DataParallel", "DistributedDataParallel")


def held_module(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``, its ``_orig_mod``) or a
    ``torch.nn.parallel`` ``DataParallel`` / ``DistributedDataParallel`` wrapper (its ``module``) holds,
    through any nesting; ``model`` itself when it is none of these. What ``normswap.save`` writes and
    ``normswap.load(dir, model=...)`` loads into: the wrappers' own state-dict keys (``_orig_mod.``,
    ``module.``) and class names belong to no checkpoint. ``patch`` converts the same module inside a
    compiled one (:func:`inner_model`)."""
    while True:
        if is_compiled(model):
            model = model._orig_mod
        elif (type(model).__name__ in _PARALLEL and type(model).__module__.startswith("torch.nn.parallel")
              and isinstance(getattr(model, "module", None), nn.Module)):
            model = model.module
        else:
            return model


def inner_model(model: nn.Module) -> Wrapped | None:
    """The one transformers model inside a known wrapper, or None when ``model`` is no such wrapper
    or holds no transformers model.

    Raises:
        ValueError: the wrapper holds several transformers models (convert each one yourself).
    """
    if is_compiled(model):  # dynamo's guards see the swapped modules, so the next call recompiles
        return Wrapped(model._orig_mod, "_orig_mod", "torch.compile'd module")
    if not is_wrapper(model):
        return None
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, module))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f"`{n}`" for n, _ in found)
        raise ValueError(f"{type(model).__name__} holds {len(found)} transformers models ({names}); "
                         "convert each with normswap.patch(model.get_submodule(name))")
    path, inner = found[0]
    return Wrapped(inner, path, type(model).__name__, getattr(model, "tokenizer", None))
