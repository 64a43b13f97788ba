"""What every ``normswap`` command shares: one-line errors, exit codes, interrupts.

Exit codes (every command; the table in docs/cli.md):

* 0 - success
* 1 - error: bad input, I/O failure, disk full, anything else (one line on stderr, nothing written)
* 2 - invalid command line (unknown option, invalid option value, bad ``key=value`` override)
* 3 - nothing to convert (no LayerNorm, none convertible in this mode, or already converted)
* 4 - verification failed: the conversion misses its tolerance or is unusable (nothing written)
* 130 - interrupted (Ctrl-C / SIGTERM); the one line says what is on disk: nothing, or the complete
  output (the interrupt came after it was moved into place), or a fine-tune's checkpoints

Nothing here imports torch or transformers at module level: ``normswap --help`` and argument
errors must answer fast.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import click

from normswap import interrupts
from normswap.errors import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_NOTHING,
    EXIT_USAGE,
    EXIT_VERIFY,
    NormswapError,
    first_line,
)
from normswap.options import (
    BETA_PLACEMENTS,
    DTYPES,
    FORMATS,
    LAYER_SCALES,
    MODES,
    ROTATIONS,
    STEM_CENTERINGS,
    TASKS,
    VERIFY_DTYPES,
    WRITER_CENTERINGS,
)

__all__ = [
    "EXIT_CODES",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_NOTHING",
    "EXIT_USAGE",
    "EXIT_VERIFY",
    "MODES",
    "BETA_PLACEMENTS",
    "LAYER_SCALES",
    "STEM_CENTERINGS",
    "WRITER_CENTERINGS",
    "ROTATIONS",
    "DTYPES",
    "VERIFY_DTYPES",
    "FORMATS",
    "TASK_NAMES",
    "PRESET_NAMES",
    "check_input_file",
    "check_model_name",
    "check_output_of",
    "cli_words",
    "say",
    "figures_line",
    "fail",
    "handle_errors",
]

EXIT_CODES = """\b
Exit codes: 0 ok, 1 error (nothing written), 2 invalid option, 3 nothing to
convert, 4 verification failed (nothing written), 130 interrupted."""


def quiet_transformers() -> None:
    """Our own one-line messages and progress only; transformers' load reports go to debug."""
    if "transformers" not in sys.modules:  # not imported yet: nothing to quiet, and stay fast
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        return
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001
        pass


# API spellings in library messages -> what a command-line user types
_CLI_WORDS = (
    (re.compile(r"\bmode=['\"](\w+)['\"]"), r"--mode \1"),
    (re.compile(r"\bverify=False\b"), "--no-verify"),
    (re.compile(r"\bverify_dtype=['\"](\w+)['\"]"), r"--verify-dtype \1"),
    (re.compile(r"\buntie=False\b"), "--keep-tied"),
    (re.compile(r"\buntie=True\b"), "--untie"),
    (re.compile(r"\bfold_gamma=True\b"), "--fold-gamma"),
    (re.compile(r"\bformat=['\"](\w+)['\"]"), r"--format \1"),
    (re.compile(r"\bcalibration_data=\b"), "--calibration-data "),
    (re.compile(r"\blow_memory=True\b"), "--low-memory"),
    (re.compile(r"\btrust_remote_code=True\b"), "--trust-remote-code"),
    (re.compile(r"\ballow_unusable=True\b"), "--allow-unusable"),
    (re.compile(r"\bper_norm_centering=True\b"), "--per-norm-centering"),
    (re.compile(r"\bmean_carry=False\b"), "--no-mean-carry"),
    (re.compile(r"\bquantizer=['\"]([\w-]+)['\"]"), r"--quantizer \1"),
    (re.compile(r"\btrade_constants=False\b"), "--no-constant-trades"),
    (re.compile(r"\bstem_centering=['\"](\w+)['\"]"), r"--stem-centering \1"),
    (re.compile(r"\bwriter_centering=['\"](\w+)['\"]"), r"--writer-centering \1"),
    (re.compile(r"\bcalibration=\.\.\."), "--calibration-data FILE"),
    (re.compile(r"\bcalibration_data\b(?!=)"), "--calibration-data"),
    (re.compile(r"\bout_dir\b"), "--out"),
    (re.compile(r"\boverwrite=True\b"), "--overwrite"),
    (re.compile(r"\bmax_shard_size\b"), "--max-shard-size"),
    (re.compile(r"\blow_memory=False\b"), "--in-memory"),
    (re.compile(r"\brotate_output=['\"](\w+)['\"]"), r"--rotate-output \1"),
    (re.compile(r"\brotate=['\"](\w+)['\"]"), r"--rotate \1"),
    (re.compile(r"\bonline_hadamard=True\b"), "--online-hadamard"),
    (re.compile(r"\bonline_block=(\d+)"), r"--online-block \1"),
    (re.compile(r"\brotate_smooth=([\d.]+)"), r"--smooth \1"),
    (re.compile(r"\ballow_new_head=True\b"), "--new-head"),
    (re.compile(r"\btask=['\"]([\w-]+)['\"]"), r"--task \1"),
    # the inputs a model needs and normswap cannot build: on the command line they come from a file
    (re.compile(r"\bexample_inputs=\{\.\.\.\} with it"), "--example-inputs FILE.safetensors holding it"),
    (re.compile(r"\bexample_inputs=\((?:tensor, )?\.\.\.\) or (?:a dict of kwargs(?: that the model accepts)?|"
                r"example_inputs=\{'name': tensor\})"),
     "--example-inputs FILE.safetensors with the tensors its forward takes, by name (or --sample FILE)"),
    (re.compile(r"\bexample_inputs\b"), "--example-inputs FILE.safetensors"),
)


