"""``normswap.plan`` and ``normswap.patch``: the in-memory conversion as users call it.

The work is :mod:`normswap.pipeline`'s (analysis, surgery, verification, commit, on a working copy).
What this layer adds is what a model converted in memory needs from the libraries around it, set up
when (and only when) a model is converted, not at ``import normswap``:

* transformers' ``Trainer`` exempts ``normswap.RMSNorm`` parameters from weight decay, as it exempts
  LayerNorm ones (:mod:`normswap.integrations.trainer`);
* ``model.save_pretrained(dir)`` (and ``Trainer.save_model``) on a converted transformers model
  writes a native normswap checkpoint (:mod:`normswap.integrations.saving`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from normswap import inputs, pipeline
from normswap.analysis.plan import Plan
from normswap.integrations import saving, trainer
from normswap.options import ConvertOptions
from normswap.pipeline import Report

__all__ = ["Report", "patch", "plan"]


def plan(model: nn.Module, example_inputs: inputs.ExampleInputs = None, *,
         options: ConvertOptions | None = None, **keywords: Any) -> Plan:
    """Dry run: the per-norm verdicts and every edit ``patch`` would make. The model is untouched.

    Takes ``patch``'s options (a :class:`~normswap.ConvertOptions`, or its fields as keywords) so
    one set serves both; calibration, verify and the like do not change the plan. An unknown
    keyword is an error.
    """
    return pipeline.plan(model, example_inputs, options=options, **keywords)


def patch(model: nn.Module, example_inputs: inputs.ExampleInputs = None, *,
          options: ConvertOptions | None = None, **keywords: Any) -> Report:
    """Convert ``model``'s LayerNorms to :class:`normswap.RMSNorm`, in place, verified.

    Args:
        model: a transformers model, a sentence-transformers model (its transformers model is
            converted in place, with its tokenizer), a ``torch.compile``'d module (the module inside
            is converted; the compiled object recompiles on its next call), or any ``nn.Module``.
            A model built under ``torch.inference_mode()`` works too: its inference tensors, which
            cannot be edited outside that mode, are first replaced by ordinary copies (same values,
            ties kept); ``patch`` itself is called outside such a block.
        example_inputs: inputs for the analysis run (built automatically for transformers models:
            every modality in one run of the whole model; where no such layout runs, a multimodal
            model is analysed per tower, each tower through its own feature method and the rest on
            text, said in ``report.plan.options["analysis_inputs"]``: :mod:`normswap.inputs.towers`).
            LayerNorms those inputs never call are reached by sub-runs of a submodule around them, or
            kept as LayerNorm (exact) with the input that would reach them named in the report
            (``options["sub_runs"]``, ``options["unreached"]``: :mod:`normswap.inputs.reach`).
        options: a :class:`~normswap.ConvertOptions` (mode, fold_gamma, untie, per_norm_centering,
            mean_carry, calibration, sequential, tokenizer, verify, allow_unusable, backend, quantizer; see
            its docstring for each). Its fields may be given as keywords instead:
            ``patch(model, mode="exact")``. An unknown keyword is an error. ``quantizer="torchao"`` (an engine
            of :mod:`normswap.quantizers`) plans with the options that engine was measured to need on this
            kind of model; a keyword given beside it wins (``report.plan.options["quantizer"]`` says which).

    Returns:
        A :class:`Report` with per-norm verdicts, verification figures and the calibration used.

    Raises:
        NormswapError: bad input or failed verification; the model is left unchanged.
        calibrate.UnusableConversion: the approximate conversion is unusable (``exit_code`` 4).
    """
    return pipeline.patch(model, example_inputs, options=options, on_commit=_integrate, **keywords)


def _integrate(model: nn.Module) -> None:
    trainer.register()  # Trainer: RMSNorm parameters are norm parameters (no weight decay)
    saving.install_save_hooks(model)  # save_pretrained writes a native checkpoint
