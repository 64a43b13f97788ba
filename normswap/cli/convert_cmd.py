"""``normswap convert MODEL --out DIR``: convert a model on disk (or a preset) into a checkpoint.

Exit codes: see :mod:`normswap.cli.common` (the table in docs/cli.md). ``inspect`` and ``verify`` live
in their own modules; the option values all three share are in ``common``.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import click

from normswap.cli import main
from normswap.cli.common import (
    DTYPES,
    EXIT_CODES,
    PRESET_NAMES,
    VERIFY_DTYPES,
    check_model_name,
    cli_words,
    figures_line,
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
from normswap.errors import NormswapError
from normswap.options import check_inputs_outside, check_out_dir


def _shard_size(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from normswap.options import parse_size  # torch-free: an argument error answers at once

    try:
        parse_size(value)
    except NormswapError as exc:
        raise click.BadParameter(str(exc)) from exc
    return value


def _out_dir(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not value.strip():  # `--out "$DIR"` with DIR unset: refuse, rather than read it as the current directory
        raise click.BadParameter("empty; give the directory to write to (`.` for the current one)")
    return value


# ``normswap: `NAME` converted approximately (REASON); relative output error E. ADVICE`` (pipeline.report_warnings)
_APPROXIMATE = re.compile(r"`(?P<name>[^`]+)` converted approximately \((?P<reason>.*)\); "
                          r"relative output error (?P<error>\S+)\. .*", re.S)
GROUP_APPROXIMATE_FROM = 4  # this many approximate-norm warnings or more print as one line


def _echo_warnings(caught: list[warnings.WarningMessage], quiet: bool = False) -> None:
    """Print the library's warnings in CLI words. A deep Post-LN model's per-norm "converted
    approximately" warnings (one per layer, alike but for the name) become one line with the count,
    the error range and the worst norm; the manifest and ``normswap inspect`` keep each reason."""
    texts = [str(w.message)[len("normswap:"):].strip() for w in caught if str(w.message).startswith("normswap:")]
    approximate = [m for m in map(_APPROXIMATE.fullmatch, texts) if m]
    grouped = len(approximate) >= GROUP_APPROXIMATE_FROM
    for text in texts:
        if not (grouped and _APPROXIMATE.fullmatch(text)):
            say("warning", text, quiet)
    if grouped:
        errors = [float(m["error"]) for m in approximate]
        worst = approximate[errors.index(max(errors))]
        say("warning",
            f"{len(approximate)} LayerNorm(s) converted approximately, relative output error "
            f"{min(errors):.3g}-{max(errors):.3g} (largest at `{worst['name']}`: {worst['reason']}). "
            "Use --mode exact to keep them as LayerNorm, or recover accuracy with `normswap finetune`; "
            "`normswap inspect` lists each norm with its reason", quiet)


def _recovery_note(plan: Any, calibration_data: str | None) -> str | None:
    """What a user with approximate norms and no calibration data of their own can do next."""
    if plan is None or calibration_data is not None:
        return None
    n = sum(1 for sp in plan.sites if sp.convert and sp.verdict == "approximate")
    if not n:
        return None
    return (
        f"{n} approximate (Post-LN) norm(s) were fitted without your data: --calibration-data FILE "
        "(text like your real inputs) fits them to what the model will see, usually lowering the "
        "error above; for more, the fine-tune recipes distil the converted model towards the "
        "original (`normswap finetune --list`)"
    )


# ------------------------------------------------------------------------------------ convert
CONVERT_EPILOG = f"""\b
Examples:
  normswap convert tiny-gpt2 --out ./tiny-gpt2-rms
  normswap convert ./my-gpt2 --out ./my-gpt2-rms --max-shard-size 2GB
  normswap convert gpt2 --out gpt2-compat --format compat      # stock transformers, no normswap needed
  normswap convert ./bert --out bert-rms --mode all --calibration-data corpus.jsonl
  normswap convert ./big-model --out big-rms --low-memory --dtype bfloat16
  normswap convert ./my-vlm --out vlm-rms --example-inputs inputs.safetensors   # inputs from a file
  normswap convert ./my-asr --out asr-rms --sample clip.wav        # the model's processor on a sample
  normswap convert gpt2 --out gpt2-rot --format compat --rotate hadamard   # rotated, stock transformers
  normswap convert gpt2 --out gpt2-w4 --rotate learned --learn-bits 4 --learn-group-size 32   # Q from data
  normswap convert ./my-vit --out vit-torchao --quantizer torchao   # the options torchao int8 was measured to need

\b
Then load it:
  python -c "import normswap; m = normswap.load('tiny-gpt2-rms'); print(m)"

\b
Presets (offline, seeded tiny models with tokenizers/processors):
  {", ".join(PRESET_NAMES)}

{EXIT_CODES}"""


class _ConvertCommand(click.Command):
    """``convert``, whose missing ``--out`` names the fix when the output was given as a second argument
    (``normswap convert gpt2 gpt2-rms``, as ``cp`` takes it): click alone says "Missing option '--out'"."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = list(args)
        try:
            return super().parse_args(ctx, args)
        except click.MissingParameter as exc:
            if exc.param is None or exc.param.name != "out":
                raise
            valued = {o for p in self.params if isinstance(p, click.Option) and not p.is_flag and p.nargs == 1
                      for o in p.opts}
            positional = [a for i, a in enumerate(given)
                          if not a.startswith("-") and not (i and given[i - 1] in valued)]
            if len(positional) != 2:
                raise
            raise click.UsageError(
                f"Missing option '--out': the output directory is an option, not a second argument: "
                f"normswap convert {positional[0]} --out {positional[1]}", ctx) from None


