"""Which process of a distributed recipe run speaks. Nothing here imports torch: the command line asks
before the heavy imports.

Under ``accelerate launch`` / ``torchrun`` every process runs the same command on the same files, so
a check of the settings, the data or the output directory fails alike on all of them; the main
process (rank 0) prints it, the others exit with the same code in silence.
"""

from __future__ import annotations

import os

from normswap.errors import NormswapError


def process_rank() -> int:
    """This process's rank in a ``torchrun`` / ``accelerate launch`` run (0 outside one), readable
    before the process group exists."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def shown_by_main(exc: NormswapError, main: bool | None = None) -> NormswapError:
    """Mark ``exc`` (``exc.shown_by_main = True``) when raised on a process other than the main one
    (``main``; default: rank 0 by the launcher's environment): the command line prints it there only."""
    if not (process_rank() == 0 if main is None else main):
        exc.shown_by_main = True  # type: ignore[attr-defined]
    return exc
