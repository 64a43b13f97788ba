"""``normswap inspect MODEL``: what normswap would do to each norm (or a converted checkpoint's manifest)."""

from __future__ import annotations

import json
import warnings

import click

from normswap.cli import main
from normswap.cli.common import (
    EXIT_CODES,
    EXIT_NOTHING,
    MODES,
    TASK_NAMES,
    check_model_name,
    cli_words,
    fail,
    handle_errors,
)
from normswap.cli.inputs_opts import example_input_options, inputs_from

INSPECT_EPILOG = f"""\b
Examples:
  normswap inspect tiny-gpt2
  normswap inspect tiny-bert --mode exact --verbose
  normswap inspect ./my-model --json > plan.json
  normswap inspect ./my-vlm --example-inputs inputs.safetensors
  normswap inspect ./my-vit --sample cat.png
  normswap inspect ./tiny-gpt2-rms          # a converted checkpoint: shows its manifest
  normswap inspect ./my-net-rms             # normswap.save of a custom module: its manifest

{EXIT_CODES}"""


@main.command("inspect", epilog=INSPECT_EPILOG)
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (the manifest format).")
@click.option(
    "--mode",
    type=click.Choice(MODES),
    default="auto",
    show_default=True,
    help="Which norms the plan would convert.",
)
@click.option("--fold-gamma", is_flag=True, help="Plan γ folding too.")
@click.option("--keep-tied", is_flag=True,
              help="Plan with tied embeddings never untied (the default unties only where the plan needs it).")
@click.option(
    "--verbose",
    "-v",
    is_flag=True,
    help="Also list each norm's writers, readers and where its β went and why, every centering op and untie.",
)
@click.option("--task", type=click.Choice(TASK_NAMES), default=None, help="Model class to load.")
@click.option("--trust-remote-code", is_flag=True, help="Allow custom modeling code shipped with MODEL.")
@click.option("--allow-pickle", is_flag=True, help="Accept pickle-only (.bin) checkpoints.")
@example_input_options
@handle_errors
def inspect(
    model: str,
    as_json: bool,
    mode: str,
    fold_gamma: bool,
    keep_tied: bool,
    verbose: bool,
    task: str | None,
    trust_remote_code: bool,
    allow_pickle: bool,
    example_inputs: str | None,
    samples: tuple[str, ...],
) -> None:
    """Show what normswap would do to MODEL's norms: verdict, reason, writers and readers.

    Nothing is written and the model is not modified. For a checkpoint normswap already
    converted, the stored manifest is shown instead (no analysis).
    """
    check_model_name(model)
    from pathlib import Path

    from normswap.analysis.plan import Plan
    from normswap.checkpoint import hf, module_io, source

    fmt = None
    given_inputs = inputs_from(example_inputs, samples)
    if module_io.is_module_dir(Path(model).expanduser()):  # normswap.save of a custom module: no config.json
        manifest = module_io.read_manifest(Path(model).expanduser())
        plan = Plan.from_dict(manifest["plan"])
        cls = manifest.get("class", "?")
        header = (f"{model}: normswap checkpoint of a custom module, {cls} (manifest; load it with "
                  f"normswap.load(dir, model={cls.rpartition('.')[2]}(...)))")
    else:
        src = source.resolve(
            model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, allow_converted=True
        )
        manifest = src.config.get(hf.MANIFEST_KEY) if src.kind != "preset" else None
        if isinstance(manifest, dict) and manifest.get("plan") is not None:
            plan = Plan.from_dict(manifest["plan"])
            fmt = manifest.get("format", "native")
            header = f"{model}: normswap {fmt} checkpoint (manifest)"
        else:
            import normswap

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded, proc = source.load_model(src, task=task, dtype="auto", trust_remote_code=trust_remote_code)
                example = given_inputs(loaded, proc) if given_inputs is not None else None
                plan = normswap.plan(loaded, example, mode=mode, fold_gamma=fold_gamma,
                                     untie=False if keep_tied else None)
            header = f"{model} ({type(loaded).__name__})"
    if as_json:
        click.echo(json.dumps(plan.to_dict(), indent=2, default=str))
    else:
        click.echo(header)
        # 100 columns, whole reasons (wrapped); the reasons' advice in flags, as `convert` prints it
        click.echo(cli_words(plan.table(verbose=verbose, fmt=fmt)))
        if plan.options.get("analysis_inputs"):  # what normswap ran the model on, and how it reached every tower
            click.echo(f"analysis inputs: {plan.options['analysis_inputs']}")
    if not any(sp.convert for sp in plan.sites):
        why = "no LayerNorm found" if not plan.sites else f"no LayerNorm can be converted with --mode {mode}"
        fail(f"{model}: {why}; nothing to convert", EXIT_NOTHING)


