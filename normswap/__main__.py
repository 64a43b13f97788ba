"""``python -m normswap``: the ``normswap`` command, for environments whose scripts directory is not on PATH."""

from normswap.cli import main

if __name__ == "__main__":
    main(prog_name="normswap")
