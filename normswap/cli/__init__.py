"""The ``normswap`` command line (click). Each command lives in its own module of this package."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import click

from normswap import __version__, interrupts


class _OneLineUsageError(click.UsageError):
    """A command-line error printed as every other error of normswap is: one ``error:`` line on stderr (with
    the command whose ``--help`` to read), exit 2, rather than click's usage block, hint and ``Error:`` line."""

    def show(self, file: Any = None) -> None:
        command = self.ctx.command_path if self.ctx is not None else "normswap"
        click.echo(f"error: {self.format_message()} (see `{command} --help`)", file=file, err=file is None)


def _one_line(exc: click.UsageError) -> _OneLineUsageError:
    # `normswap` alone prints the help (click's NoArgsIsHelpError is a UsageError whose message is the help)
    if isinstance(exc, _OneLineUsageError) or type(exc).__name__ == "NoArgsIsHelpError":
        return exc
    return _OneLineUsageError(exc.format_message(), exc.ctx)


class _Program(click.Group):
    """The ``normswap`` group. Run as the program (the ``normswap`` script calls ``main()``, which reads
    ``sys.argv``), it takes over Ctrl-C and SIGTERM before parsing anything
    (:func:`normswap.interrupts.install`), so an interrupt at any moment exits 130 with one line, never
    click's "Aborted!" with exit 1; called in-process with ``args`` (click's test runner), each command
    sets its handlers for its own run only."""

    def main(self, args: Any = None, *rest: Any, **kwargs: Any) -> Any:
        if args is None:
            interrupts.install()
        return super().main(args, *rest, **kwargs)

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:  # the group's own options (`normswap --bogus`)
            return super().make_context(*args, **kwargs)
        except click.UsageError as exc:
            raise _one_line(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:  # an unknown command, and each command's options and arguments
            return super().invoke(ctx)
        except click.UsageError as exc:
            raise _one_line(exc) from None


def run_command(command: click.Command, prog_name: str, args: list[str] | None = None) -> NoReturn:
    """Run one ``normswap`` command as a program of its own (``python -m normswap.recipes`` runs ``finetune``),
    with what ``normswap`` gives every command: Ctrl-C and SIGTERM taken over before parsing (exit 130, one
    line), and a usage mistake said in one ``error:`` line with exit 2 rather than click's usage block, hint and
    ``Error:`` line. ``args``: the arguments (default ``sys.argv[1:]``). Exits with the command's code."""
    if args is None:
        interrupts.install()
    try:
        code = command.main(args, prog_name=prog_name, standalone_mode=False)
    except click.UsageError as exc:
        error = _one_line(exc)
        error.show()
        sys.exit(error.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo("Aborted!", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_Program, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="normswap")
def main() -> None:
    """Convert LayerNorm to RMSNorm in Hugging Face and custom PyTorch models."""


def _register_commands() -> None:
    # Imported here so each command module can import `main` without a cycle.
    from normswap.cli import backends_cmd, convert_cmd, finetune_cmd, inspect_cmd, verify_cmd  # noqa: F401


_register_commands()
