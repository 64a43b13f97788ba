"""``--example-inputs`` and ``--sample``: the inputs ``convert``, ``inspect`` and ``verify`` run the model on,
read from files (:mod:`normswap.inputs.from_file`). Nothing here imports torch: ``--help`` stays fast."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from normswap.errors import UsageError

EXAMPLE_INPUTS_HELP = (
    "A .safetensors file of named tensors, passed to the model's forward as keyword arguments "
    "(input_ids, pixel_values, attention_mask, ...): for a model whose inputs normswap cannot build. "
    "Names are checked against the forward signature.")
SAMPLE_HELP = (
    "A sample the model's own processor turns into inputs: a text file (tokenizer), an image (image "
    "processor; needs Pillow) or an audio file (feature extractor; WAV read by the standard library, "
    "other formats need soundfile). Repeat for several modalities (a text prompt and an image).")


def example_input_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The two options, as one decorator (``example_inputs: str | None``, ``samples: tuple[str, ...]``)."""
    fn = click.option("--sample", "samples", multiple=True, type=click.Path(dir_okay=False), help=SAMPLE_HELP)(fn)
    return click.option("--example-inputs", "example_inputs", type=click.Path(dir_okay=False), default=None,
                        help=EXAMPLE_INPUTS_HELP)(fn)


def inputs_from(example_inputs: str | None, samples: tuple[str, ...]) -> Any:
    """The function of (model, processor) that builds the inputs these options ask for, or None. The files
    are read now: a bad one fails (exit 2) before any model loads."""
    if example_inputs is not None and samples:
        raise UsageError("--example-inputs and --sample both give the model's inputs; pass one of them")
    if example_inputs is not None:
        from normswap.inputs.from_file import from_safetensors

        return from_safetensors(example_inputs)
    if samples:
        from normswap.inputs.from_file import from_samples

        return from_samples(samples)
    return None
