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
    from normswap.cli import backends_cmd, convert_cmd, finetune_cmd, inspect_cmd, verify_cmd  # noqa: F401


_register_commands()