@main.command("convert", cls=_ConvertCommand, epilog=CONVERT_EPILOG)
@click.argument("model")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), callback=_out_dir,
              help="Output directory.")
@plan_options
@click.option(
    "--dtype",
    type=click.Choice(DTYPES),
    default="auto",
    show_default=True,
    help="Output dtype (auto = the checkpoint's). Surgery is float64 either way.",
)
@click.option(
    "--calibration-data",
    type=click.Path(dir_okay=False),
    default=None,
    help="Text file (one sample per line) or JSONL with a 'text' field, to fit approximate norms.",
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    callback=_shard_size,
    help="Largest safetensors shard, e.g. 500MB, 2GB.",
)
@memory_options
@click.option(
    "--overwrite", is_flag=True, help="Replace a non-empty --out (only once the new output is complete)."
)
@click.option("--no-verify", is_flag=True, help="Skip verification (conversion and reload checks).")
@click.option(
    "--verify-dtype",
    type=click.Choice(VERIFY_DTYPES),
    default="auto",
    show_default=True,
    help="What the working copy is analysed and verified in. auto: float64 where the predicted peak with a "
    "float64 copy fits in the available memory, else float32 (the output says which, why, and the "
    "tolerance); float64: refuse when it does not fit; float32: less memory, a looser tolerance.",
)
@click.option(
    "--allow-unusable",
    is_flag=True,
    help="Write the result even when its held-out figures say it is unusable (embedding cosine < 0.9 "
    "or top-1 agreement < 0.5 against the original); default: exit 4, nothing written.",
)
@source_options
@rotation_options
@example_input_options
@click.option("--quiet", "-q", is_flag=True,
              help="Errors only on stderr: no progress, notes or warnings (the results still go to stdout).")
@handle_errors
def convert(model: str, out: str, **params: Any) -> None:
    """Convert MODEL's LayerNorms to RMSNorm and write a checkpoint to --out.

    MODEL is a Hugging Face Hub id, a local model directory, or a preset name. The output is
    written atomically: into a temporary directory beside --out, renamed at the end; a failed or
    interrupted run leaves nothing behind (Ctrl-C after the rename says the output is complete).
    """
    check_model_name(model)
    calibration_data, low_memory, quiet = params["calibration_data"], params["low_memory"], params["quiet"]
    apply_quantizer(params, click.get_current_context())  # --format as the engine needs it, unless given
    check_combination(params, calibration_data=calibration_data, low_memory=low_memory, model=model)
    # a usage error, answered before torch is imported (a Hub id's overlap is checked once it is resolved)
    check_out_dir(out, overwrite=params["overwrite"], source=model if os.path.isdir(model) else None)
    check_inputs_outside(out, {"--calibration-data": (calibration_data,) if calibration_data else (),
                               "--example-inputs": (params["example_inputs"],) if params["example_inputs"] else (),
                               "--sample": params["samples"]}, out_option="--out")
    from normswap.checkpoint.conversion import convert as run
    from normswap.options import ConvertOptions

    given_inputs = inputs_from(params["example_inputs"], params["samples"])
    options = ConvertOptions(**conversion_options(params, verify=not params["no_verify"],
                                                  verify_dtype=params["verify_dtype"],
                                                  allow_unusable=params["allow_unusable"]))
    fmt = params["fmt"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = run(
            model,
            out,
            options=options,
            format=fmt,
            dtype=params["dtype"],
            calibration_data=calibration_data,
            max_shard_size=params["max_shard_size"],
            low_memory=low_memory,
            trust_remote_code=params["trust_remote_code"],
            overwrite=params["overwrite"],
            task=params["task"],
            allow_pickle=params["allow_pickle"],
            allow_new_head=params["new_head"],
            revision=params["revision"],
            example_inputs=given_inputs,
            progress=not quiet,
            echo=lambda msg: say("note", msg, quiet),
        )
    _echo_warnings(caught, quiet)
    plan = report.plan
    headline = report.message + (" (streamed)" if report.streamed else "")
    if headline:
        click.echo(headline)
    if plan is not None:
        click.echo(f"plan: {plan.summary(fmt)}")
        echo_quantizer(plan, fmt, params, quiet)
        if plan.options.get("towers") or plan.options.get("sub_runs") or plan.options.get("unreached"):
            # converted by towers or sub-runs, or norms kept unreached: which run reached what, which input would
            click.echo(f"analysis inputs: {plan.options['analysis_inputs']}")
    if report.rotation is not None:
        click.echo(f"rotation: {report.rotation.headline()}")
    figs = figures_line(report.verification)
    if figs:
        click.echo(f"verification: {figs}")
    if report.verification.get("probe"):
        click.echo(f"verified on: {report.verification['probe']}")
    if report.verification.get("verify_precision"):
        click.echo(f"precision: {cli_words(report.verification['verify_precision'])}")
    note = _recovery_note(plan, calibration_data)
    if note:
        say("note", note, quiet)
    click.echo(f"wrote {fmt} checkpoint to {out}")
