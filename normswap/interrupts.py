"""Ctrl-C and SIGTERM: an interrupt is never lost, and what it leaves on disk is known.

Two users:

* **The library.** :func:`deferred` holds SIGINT / SIGTERM across a commit (the rename of a finished
  checkpoint into place) so that the commit happens whole or not at all, then delivers the signal to
  whatever handler was in place; :func:`committed` records each output moved into place, so an
  interrupt that arrives afterwards can say the output is complete. Python's own Ctrl-C handling is
  otherwise unchanged for library callers.
* **The command line** (:func:`install`, called by ``python -m normswap`` and the ``normswap`` script
  before anything heavy is imported). Python raises ``KeyboardInterrupt`` wherever the main thread
  happens to be, and where that is a ``__del__`` method or a garbage-collection callback (the ``regex``
  package's ``Group.__del__`` while a tokenizer compiles its patterns, say) the exception is printed as
  "Exception ignored in ..." and dropped: the command would carry on and exit 0. So the handler here:

  - before a command runs (imports, argument parsing) and after it ended (printing, exit handlers)
    there is nothing to unwind: it prints the one sentence about what is on disk and exits with 130 at
    once (no click "Aborted!", no traceback); in the last of interpreter shutdown, where Python would
    put its default handlers back (a signal would kill the process silently, exit -2), signals are
    ignored and the command's own exit status stands;
  - while a command runs it raises ``KeyboardInterrupt`` once, so ``finally`` blocks remove temporary
    output; inside a finaliser it re-sends the signal instead (from a helper thread), to be raised
    once the finaliser has returned; an interrupt a finaliser swallowed anyway is re-sent
    (``sys.unraisablehook``); later signals are ignored while the first one unwinds, so the clean-up
    itself is not cut short;
  - :func:`was_interrupted` lets the command's wrapper turn a run that swallowed its interrupt
    somewhere and returned into an interrupted one.

A leaf module: the standard library and :mod:`normswap.errors` only (it runs before torch or click is
imported).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

from normswap.errors import EXIT_INTERRUPTED

SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)


class Interrupted(KeyboardInterrupt):
    """A ``KeyboardInterrupt`` that carries the sentence about what is on disk (``str(exc)``), for a run
    that knows better than "nothing was written" (a fine-tune with checkpoints to resume from)."""


# ------------------------------------------------------------------------------------ what is on disk
_committed: list[str] = []


def committed(path: str | os.PathLike) -> None:
    """Record that a complete output was moved into place at ``path`` (called inside :func:`deferred`)."""
    _committed.append(str(path))


def written() -> list[str]:
    """The outputs this process moved into place, complete, in order."""
    return list(_committed)


def sentence(exc: BaseException | None = None) -> str:
    """The one line an interrupted command prints: what it leaves on disk."""
    if isinstance(exc, Interrupted) and str(exc):
        return f"interrupted; {exc}"
    if _committed:
        return f"interrupted after the output was complete: {', '.join(_committed)} is written in full"
    return "interrupted; nothing was written"


def report(exc: BaseException | None = None) -> str:
    """:func:`sentence`, for the command line to print once: a signal during the interpreter's shutdown
    after it (which can take seconds) exits 130 at once without a second, less informed line."""
    _state.reported = True
    return sentence(exc)


# ------------------------------------------------------------------------------------ commits
def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block; one that arrived meanwhile is delivered when it ends, to
    the handler in place before (Python's: ``KeyboardInterrupt`` raised there; the command line's:
    see the module docstring). Outside the main thread (no handlers there) the block just runs."""
    if not _in_main_thread():
        yield
        return
    caught: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        caught.append(signum)

    previous: dict[int, Any] = {}
    try:
        for s in SIGNALS:
            previous[s] = signal.signal(s, hold)
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if caught:
            signal.raise_signal(caught[0])


# ------------------------------------------------------------------------------------ the command line
class _State:
    installed = False  # by the command line's entry point, for the whole process
    running = False  # a command's body is running: raise KeyboardInterrupt (once) to unwind it
    raised = 0  # the signal raised as KeyboardInterrupt while running (0: none)
    resending = False  # a signal that arrived inside a finaliser is on its way again
    reported = False  # the interrupted line was printed (:func:`report`)


_state = _State()


