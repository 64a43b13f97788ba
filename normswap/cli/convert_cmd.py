"""``normswap convert``, ``normswap inspect`` and ``normswap verify``.

Exit codes (all three commands):

* 0 - success
* 1 - error: bad input, I/O failure, anything else (one line on stderr, nothing written)
* 2 - invalid command line (unknown option, invalid option value)
* 3 - nothing to convert (no LayerNorm, none convertible in this mode, or already converted)
* 4 - verification failed: an exact conversion missed its tolerance, or an approximate one is
  unusable (held-out cosine < 0.9 or top-1 agreement < 0.5; --allow-unusable writes it) (nothing written)
* 130 - interrupted (Ctrl-C / SIGTERM); nothing written
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import click

from normswap.cli import main
from normswap.cli.common import (  # noqa: F401 - EXIT_* re-exported for callers of this module
    EXIT_CODES,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_NOTHING,
    EXIT_USAGE,
    EXIT_VERIFY,
    cli_words,
    fail,
    handle_errors,
)
from normswap.errors import NormswapError

# normswap.presets.names(), spelled out so that --help does not import torch (a test keeps it true)
PRESET_NAMES = ('tiny-bert', 'tiny-bloom', 'tiny-gpt2', 'tiny-opt', 'tiny-phi', 'tiny-vit', 'tiny-whisper')
MODES = ("auto", "exact", "all")
DTYPES = ("auto", "float32", "bfloat16", "float16")
TASK_NAMES = (
    "causal-lm",
    "seq2seq-lm",
    "speech-seq2seq",
    "masked-lm",
    "sequence-classification",
    "token-classification",
    "question-answering",
    "image-classification",
    "audio-classification",
    "ctc",
    "base",
)


def _shard_size(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from normswap.checkpoint.io import parse_size

    try:
        parse_size(value)
    except NormswapError as exc:
        raise click.BadParameter(str(exc)) from exc
    return value


def _echo_warnings(caught: list[warnings.WarningMessage]) -> None:
    for w in caught:
        text = str(w.message)
        if text.startswith("normswap:"):
            click.echo(f"warning: {cli_words(text[len('normswap:') :].strip())}", err=True)


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


def _figures(verification: dict[str, Any]) -> str:
    keep = (
        "max_abs_error",
        "max_rel_error",
        "kl",
        "top1_agreement",
        "max_stream_mean_ratio",
        "in_model_dtype",
        "reload_bitwise_equal",
        "reload_max_abs_diff",
        "reload_vs_original_max_rel_error",
        "truncated_max_rel_error",
        "truncated_top1_agreement",
        "truncated_layers",
    )
    parts = []
    for key in keep:
        if key in verification:
            v = verification[key]
            if key == "kl" and isinstance(v, float) and v < 0:
                v = 0.0  # KL is >= 0; a tiny negative value is float rounding, not information
            parts.append(f"{key}={v:.3g}" if isinstance(v, float) else f"{key}={v}")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------ convert
CONVERT_EPILOG = f"""\b
Examples:
  normswap convert tiny-gpt2 --out ./tiny-gpt2-rms
  normswap convert ./my-gpt2 --out ./my-gpt2-rms --max-shard-size 2GB
  normswap convert gpt2 --out gpt2-compat --format compat      # stock transformers, no normswap needed
  normswap convert ./bert --out bert-rms --mode all --calibration-data corpus.jsonl
  normswap convert ./big-model --out big-rms --low-memory --dtype bfloat16

\b
Then load it:
  python -c "import normswap; m = normswap.load('tiny-gpt2-rms'); print(m)"

\b
Presets (offline, seeded tiny models with tokenizers/processors):
  {", ".join(PRESET_NAMES)}

