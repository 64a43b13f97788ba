"""``normswap verify ORIGINAL CONVERTED``: compare a converted checkpoint with its source."""

from __future__ import annotations

import json

import click

from normswap.cli import main
from normswap.cli.common import (
    EXIT_CODES,
    EXIT_VERIFY,
    TASK_NAMES,
    check_input_file,
    check_model_name,
    check_output_of,
    fail,
    figures_line,
    handle_errors,
)
from normswap.cli.inputs_opts import example_input_options, inputs_from

VERIFY_EPILOG = f"""\b
Examples:
  normswap verify tiny-gpt2 ./tiny-gpt2-rms
  normswap verify ./gpt2 ./gpt2-rms --data prompts.txt
  normswap verify ./bert ./bert-rms --json
  normswap verify ./my-vlm ./vlm-rms --example-inputs inputs.safetensors

\b
Exit code 4 when every converted norm is exact but the outputs differ by more than
what the dtype explains for this model: 16x ORIGINAL's own error in CONVERTED's dtype
(measured against ORIGINAL run in float64 on the same inputs), at least 16x the dtype's
eps, at most 2e-3 (float32); --tolerance overrides. Approximate conversions only report
their error.

{EXIT_CODES}"""


@main.command("verify", epilog=VERIFY_EPILOG)
@click.argument("original")
@click.argument("converted", type=click.Path())
@click.option(
    "--data",
    type=click.Path(dir_okay=False),
    default=None,
    help="Evaluation inputs to compare the two models on: a text file (one sample per line) or "
    "JSONL with a 'text' field (default: built-in English text through ORIGINAL's tokenizer when it "
    "has one, then random valid inputs).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Compare even when CONVERTED's manifest says it was made from another model.",
)
@click.option(
    "--tolerance",
    type=click.FloatRange(min=0),
    default=None,
    help="Max relative error for exact conversions (default: 16x ORIGINAL's own error in the dtype, at most "
    "2e-3 in float32).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("--task", type=click.Choice(TASK_NAMES), default=None, help="Model class for ORIGINAL.")
@click.option("--trust-remote-code", is_flag=True, help="Allow custom modeling code shipped with ORIGINAL.")
@click.option("--allow-pickle", is_flag=True, help="Accept a pickle-only ORIGINAL.")
@example_input_options
@handle_errors
def verify(
    original: str,
    converted: str,
    data: str | None,
    tolerance: float | None,
    as_json: bool,
    task: str | None,
    trust_remote_code: bool,
    allow_pickle: bool,
    force: bool,
    example_inputs: str | None,
    samples: tuple[str, ...],
) -> None:
    """Compare ORIGINAL's outputs with CONVERTED's (a directory written by normswap convert)."""
    check_model_name(original, "ORIGINAL")
    check_output_of(converted, original)
    if data is not None:
        check_input_file(data, "--data")
    from normswap.checkpoint.verify_dirs import verify_checkpoint

    if data is not None and (example_inputs is not None or samples):
        from normswap.errors import UsageError

        raise UsageError("--data and --example-inputs/--sample both give the inputs to compare on; pass one")
    given_inputs = inputs_from(example_inputs, samples)
    result = verify_checkpoint(
        original,
        converted,
        data=data,
        tolerance=tolerance,
        task=task,
        trust_remote_code=trust_remote_code,
        allow_pickle=allow_pickle,
        force=force,
        example_inputs=given_inputs,
    )
    if result["source_match"] is False:
        click.echo("warning: CONVERTED was made from another model (--force)", err=True)
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
    else:
        click.echo(f"{result['kind']} conversion, {result['batches']} batch(es), dtype {result['dtype']}")
        click.echo(f"inputs: {result['probe']}")
        click.echo(f"precision: {result['precision']}")
        click.echo(f"figures: {figures_line(result['figures'])}")
        click.echo(result["verdict"])
    if not result["ok"]:
        fail(f"verification failed: {result['verdict']}", EXIT_VERIFY)
