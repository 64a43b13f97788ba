"""A fork server for the shell examples of ``tests/test_docs_examples.py``.

Every ``normswap`` (or ``python -c/-m/script``) command of a documentation example would otherwise
start a fresh interpreter and pay for importing torch and transformers, seconds each. This server
imports them once and never computes anything; each command connects, passes its argv, working
directory, environment and its stdin/stdout/stderr file descriptors, and the server forks a child
that runs the command exactly as the console script would (``normswap.cli.main``), with the exit
code sent back. The client (``python docs_runner.py client ...``, the ``normswap`` shim on PATH)
imports nothing heavy.

Usage: ``python docs_runner.py serve SOCKET`` / ``python docs_runner.py client SOCKET KIND ARGS...``
with KIND ``normswap`` or ``python``.
"""

from __future__ import annotations

import json
import os
import socket
import sys

from warm_python import exit_status  # this file runs as a script: its folder is on sys.path


def _run_child(req: dict) -> int:
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    args = req["argv"]

    def run() -> None:
        if req["kind"] == "normswap":
            from normswap.cli import main

            sys.argv = ["normswap", *args]
            main(args=args, prog_name="normswap")
        else:
            import runpy

            if args[0] == "-c":
                sys.argv = ["-c", *args[2:]]
                exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
            elif args[0] == "-m":
                sys.argv = [args[1], *args[2:]]
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(args)
                runpy.run_path(args[0], run_name="__main__")

    return exit_status(run)


def _import_what_a_conversion_imports() -> None:
    """Import, once here, the modules ``import transformers`` leaves lazy and every command's first model
    load imports: ``transformers.modeling_utils`` (which brings generation, masking, torch._dynamo and
    accelerate along, ~1,900 modules) and each preset's model class. Without them each forked command
    imported them itself: 3-4 CPU s of a child's ``normswap convert tiny-gpt2`` (0.4 s with them), ~25
    commands in the documentation. Importing computes nothing (no thread pool starts)."""
    import tokenizers  # noqa: F401
    import transformers
    import transformers.modeling_utils  # noqa: F401

    from normswap import presets

    for preset in presets.PRESETS.values():
        getattr(transformers, preset.model_class)  # the lazy module's attribute: imports its modeling file


def serve(path: str) -> None:
    import gc
    import signal

    # what the examples use, imported once; nothing is computed here (fork-safety of thread pools)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import normswap.checkpoint.conversion  # noqa: F401
    import normswap.cli  # noqa: F401
    import normswap.pipeline  # noqa: F401
    import normswap.presets  # noqa: F401
    import normswap.recipes  # noqa: F401

    _import_what_a_conversion_imports()

    # the imports' objects out of the cyclic collector's reach: a conversion's gc.collect() in a child
    # would walk them all (~0.3 s a call), and the children share their pages instead of copying them
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reap themselves
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if os.fork() == 0:
            srv.close()
            for i, fd in enumerate(fds):
                os.dup2(fd, i)
                os.close(fd)
            code = _run_child(json.loads(msg))
            sys.stdout.flush()
            sys.stderr.flush()
            conn.send(str(code).encode())
            os._exit(code)
        for fd in fds:
            os.close(fd)
        conn.close()


def client(path: str, kind: str, args: list[str]) -> int:
    if kind == "python" and (not args or args[0] not in ("-c", "-m") and not os.path.isfile(args[0])):
        os.execv(sys.executable, [sys.executable, *args])  # anything else: a real interpreter
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    req = {"kind": kind, "argv": args, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(s, [json.dumps(req).encode()], [0, 1, 2])
    reply = s.recv(16)
    return int(reply) if reply else 1


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        raise SystemExit(client(sys.argv[2], sys.argv[3], sys.argv[4:]))