def cli_words(text: str) -> str:
    """Speak the caller's language: the API says ``mode='exact'``, the CLI says ``--mode exact``."""
    for pattern, repl in _CLI_WORDS:
        text = pattern.sub(repl, text)
    return text


# normswap.presets.names(), spelled out so that --help and a misspelt preset answer without importing torch
# (a test keeps it equal to presets.names())
PRESET_NAMES = ("tiny-bert", "tiny-bloom", "tiny-gpt2", "tiny-opt", "tiny-phi", "tiny-vit", "tiny-whisper")


def _path_like(model: str) -> bool:
    """No Hub id (``name`` or ``org/name``) looks like this: a local path, absolute, relative or ``~``."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model


def check_model_name(model: str, what: str = "") -> None:
    """A MODEL argument that can name no model is a usage error (exit 2), said at once, before torch is
    imported: a file (a model is a directory), a path that does not exist (no Hub id looks like it), or
    what looks like a preset (``tiny-*``, no slash) but is none, with the nearest preset (a Hub lookup would
    wait on the network only to fail). ``what``: the argument's name in the message (``ORIGINAL``)."""
    import difflib

    from normswap.errors import UsageError

    name = f"{what} {model}" if what else model
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        raise UsageError(f"{name} is a file; pass the model directory that contains config.json")
    if model in PRESET_NAMES or os.path.exists(path):
        return
    if _path_like(model):
        raise UsageError(f"{name} does not exist (not a directory, a preset or a Hub id)")
    if "/" in model or not model.startswith("tiny-"):
        return
    near = difflib.get_close_matches(model, PRESET_NAMES, n=1, cutoff=0.8)
    hint = f"did you mean {near[0]}? " if near else ""
    raise UsageError(f"{name} is not a preset or a local directory; {hint}presets: {', '.join(PRESET_NAMES)}")


def check_output_of(converted: str, original: str) -> None:
    """``verify``'s CONVERTED: a directory that exists (``convert`` wrote it; never a Hub id or a preset), and
    not ORIGINAL itself. Else a usage error (exit 2), before torch is imported."""
    from normswap.errors import UsageError

    path = os.path.expanduser(converted)
    if not os.path.exists(path):
        raise UsageError(f"CONVERTED {converted} does not exist; pass the directory normswap convert wrote")
    if not os.path.isdir(path):
        raise UsageError(f"CONVERTED {converted} is a file; pass the directory normswap convert wrote")
    original_path = os.path.expanduser(original)
    if os.path.isdir(original_path) and os.path.samefile(original_path, path):
        raise UsageError(f"ORIGINAL and CONVERTED are the same directory ({converted}); pass the directory "
                         "normswap convert wrote from ORIGINAL as CONVERTED")


