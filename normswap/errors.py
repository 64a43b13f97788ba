"""One exception type for every user-facing failure.

The CLI prints ``str(error)`` as a single line and exits non-zero, so messages must say what went
wrong *and* what to do about it, in one sentence.
"""


class NormswapError(Exception):
    """A problem with the user's input (model, options, paths) that they can fix."""
