"""What every ``normswap`` command shares: one-line errors, exit codes, interrupts.

Exit codes (every command; the table in docs/cli.md):

* 0 - success
* 1 - error: bad input, I/O failure, disk full, anything else (one line on stderr, nothing written)
* 2 - invalid command line (unknown option, invalid option value, bad ``key=value`` override)
* 3 - nothing to convert (no LayerNorm, none convertible in this mode, or already converted)
* 4 - verification failed: the conversion misses its tolerance or is unusable (nothing written)
* 130 - interrupted (Ctrl-C / SIGTERM); nothing written

Nothing here imports torch or transformers at module level: ``normswap --help`` and argument
errors must answer fast.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click

from normswap.errors import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_NOTHING,
    EXIT_USAGE,
    EXIT_VERIFY,
    NormswapError,
    first_line,
)
from normswap.options import BETA_PLACEMENTS, DTYPES, FORMATS, MODES, ROTATIONS, TASKS, VERIFY_DTYPES

__all__ = [
    "EXIT_CODES",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_NOTHING",
    "EXIT_USAGE",
    "EXIT_VERIFY",
    "MODES",
    "BETA_PLACEMENTS",
    "ROTATIONS",
    "DTYPES",
    "VERIFY_DTYPES",
    "FORMATS",
    "TASK_NAMES",
    "cli_words",
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


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so temporary output is removed on the way out."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. some test runners)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# API spellings in library messages -> what a command-line user types
_CLI_WORDS = (
    (re.compile(r"\bmode=['\"](\w+)['\"]"), r"--mode \1"),
    (re.compile(r"\bverify=False\b"), "--no-verify"),
    (re.compile(r"\bverify_dtype=['\"](\w+)['\"]"), r"--verify-dtype \1"),
    (re.compile(r"\buntie=False\b"), "--no-untie"),
    (re.compile(r"\bfold_gamma=True\b"), "--fold-gamma"),
    (re.compile(r"\bformat=['\"](\w+)['\"]"), r"--format \1"),
    (re.compile(r"\bcalibration_data=\b"), "--calibration-data "),
    (re.compile(r"\blow_memory=True\b"), "--low-memory"),
    (re.compile(r"\btrust_remote_code=True\b"), "--trust-remote-code"),
    (re.compile(r"\ballow_unusable=True\b"), "--allow-unusable"),
    (re.compile(r"\bper_norm_centering=True\b"), "--per-norm-centering"),
    (re.compile(r"\bcalibration=\.\.\."), "--calibration-data FILE"),
)


def cli_words(text: str) -> str:
    """Speak the caller's language: the API says ``mode='exact'``, the CLI says ``--mode exact``."""
    for pattern, repl in _CLI_WORDS:
        text = pattern.sub(repl, text)
    return text


def fail(message: str, code: int = EXIT_ERROR) -> None:
    """Print ``error: message`` on stderr (in CLI words) and exit with ``code``."""
    click.echo(f"error: {cli_words(message)}", err=True)
    sys.exit(code)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn every failure of a command into one ``error:`` line and its exit code.

    ``NormswapError`` (and subclasses from anywhere in normswap, e.g. the calibration's unusable-
    conversion error) -> its ``exit_code``; Ctrl-C / SIGTERM -> 130 "interrupted"; ``OSError``
    (disk full, permissions) -> 1 with the cause; anything else is a bug: one line, traceback with
    ``NORMSWAP_DEBUG=1``.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        quiet_transformers()
        try:
            with sigterm_as_interrupt():
                return fn(*args, **kwargs)
        except NormswapError as exc:
            fail(str(exc), int(getattr(exc, "exit_code", EXIT_ERROR)))
        except (KeyboardInterrupt, click.exceptions.Abort):
            fail("interrupted; nothing was written", EXIT_INTERRUPTED)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except MemoryError:
            fail("out of memory; retry with --low-memory")
        except OSError as exc:
            from normswap.checkpoint.io import os_error

            fail(str(os_error(exc, exc.filename or "the output")))
        except Exception as exc:  # noqa: BLE001 - a bug: one line, traceback on request
            if os.environ.get("NORMSWAP_DEBUG"):
                raise
            fail(
                f"internal error ({type(exc).__name__}: {first_line(exc, 300, default='')}); rerun with "
                "NORMSWAP_DEBUG=1 for a traceback and please report it"
            )

    return wrapper


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