{EXIT_CODES}"""


@main.command("convert", epilog=CONVERT_EPILOG)
@click.argument("model")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option(
    "--mode",
    type=click.Choice(MODES),
    default="auto",
    show_default=True,
    help="exact: only exact norms; all: also Post-LN (approximate); auto: all, with warnings.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["native", "compat"]),
    default="native",
    show_default=True,
    help="native: RMSNorm modules + manifest; compat: stock architecture, LayerNorms kept, exact.",
)
@click.option("--fold-gamma", is_flag=True, help="Also fold γ into reader weights (RMSNorm weight = 1).")
@click.option(
    "--keep-tied",
    "--no-untie",
    "keep_tied",
    is_flag=True,
    help="Keep tied embeddings (exact too: one centering op per token at run time) instead of "
    "untying them, which grows the checkpoint by the size of the embedding (GPT-2: about +50%).",
)
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
@click.option(
    "--low-memory/--in-memory",
    "low_memory",
    default=None,
    help="Stream tensors shard by shard (default: automatic when the checkpoint is larger "
    "than about half of the available RAM).",
)
@click.option("--trust-remote-code", is_flag=True, help="Allow custom modeling code shipped with MODEL.")
@click.option(
    "--allow-pickle", is_flag=True, help="Accept pickle-only (.bin) checkpoints. Only for trusted files."
)
@click.option(
    "--overwrite", is_flag=True, help="Replace a non-empty --out (only once the new output is complete)."
)
@click.option("--no-verify", is_flag=True, help="Skip verification (conversion and reload checks).")
@click.option(
    "--allow-unusable",
    is_flag=True,
    help="Write the result even when its held-out figures say it is unusable (embedding cosine < 0.9 "
    "or top-1 agreement < 0.5 against the original); default: exit 4, nothing written.",
)
@click.option(
    "--task",
    type=click.Choice(TASK_NAMES),
    default=None,
    help="Model class to load (default: from config.architectures).",
)
@click.option(
    "--new-head",
    is_flag=True,
    help="With --task: allow a task head the checkpoint lacks (random init, recorded in the "
    "manifest). Without it any missing tensor is an error.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@handle_errors
def convert(
    model: str,
    out: str,
    mode: str,
    fmt: str,
    fold_gamma: bool,
    keep_tied: bool,
    dtype: str,
    calibration_data: str | None,
    max_shard_size: str,
    low_memory: bool | None,
    trust_remote_code: bool,
    allow_pickle: bool,
    overwrite: bool,
    no_verify: bool,
    allow_unusable: bool,
    task: str | None,
    new_head: bool,
    quiet: bool,
) -> None:
    """Convert MODEL's LayerNorms to RMSNorm and write a checkpoint to --out.

    MODEL is a Hugging Face Hub id, a local model directory, or a preset name. The output is
    written atomically: into a temporary directory beside --out, renamed at the end; a failed or
    interrupted run leaves nothing behind.
    """
    from normswap.checkpoint.conversion import convert as run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = run(
            model,
            out,
            format=fmt,
            mode=mode,
            fold_gamma=fold_gamma,
            untie=not keep_tied,
            dtype=dtype,
            calibration_data=calibration_data,
            max_shard_size=max_shard_size,
            low_memory=low_memory,
            trust_remote_code=trust_remote_code,
            overwrite=overwrite,
            verify=not no_verify,
            allow_unusable=allow_unusable,
            task=task,
            allow_pickle=allow_pickle,
            allow_new_head=new_head,
            progress=not quiet,
            echo=lambda msg: click.echo(f"note: {cli_words(msg)}", err=True),
        )
    _echo_warnings(caught)
    plan = report.plan
    headline = report.message.split("; wrote")[0].replace(" by streaming", " (streamed)")
    if headline:
        click.echo(headline)
    if plan is not None:
        click.echo(f"plan: {plan.summary()}")
    figs = _figures(report.verification)
    if figs:
        click.echo(f"verification: {figs}")
    note = _recovery_note(plan, calibration_data)
    if note:
        click.echo(f"note: {note}", err=True)
    click.echo(f"wrote {fmt} checkpoint to {out}")


# ------------------------------------------------------------------------------------ inspect
INSPECT_EPILOG = f"""\b
Examples:
  normswap inspect tiny-gpt2
  normswap inspect tiny-bert --mode exact --verbose
  normswap inspect ./my-model --json > plan.json
  normswap inspect ./tiny-gpt2-rms          # a converted checkpoint: shows its manifest

