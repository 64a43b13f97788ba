"""The ``normswap`` command line (click). Each command lives in its own module of this package."""

from __future__ import annotations

import click

from normswap import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="normswap")
def main() -> None:
    """Convert LayerNorm to RMSNorm in Hugging Face and custom PyTorch models."""


def _register_commands() -> None:
    # Imported here so each command module can import `main` without a cycle.
    from importlib import import_module

    for name in ("normswap.cli.convert_cmd", "normswap.cli.backends_cmd", "normswap.cli.finetune_cmd"):
        try:
            import_module(name)
        except ModuleNotFoundError as exc:  # a command module not written yet
            if exc.name != name:
                raise


_register_commands()
