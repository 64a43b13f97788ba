"""Typed errors for every user-facing failure, each carrying its command-line exit code.

The CLI prints ``str(error)`` as a single line and exits with ``error.exit_code``, so messages must
say what went wrong *and* what to do about it, in one sentence. The exit codes are docs/cli.md's
table: 0 ok, 1 error, 2 invalid command line or options this model needs changed, 3 nothing to
convert, 4 verification failed,
130 interrupted.
"""

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOTHING = 3
EXIT_VERIFY = 4
EXIT_INTERRUPTED = 130


def first_line(exc: BaseException, limit: int = 300, default: str | None = None) -> str:
    """The first line of ``exc``'s message, at most ``limit`` characters, for one-line error messages;
    ``default`` (the exception's class name unless given) when the message is empty."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else (type(exc).__name__ if default is None else default))[:limit]


class NormswapError(Exception):
    """A problem with the user's input (model, options, paths) that they can fix (exit code 1)."""

    exit_code: int = EXIT_ERROR


class NaNOutputs(NormswapError):
    """The original model computes NaN on the inputs it is analysed on (exit code 1)."""


class ModelRunFailed(NormswapError):
    """The original model's forward raised on the inputs it is analysed on (exit code 1). Raised by the
    float64 analysis copy, it means only that the model does not run in float64: ``patch`` then tries
    the model's own dtype before saying the inputs are to blame."""


class UsageError(NormswapError):
    """An invalid command line or option value (exit code 2)."""

    exit_code = EXIT_USAGE


class OptionRefused(UsageError):
    """The options cannot convert this model, and another option (which the message names) can: a refusal
    that only the model's plan or files decide (approximate norms with ``--low-memory`` or
    ``--format compat``, a rotation op the stock architecture lacks, a missing head without ``--new-head``),
    given the exit code of a usage error (2), so that a refusal has the same code whether the command line
    alone decides it or the model does, and on both the in-memory and the streamed path (round 59)."""


class NothingToConvert(NormswapError):
    """The model has no LayerNorm that this mode would convert, or is already converted (exit code 3)."""

    exit_code = EXIT_NOTHING


class VerificationFailed(NormswapError):
    """The conversion misses its tolerance or is unusable; nothing was written (exit code 4)."""

    exit_code = EXIT_VERIFY


class DiskFull(NormswapError):
    """The output filesystem ran out of space; nothing was left behind (exit code 1)."""
