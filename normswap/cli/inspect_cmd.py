"""``normswap inspect MODEL``: what normswap would do to each norm (or a converted checkpoint's manifest)."""

from __future__ import annotations

import json
import warnings
from typing import Any

import click

from normswap.cli import main
from normswap.cli.common import (
    EXIT_CODES,
    EXIT_NOTHING,
    check_model_name,
    cli_words,
    fail,
    handle_errors,
    say,
)
from normswap.cli.inputs_opts import example_input_options, inputs_from
from normswap.cli.plan_opts import (
    apply_quantizer,
    check_combination,
    conversion_options,
    echo_quantizer,
    memory_options,
    plan_options,
    rotation_options,
    source_options,
)

INSPECT_EPILOG = f"""\b
Examples:
  normswap inspect tiny-gpt2
  normswap inspect tiny-bert --mode exact --verbose
  normswap inspect ./my-model --json > plan.json
  normswap inspect gpt2 --format compat --rotate hadamard   # the plan convert makes with these
  normswap inspect ./my-vlm --example-inputs inputs.safetensors
  normswap inspect ./my-vit --sample cat.png
  normswap inspect ./big-model --low-memory  # convert --low-memory's plan, without loading the model
  normswap inspect ./tiny-gpt2-rms          # a converted checkpoint: shows its manifest
  normswap inspect ./my-net-rms             # normswap.save of a custom module: its manifest

{EXIT_CODES}"""


@main.command("inspect", epilog=INSPECT_EPILOG)
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (the manifest format).")
@click.option(
    "--verbose",
    "-v",
    is_flag=True,
    help="Also list each norm's writers, readers and where its β went and why, every centering op and untie.",
)
@plan_options
@memory_options
@source_options
@rotation_options
@example_input_options
@handle_errors
def inspect(model: str, as_json: bool, verbose: bool, **params: Any) -> None:
    """Show what normswap would do to MODEL's norms: verdict, reason, writers and readers.

    Nothing is written and the model is not modified. It takes convert's options that shape the plan
    (--format, --mode, --fold-gamma, the centering options, --untie/--keep-tied, --rotate and the rest)
    and shows the plan convert would make with them; the rotation's own settings (--seed, --smooth,
    --learn-*, --online-*) are checked as convert checks them, and the rotation is not computed. For a
    checkpoint normswap already converted, the stored manifest is shown instead (no analysis). With
    --low-memory (or automatically, where convert would stream) the model is not loaded: the plan is the one
    the streamed conversion makes, from small random-weight copies and the checkpoint's tensors.
    """
    check_model_name(model)
    apply_quantizer(params, click.get_current_context())  # --format as the engine needs it, unless given
    check_combination(params, low_memory=params["low_memory"], model=model)
    from pathlib import Path

    from normswap.analysis.plan import Plan
    from normswap.checkpoint import conversion, hf, module_io, source
    from normswap.options import ConvertOptions

    fmt, mode, manifest_fmt = None, params["mode"], None
    given_inputs = inputs_from(params["example_inputs"], params["samples"])
    if module_io.is_module_dir(Path(model).expanduser()):  # normswap.save of a custom module: no config.json
        manifest = module_io.read_manifest(Path(model).expanduser())
        plan = Plan.from_dict(manifest["plan"])
        cls = manifest.get("class", "?")
        header = (f"{model}: normswap checkpoint of a custom module, {cls} (manifest; load it with "
                  f"normswap.load(dir, model={cls.rpartition('.')[2]}(...)))")
    else:
        src = source.resolve(model, allow_pickle=params["allow_pickle"], trust_remote_code=params["trust_remote_code"],
                             allow_converted=True, revision=params["revision"])
        manifest = src.config.get(hf.MANIFEST_KEY) if src.kind != "preset" else None
        if isinstance(manifest, dict) and manifest.get("plan") is not None:
            plan = Plan.from_dict(manifest["plan"])
            fmt = manifest_fmt = manifest.get("format", "native")
            header = f"{model}: normswap {fmt} checkpoint (manifest)"
        else:
            import normswap

            fmt = params["fmt"]
            # resolved as convert resolves them for --format (β kept in a checkpoint, compat plans --mode exact)
            options = conversion.check_options(
                ConvertOptions(**conversion_options(params, verify=False)), fmt=fmt, dtype="auto",
                max_shard_size="5GB", task=params["task"], low_memory=params["low_memory"], calibration_data=None)
            mode = options.mode
            streamed = None
            if src.kind != "preset" and (params["low_memory"] or params["low_memory"] is None and given_inputs is None):
                source.check_config_fits(src, params["task"], trust_remote_code=params["trust_remote_code"])
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    streamed = conversion.streamed_plan(src, fmt=fmt, options=options, task=params["task"],
                                                        low_memory=params["low_memory"],
                                                        echo=lambda line: say("note", line),
                                                        allow_new_head=params["new_head"],
                                                        trust_remote_code=params["trust_remote_code"])
            if streamed is not None:  # as convert --low-memory plans it: the model is never loaded
                plan = streamed
                header = f"{model}, as convert --format {fmt} --low-memory plans it"
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    loaded, proc = source.load_model(src, task=params["task"], dtype="auto",
                                                     trust_remote_code=params["trust_remote_code"],
                                                     allow_new_head=params["new_head"])
                    example = given_inputs(loaded, proc) if given_inputs is not None else None
                    plan = normswap.plan(loaded, example, options=options)
                header = f"{model} ({type(loaded).__name__}), as convert --format {fmt} plans it"
    if as_json:
        click.echo(json.dumps(plan.to_dict(), indent=2, default=str))
    else:
        click.echo(header)
        # 100 columns, whole reasons (wrapped); the reasons' advice in flags, as `convert` prints it
        click.echo(cli_words(plan.table(verbose=verbose, fmt=fmt)))
        if plan.options.get("analysis_inputs"):  # what normswap ran the model on, and how it reached every tower
            click.echo(f"analysis inputs: {plan.options['analysis_inputs']}")
        echo_quantizer(plan, fmt, params if manifest_fmt is None else {})
    if not any(sp.convert for sp in plan.sites):
        why = "no LayerNorm found" if not plan.sites else f"no LayerNorm can be converted with --mode {mode}"
        fail(f"{model}: {why}; nothing to convert", EXIT_NOTHING)