def say(kind: str, text: str, quiet: bool = False) -> None:
    """Print ``kind: text`` (a ``note`` or a ``warning``, in CLI words) on stderr, on a line of its own,
    unless ``quiet`` (``-q``: errors only). On a terminal a progress line may stand there unfinished
    (it is rewritten in place), so it is cleared first; the next progress update redraws it."""
    if quiet:
        return
    stream = sys.stderr
    clear = "\r\033[K" if stream is not None and stream.isatty() else ""
    click.echo(f"{clear}{kind}: {cli_words(text)}", err=True)


def check_input_file(path: str, option: str) -> None:
    """A text input named on the command line must be a file that exists: else a usage error (exit 2,
    like a missing ``data.path`` in a recipe), said before any model is loaded or torch imported."""
    from normswap.errors import UsageError

    if not os.path.exists(path):
        raise UsageError(f"{option} {path} does not exist")
    if not os.path.isfile(path):
        raise UsageError(f"{option} {path} is not a file; pass a text file (one sample per line) or JSONL")


def fail(message: str, code: int = EXIT_ERROR) -> None:
    """Print ``error: message`` on stderr (in CLI words) and exit with ``code``."""
    click.echo(f"error: {cli_words(message)}", err=True)
    sys.exit(code)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn every failure of a command into one ``error:`` line and its exit code.

    ``NormswapError`` (and subclasses from anywhere in normswap, e.g. the calibration's unusable-
    conversion error) -> its ``exit_code``; Ctrl-C / SIGTERM -> 130 with one true sentence about what
    is on disk (:func:`normswap.interrupts.sentence`: nothing, the complete output when the interrupt
    came after it was moved into place, or a fine-tune's checkpoints to resume from), also when
    something inside swallowed the ``KeyboardInterrupt`` (:mod:`normswap.interrupts`); ``OSError``
    (disk full, permissions) -> 1 with the cause; anything else is a bug: one line, traceback with
    ``NORMSWAP_DEBUG=1``.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        quiet_transformers()
        try:
            with interrupts.command():
                result = fn(*args, **kwargs)
            if interrupts.was_interrupted():  # the KeyboardInterrupt was swallowed on the way: still one
                raise KeyboardInterrupt
            return result
        except (KeyboardInterrupt, click.exceptions.Abort) as exc:
            interrupts.exit_interrupted(f"error: {cli_words(interrupts.report(exc))}")
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 - sorted out below
            if interrupts.was_interrupted():
                # an error the interrupt caused on its way out (transformers' lazy import turns the
                # KeyboardInterrupt raised inside it into ModuleNotFoundError): still the interrupt's line
                interrupts.exit_interrupted(f"error: {cli_words(interrupts.report(exc))}")
            _fail_for(exc)

    return wrapper


def _fail_for(exc: Exception) -> None:
    """Exit with the line for a command's error: a :class:`NormswapError`'s own message and exit code, out
    of memory, an ``OSError`` with its cause, else a bug (one line; the traceback with ``NORMSWAP_DEBUG=1``)."""
    if isinstance(exc, NormswapError):
        if getattr(exc, "shown_by_main", False):  # another process of a distributed run prints it
            sys.exit(int(getattr(exc, "exit_code", EXIT_ERROR)))
        fail(str(exc), int(getattr(exc, "exit_code", EXIT_ERROR)))
    if isinstance(exc, MemoryError):
        fail("out of memory; retry with --low-memory")
    if isinstance(exc, OSError):
        from normswap.checkpoint.io import os_error

        fail(str(os_error(exc, exc.filename or "the output")))
    if os.environ.get("NORMSWAP_DEBUG"):
        raise exc
    fail(f"internal error ({type(exc).__name__}: {first_line(exc, 300, default='')}); rerun with "
         "NORMSWAP_DEBUG=1 for a traceback and please report it")


# shared option values of convert / inspect / verify: defined once, in normswap.options
TASK_NAMES = tuple(TASKS)


def figures_line(verification: dict[str, Any]) -> str:
    """The verification figures a user compares, as ``key=value, ...`` (KL never negative; a figure
    just short of 1 keeps the digits that show it is not 1)."""
    from normswap.surgery.verify import figure
    keep = (
        "max_abs_error",
        "max_rel_error",
        "kl",
        "top1_agreement",
        "max_stream_mean_ratio",
        "raw_stream_rel_error",
        "own_rounding_error",
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
            parts.append(f"{key}={figure(v, 3)}" if isinstance(v, float) else f"{key}={v}")
    return ", ".join(parts)


