"""A fork server for the test subprocesses that need a new process, not an empty one.

Some checks run Python code in a process of its own: a converted checkpoint loaded where transformers'
``Trainer`` was never imported, a ``torch.export`` that is the process's first RMSNorm call, a program
loaded where importing normswap fails. What makes them meaningful is what that process has *not* done
(imported normswap or ``transformers.trainer``, built a kernel, patched a class), not that it imported
nothing: a fresh interpreter spends ~2 CPU s importing torch and ~6 s more on the first model load's
lazy imports (``transformers.modeling_utils`` with generation, masking, ``torch._dynamo``,
accelerate) before it reaches the line under test.

The server (``python warm_python.py serve SOCKET MODULE...``) imports the modules it is given (torch and
transformers' modeling stack by default; never normswap and never ``transformers.trainer``), computes
nothing, and forks one child per request that runs the code as ``python -c`` would (a new ``__main__``,
``sys.argv``, the working directory, the interpreter's own shutdown at the end), its stdout and stderr going
to the caller's files. The server waits
for each child before answering, and the caller waits for the server at the end, so the children's CPU
time is counted where a fresh interpreter's would be (``time``, ``getrusage(RUSAGE_CHILDREN)``).

What it cannot stand in for: a check about what importing something does to a process that has not
imported torch or transformers yet (keep those in ``subprocess.run([sys.executable, ...])``), and a check
that needs an environment variable read at import time set to a value of its own: every child has the
server's environment, taken when it started. For the Hugging Face caches that environment is one a test can
use: the server starts with ``HF_HOME`` set to an empty directory of its own (:attr:`WarmPython.hf_home`;
every other ``HF_*`` cache or path variable unset, ``HF_HUB_OFFLINE=1``), as a job on a compute node starts
with its ``HF_HOME``, so a child reads the Hub cache (``hf_home / "hub"``) and the remote-code modules
(``hf_home / "modules"``) where a fresh interpreter with that variable would. A test that lays a repo out in
``hf_home`` removes it when it is done (:meth:`WarmPython.hub_cache`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

# What a fresh interpreter's first model load imports; nothing of normswap, nothing that runs at import
# what a test asserts about (``transformers.trainer`` is where normswap's weight-decay hook acts).
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "accelerate", "safetensors.torch")
NEVER = ("normswap", "transformers.trainer")


def _run_child(req: dict) -> int:
    import gc
    import types

    gc.unfreeze()  # a fresh interpreter's collector sees every object, at shutdown too (nanobind's leak check)

    os.chdir(req["cwd"])
    os.environ.update(req["env"])
    sys.argv = ["-c", *req["args"]]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    return exit_status(lambda: exec(compile(req["code"], "<string>", "exec"), main.__dict__))


def exit_status(run: Callable[[], object]) -> int:
    """Call ``run`` and return the exit status an interpreter running it as its program would: 0, a
    ``SystemExit``'s code (its message on stderr and 1 for a non-integer one), or 1 with the traceback printed
    for any other exception. Also the docs examples' fork server's (``tests/docs_runner.py``)."""
    try:
        run()
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - report like an interpreter would
        import traceback

        traceback.print_exc()
        return 1


def serve(path: str, modules: list[str]) -> None:
    import gc
    import importlib
    import signal
    import threading

    sys.path[0] = ""  # as ``python -c`` has it (the working directory), not this script's directory
    for name in modules:
        importlib.import_module(name)
    loaded = [m for m in NEVER if m in sys.modules]
    if loaded:
        raise SystemExit(f"warm_python: the preload imported {loaded}, which the children must import themselves")
    gc.collect()
    gc.freeze()  # the imports' objects out of the collector's generations until a child unfreezes them
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(1)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
        req = json.loads(msg)
        if req.get("quit"):
            conn.close()
            gc.unfreeze()  # a clean shutdown (nanobind's leak check counts frozen objects as leaked)
            break
        pid = os.fork()
        if pid == 0:
            srv.close()
            conn.close()
            for i, fd in enumerate(fds):
                os.dup2(fd, i)
                os.close(fd)
            # the child ends as an interpreter does: atexit handlers, finalisers and their "Exception ignored"
            # lines, then the exit code (what a check of a command's last stderr line must see)
            raise SystemExit(_run_child(req))
        for fd in fds:
            os.close(fd)
        if req.get("started"):  # the caller asked for the child's pid first (WarmPython.start), to signal it
            conn.send(f"pid {pid}".encode())
        timer = threading.Timer(req["timeout"], os.kill, (pid, signal.SIGKILL))
        timer.start()
        _, status = os.waitpid(pid, 0)  # reaped here: its CPU time joins the server's children's
        timer.cancel()
        conn.send(str(os.waitstatus_to_exitcode(status)).encode())
        conn.close()


# what stays of the caller's HF_* variables in the server: whether the Hub is reachable, never where a cache is
KEPT_HF = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY")


def hf_home_env(environ: Mapping[str, str], hf_home: str | os.PathLike) -> dict[str, str]:
    """``environ`` as a job with ``HF_HOME=hf_home`` and the Hub switched off sees it: every other ``HF_*`` and
    ``HUGGINGFACE_*`` variable (``HF_HUB_CACHE``, ``HF_MODULES_CACHE``, ...) that would put a cache elsewhere
    removed."""
    env = {k: v for k, v in environ.items() if not k.startswith(("HF_", "HUGGINGFACE_")) or k in KEPT_HF}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


class WarmChild:
    """A child of the server started by :meth:`WarmPython.start`: ``pid``, ``poll``, ``send_signal``,
    ``communicate`` and ``returncode`` as :class:`subprocess.Popen` has them (text outputs)."""

    def __init__(self, pid: int, conn: socket.socket, out, err) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn, self._out, self._err = conn, out, err

    def _ended(self, timeout: float | None) -> bool:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                reply = self._conn.recv(16)  # the server sends the exit status once it has reaped the child
            except (BlockingIOError, TimeoutError):
                return False
            self._conn.close()
            self.returncode = int(reply) if reply else -1
        return True

    def poll(self) -> int | None:
        self._ended(0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the child (``subprocess.TimeoutExpired`` after ``timeout`` s) and return its stdout, stderr."""
        if not self._ended(timeout):
            raise subprocess.TimeoutExpired(["<warm python>"], timeout)
        texts = []
        for f in (self._out, self._err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
            f.close()
        return texts[0], texts[1]


class WarmPython:
    """A running server; :meth:`run` is ``subprocess.run([sys.executable, "-c", code, *args])`` in a child of it."""

    def __init__(self, modules: tuple[str, ...] = PRELOAD) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="warm-python-")
        self.socket = str(Path(self._dir.name) / "s")
        self.hf_home = Path(self._dir.name) / "hf-home"
        self.hf_home.mkdir()
        self.proc = subprocess.Popen([sys.executable, __file__, "serve", self.socket, *modules],
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                     env=hf_home_env(os.environ, self.hf_home))
        line = self.proc.stdout.readline()
        if line != "ready\n":
            self.proc.wait()
            raise RuntimeError(f"warm_python server did not start (exit {self.proc.returncode})")

    def run(self, code: str, *args: str, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
        """Run ``code`` in a forked child; the result as ``subprocess.run(..., capture_output=True, text=True)``
        gives it. On ``timeout`` the child is killed (exit code -9). ``env``: variables set in the child before
        the code runs, for variables that only code the child imports itself reads (``NORMSWAP_*``), never one
        that a preloaded module read at import (``HF_*``)."""
        child = self.start(code, *args, cwd=cwd, env=env, timeout=timeout)
        stdout, stderr = child.communicate()
        return subprocess.CompletedProcess(["<warm python>", "-c", code, *args], child.returncode, stdout, stderr)

    def start(self, code: str, *args: str, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
              timeout: float = 300) -> WarmChild:
        """:meth:`run` without waiting: the running child (its ``pid``, to signal it), as ``subprocess.Popen`` with
        both outputs piped would give it. The server serves nothing else until this child has ended."""
        req = {"code": code, "args": list(args), "cwd": str(cwd or os.getcwd()), "env": dict(env or {}),
               "timeout": timeout, "started": True}
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        with open(os.devnull) as devnull:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(self.socket)
            socket.send_fds(s, [json.dumps(req).encode()], [devnull.fileno(), out.fileno(), err.fileno()])
        reply = s.recv(32).decode()
        if not reply.startswith("pid "):
            s.close()
            raise RuntimeError(f"warm_python: the server did not start the child ({reply!r})")
        return WarmChild(int(reply[4:]), s, out, err)

    @contextlib.contextmanager
    def hub_cache(self) -> Iterator[Path]:
        """The children's Hub cache (``HF_HOME/hub``, empty), emptied again when the block ends: a test lays
        out the repos it loads there."""
        hub = self.hf_home / "hub"
        hub.mkdir()
        try:
            yield hub
        finally:
            shutil.rmtree(hub, ignore_errors=True)

    def close(self) -> None:
        """Stop the server and wait for it (which counts its children's CPU time in this process's)."""
        if self.proc.poll() is None:
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.connect(self.socket)
                s.send(json.dumps({"quit": True}).encode())
                s.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._dir.cleanup()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3:])
