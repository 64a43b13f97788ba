"""Other libraries' own progress bars and chatter, off while normswap reports (no normswap imports).

``normswap convert`` prints its own progress lines (or nothing under ``--quiet``); without this,
transformers' "Loading weights" / "Writing model shards" bars and accelerate's "[RANK 0] Removed
shared tensor ... while saving" warnings land between them. :func:`quiet_libraries` turns those
off with each library's own switch for the length of a block, and puts every switch back as it
found it afterwards, so a caller's own settings survive a call into normswap.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def _accelerate_loggers() -> list[logging.Logger]:
    """accelerate's loggers (``accelerate`` and those of its modules created so far: a module logger
    with a level of its own, set from ``ACCELERATE_LOG_LEVEL``, ignores its parent's level)."""
    names = ["accelerate", "accelerate.utils.other"]
    names += [n for n in list(logging.root.manager.loggerDict) if n.startswith("accelerate.") and n not in names]
    return [logging.getLogger(n) for n in names]


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """For the block: transformers' and huggingface_hub's progress bars off, accelerate's warnings
    (the "Removed shared tensor" note a save of tied weights logs) at error level only. Restored after."""
    restore: list = []
    try:  # imported before any switch moves: transformers reads the hub's switch when first imported
        from transformers.utils import logging as hf_logging
    except ImportError:
        hf_logging = None
    try:
        from huggingface_hub import utils as hub_utils
    except ImportError:
        hub_utils = None
    if hub_utils is not None:  # set first, undone last (transformers' switch also flips the hub's)
        hub_was_off = hub_utils.are_progress_bars_disabled()
        hub_utils.disable_progress_bars()
        restore.append(lambda: None if hub_was_off else hub_utils.enable_progress_bars())
    if hf_logging is not None:
        was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        restore.append(lambda: hf_logging.enable_progress_bar() if was_on else None)
    for logger in _accelerate_loggers():
        level = logger.level
        logger.setLevel(logging.ERROR)
        restore.append(lambda logger=logger, level=level: logger.setLevel(level))
    try:
        yield
    finally:
        for undo in reversed(restore):
            undo()


def quietly(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run inside :func:`quiet_libraries` (for normswap's entry points that load or save models)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with quiet_libraries():
            return fn(*args, **kwargs)

    return wrapper