{EXIT_CODES}"""


def _shorten(items: list[str], width: int) -> str:
    text = ", ".join(items) if items else "-"
    return text if len(text) <= width else text[: width - 1] + "…"


def plan_table(plan: Any, *, verbose: bool = False) -> str:
    """Per-norm table: norm, verdict, fold, writers, readers, reason."""
    header = ("norm", "verdict", "convert", "fold", "writers", "readers", "reason")
    rows = []
    for s in plan.sites:
        fold = "+".join(x for x, on in (("β", s.fold_beta), ("γ", s.fold_gamma)) if on) or "-"
        rows.append(
            (
                s.name,
                s.verdict,
                "yes" if s.convert else "no",
                fold,
                str(len(s.writers)),
                _shorten(s.readers, 40),
                s.reason,
            )
        )
    for sk in plan.skipped:
        rows.append((sk["name"], "skipped", "no", "-", "-", "-", sk["reason"]))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(6)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(6)) + "  " + r[6] for r in [header, *rows]]
    lines.insert(1, "-" * min(160, sum(widths) + 12 + 40))
    if verbose:
        for s in plan.sites:
            lines += [
                "",
                f"{s.name} ({s.verdict}, eps={s.eps:g}, shape={s.normalized_shape}, {s.flavour})",
                f"  writers: {', '.join(s.writers) or '-'}",
                f"  readers: {', '.join(s.readers) or '-'}",
            ]
        for h in plan.hooks:
            lines.append(
                f"centering op: {h.module} ({h.where}{'' if h.arg is None else ' ' + str(h.arg)}): {h.reason}"
            )
        for u in plan.unties:
            lines.append(f"untie: {u.module}.{u.attr} from {u.source} (+{u.numel:,} params)")
    lines += ["", plan.summary()]
    if plan.changed_outputs:
        lines.append("changed by design (raw residual stream): " + ", ".join(plan.changed_outputs))
    return "\n".join(lines)


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
@click.option("--keep-tied", is_flag=True, help="Plan with tied embeddings kept.")
@click.option("--verbose", "-v", is_flag=True, help="List every writer and reader, centering op and untie.")
@click.option("--task", type=click.Choice(TASK_NAMES), default=None, help="Model class to load.")
@click.option("--trust-remote-code", is_flag=True, help="Allow custom modeling code shipped with MODEL.")
@click.option("--allow-pickle", is_flag=True, help="Accept pickle-only (.bin) checkpoints.")
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
) -> None:
    """Show what normswap would do to MODEL's norms: verdict, reason, writers and readers.

    Nothing is written and the model is not modified. For a checkpoint normswap already
    converted, the stored manifest is shown instead (no analysis).
    """
    from normswap.checkpoint import hf, source
    from normswap.plan import Plan

    src = source.resolve(
        model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, allow_converted=True
    )
    manifest = src.config.get(hf.MANIFEST_KEY) if src.kind != "preset" else None
    if isinstance(manifest, dict) and manifest.get("plan") is not None:
        plan = Plan.from_dict(manifest["plan"])
        header = f"{model}: normswap {manifest.get('format', 'native')} checkpoint (manifest)"
    else:
        import normswap

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded, _ = source.load_model(src, task=task, dtype="auto", trust_remote_code=trust_remote_code)
            plan = normswap.plan(loaded, mode=mode, fold_gamma=fold_gamma, untie=not keep_tied)
        header = f"{model} ({type(loaded).__name__})"
    if as_json:
        click.echo(json.dumps(plan.to_dict(), indent=2, default=str))
    else:
        click.echo(header)
        click.echo(plan_table(plan, verbose=verbose))
    if not any(sp.convert for sp in plan.sites):
        why = "no LayerNorm found" if not plan.sites else f"no LayerNorm can be converted with --mode {mode}"
        fail(f"{model}: {why}; nothing to convert", EXIT_NOTHING)


# ------------------------------------------------------------------------------------ verify
VERIFY_EPILOG = f"""\b
Examples:
  normswap verify tiny-gpt2 ./tiny-gpt2-rms
  normswap verify ./gpt2 ./gpt2-rms --data prompts.txt
  normswap verify ./bert ./bert-rms --json

\b
Exit code 4 when every converted norm is exact but the outputs differ by more than
the tolerance for the dtype (float32: 2e-3 relative; --tolerance overrides).
Approximate conversions only report their error.

{EXIT_CODES}"""


@main.command("verify", epilog=VERIFY_EPILOG)
@click.argument("original")
@click.argument("converted", type=click.Path())
@click.option(
    "--data",
    type=click.Path(dir_okay=False),
    default=None,
    help="Evaluation inputs to compare the two models on: a text file (one sample per line) or "
    "JSONL with a 'text' field (default: random valid inputs).",
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
    help="Max relative error for exact conversions (default depends on dtype).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option("--task", type=click.Choice(TASK_NAMES), default=None, help="Model class for ORIGINAL.")
@click.option("--trust-remote-code", is_flag=True, help="Allow custom modeling code shipped with ORIGINAL.")
@click.option("--allow-pickle", is_flag=True, help="Accept a pickle-only ORIGINAL.")
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
) -> None:
    """Compare ORIGINAL's outputs with CONVERTED's (a directory written by normswap convert)."""
    from normswap.checkpoint.verify_dirs import verify_checkpoint

    result = verify_checkpoint(
        original,
        converted,
        data=data,
        tolerance=tolerance,
        task=task,
        trust_remote_code=trust_remote_code,
        allow_pickle=allow_pickle,
        force=force,
    )
    if result["source_match"] is False:
        click.echo("warning: CONVERTED was made from another model (--force)", err=True)
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
    else:
        click.echo(f"{result['kind']} conversion, {result['batches']} batch(es), dtype {result['dtype']}")
        click.echo(f"figures: {_figures(result['figures'])}")
        click.echo(result["verdict"])
    if not result["ok"]:
        fail(f"verification failed: {result['verdict']}", EXIT_VERIFY)