def _in_finaliser(frame: FrameType | None) -> bool:
    """Whether the main thread is inside a finaliser (where a raised exception is printed and dropped)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or (code.co_name == "__call__" and code.co_filename.endswith("weakref.py")):
            return True  # a __del__, or a weakref.finalize callback
        frame = frame.f_back
    return False


def _resend(signum: int) -> None:
    """Send ``signum`` to this process again in a moment (2 ms), from another thread: the handler then
    runs at a later bytecode of the main thread, once the finaliser has returned (``signal.raise_signal``
    would run it at once, right here, inside the finaliser again). One at a time."""
    if _state.resending:
        return

    def later() -> None:
        time.sleep(0.002)
        _state.resending = False
        if _state.raised:
            return  # the interrupt got through meanwhile and is unwinding the command
        if not _state.running:
            # The command ended meanwhile, and interpreter shutdown may already have put back the
            # default handlers (a signal now would kill the process, exit -2): exit as the handler would.
            _exit_now()
        os.kill(os.getpid(), signum)

    _state.resending = True
    threading.Thread(target=later, name="normswap-resend-signal", daemon=True).start()


def _exit_now(exc: BaseException | None = None) -> None:
    """No command to unwind: say what is on disk, exit 130 (``os._exit``: nothing left can swallow it)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    if not _state.reported:
        with contextlib.suppress(Exception):
            sys.stderr.write(f"error: {sentence(exc)}\n")
            sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def _handler(signum: int, frame: FrameType | None) -> None:
    if not _state.running:
        _exit_now()
    if _state.raised:
        return  # already unwinding: let the clean-up finish
    if _in_finaliser(frame):
        _resend(signum)  # raised once the finaliser has returned
        return
    _state.raised = signum
    raise KeyboardInterrupt


def _unraisable(hook: Any) -> Any:
    def unraisable(info: Any) -> None:
        if _state.running and isinstance(info.exc_value, KeyboardInterrupt):
            signum, _state.raised = _state.raised or signal.SIGINT, 0
            _resend(signum)  # swallowed by a finaliser: raise it again, outside it
            return
        hook(info)

    return unraisable


def install() -> None:
    """Take over SIGINT and SIGTERM for the rest of the process (the command line's entry points)."""
    if _state.installed or not _in_main_thread():
        return
    for s in SIGNALS:
        signal.signal(s, _handler)
    sys.unraisablehook = _unraisable(sys.unraisablehook)
    atexit.register(_ignore_late_signals)  # registered first, so it runs last of the exit handlers
    _state.installed = True


def _ignore_late_signals() -> None:
    """At interpreter shutdown, once every exit handler before it has run: ignore SIGINT and SIGTERM. The
    command is over and its sentence printed; past this point Python puts its default handlers back (a
    signal would kill the process, exit -2, with nothing said) and no Python handler runs any more, so
    the process ends with the command's own exit status."""
    if _in_main_thread():
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)


@contextlib.contextmanager
def command() -> Iterator[None]:
    """The body of one command: interrupts raise ``KeyboardInterrupt`` inside it, and exit at once
    with the sentence after it. Called in-process without :func:`install` (click's test runner, a
    program calling the command), the handlers are set for the block only and restored after."""
    temporary = not _state.installed and _in_main_thread()
    previous = {s: signal.signal(s, _handler) for s in SIGNALS} if temporary else {}
    _state.running, _state.raised, _state.reported = True, 0, False
    _committed.clear()  # what this command writes (click's test runner runs many in one process)
    try:
        yield
    finally:
        _state.running = False
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def exit_interrupted(line: str) -> None:
    """Print ``line`` (the interrupted command's one line, already unwound: its ``finally`` blocks have
    removed what it left half-written) and exit 130. Under the command line's handlers the process ends
    at once (``os._exit``), so a signal re-sent for a finaliser, or one more Ctrl-C, cannot land in the
    interpreter's shutdown, where the default handlers are back and it would kill the process instead
    (exit -2); in-process callers (click's test runner) get ``SystemExit(130)``."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    if _state.installed:
        os._exit(EXIT_INTERRUPTED)
    raise SystemExit(EXIT_INTERRUPTED)


def was_interrupted() -> bool:
    """Whether the command now ending was interrupted (even if something swallowed the exception)."""
    return bool(_state.raised)
