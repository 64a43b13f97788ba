"""Example inputs: what the analysis runs the model on, and what verification probes it with.

For Hugging Face models they are built from the config and the forward signature (token ids,
``pixel_values``, ``input_features``, ``input_values``, decoder ids). Custom models must pass
``example_inputs``: a tuple of positional args or a dict of kwargs.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from normswap.errors import NormswapError

ExampleInputs = tuple[Any, ...] | dict[str, Any] | torch.Tensor | None


def _cfg(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        val = getattr(config, name, None)
        if val is not None:
            return val
    return default


def _sub_config(config: Any, kind: str) -> Any:
    sub = getattr(config, f"{kind}_config", None)
    return sub if sub is not None else config


def is_hf_model(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "to_dict") and hasattr(model, "main_input_name")


def hf_example_inputs(model: nn.Module, batch: int = 2, seq: int = 8, seed: int = 0) -> dict[str, Any]:
    """Random but valid inputs for a transformers model, from its config and forward signature."""
    config = model.config
    params = inspect.signature(model.forward).parameters
    gen = torch.Generator().manual_seed(seed)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    inputs: dict[str, Any] = {}

    def token_ids(cfg: Any, length: int) -> torch.Tensor:
        vocab = int(_cfg(cfg, "vocab_size", default=100))
        max_pos = _cfg(cfg, "max_position_embeddings", "n_positions", "max_target_positions", "n_ctx")
        length = min(length, int(max_pos) - 2) if max_pos else length
        # Avoid the special ids at the bottom of the vocab (pad/bos/eos) so no masking kicks in.
        low = min(3, vocab - 1)
        return torch.randint(low, vocab, (batch, length), generator=gen).to(device)

    if "input_ids" in params:
        inputs["input_ids"] = token_ids(_sub_config(config, "text"), seq)
    if "pixel_values" in params:
        vcfg = _sub_config(config, "vision")
        size = _cfg(vcfg, "image_size", default=32)
        size = size if isinstance(size, int) else size[0]
        channels = int(_cfg(vcfg, "num_channels", default=3))
        inputs["pixel_values"] = torch.randn(batch, channels, size, size, generator=gen).to(device, dtype)
    if "input_features" in params:
        mels = int(_cfg(config, "num_mel_bins", default=80))
        frames = 2 * int(_cfg(config, "max_source_positions", default=1500))
        inputs["input_features"] = torch.randn(batch, mels, frames, generator=gen).to(device, dtype)
    if "input_values" in params:
        inputs["input_values"] = torch.randn(batch, 4000, generator=gen).to(device, dtype)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        dcfg = _sub_config(config, "decoder")
        inputs["decoder_input_ids"] = token_ids(dcfg, seq)
    if not inputs:
        raise NormswapError(
            f"cannot build example inputs for {type(model).__name__} (main input "
            f"{getattr(model, 'main_input_name', '?')!r}); pass example_inputs=(...) or a dict of kwargs"
        )
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs


def resolve(model: nn.Module, example_inputs: ExampleInputs) -> tuple[tuple, dict]:
    """Normalise user inputs (or build HF ones) into ``(args, kwargs)``."""
    if example_inputs is None:
        if not is_hf_model(model):
            raise NormswapError(
                f"{type(model).__name__} is not a transformers model, so normswap cannot guess its inputs; "
                "pass example_inputs=(tensor, ...) or example_inputs={'name': tensor}"
            )
        return (), hf_example_inputs(model)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise NormswapError(
        f"example_inputs must be a tensor, a tuple of positional args or a dict of kwargs, "
        f"not {type(example_inputs).__name__}"
    )


def cast_inputs(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """Floating-point inputs cast to ``dtype`` (ids and masks untouched)."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(dtype)
        return x

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
