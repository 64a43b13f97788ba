"""Reading one environment variable on a per-call path.

``os.environ.get`` of a missing key costs ~0.9 µs (it raises and catches ``KeyError`` inside); the raw
mapping behind ``os.environ`` answers in ~0.03 µs. Values are still read on every call (tests and users
may change them at run time); only the key encoding is done once.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def env_reader(name: str) -> Callable[[], str | None]:
    """A function returning the current value of ``name``, or None when it is unset."""
    data = getattr(os.environ, "_data", None)
    if data is None or not hasattr(os.environ, "encodekey"):
        return lambda: os.environ.get(name)
    key = os.environ.encodekey(name)
    decode = os.environ.decodevalue

    def read() -> str | None:
        raw = data.get(key)
        return None if raw is None else decode(raw)

    return read
