"""``python -m normswap``: the ``normswap`` command, for environments whose scripts directory is not on PATH."""

from normswap import interrupts

interrupts.install()  # first: Ctrl-C during the imports below exits 130 with one line, not a traceback

from normswap.cli import main  # noqa: E402

if __name__ == "__main__":
    main(prog_name="normswap")
