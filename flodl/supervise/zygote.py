"""The warm-start helper: a process that imports torch and flodl once, then forks each rank.

A rank started cold spends a second or more of CPU importing torch before its first line runs;
a rank forked from this process starts with all of that imported. The launcher
(:mod:`flodl.supervise.warm`) starts one helper per host and talks to it over a Unix
``SOCK_SEQPACKET`` socket whose descriptor it names in ``FLODL_ZYGOTE_FD``:

* the launcher sends ``{"argv": [python, script, *args], "env": {...}, "cwd": ...}`` with the
  write end of the rank's output pipe attached (``SCM_RIGHTS``);
* the helper forks; the child becomes the rank (below); the helper answers
  ``{"pid": N}`` with a pidfd of the child attached, so that the launcher can signal it
  without racing a reused pid;
* when a child exits, the helper reaps it and sends ``{"exited": N, "code": C}`` (``-S`` for
  death by signal ``S``, as :mod:`subprocess` says it);
* when the launcher closes its end, the helper exits (its children run on: they are ranks).

The child leads a session of its own, has the rank's environment, working directory, argv,
``sys.path`` (the script's folder first, then ``PYTHONPATH``) and output, reseeds numpy's global
generator (Python's ``random`` reseeds itself after a fork), and runs the script as
``__main__`` at this module's top level, so that it exits as ``python script.py`` would: its
exceptions, ``SystemExit``, atexit handlers and threads are the interpreter's to handle.

The helper never touches CUDA: a CUDA context does not survive a fork.
"""

from __future__ import annotations

import io
import json
import os
import runpy
import selectors
import socket
import sys
from typing import Any

FD_VAR = "FLODL_ZYGOTE_FD"
"""The environment variable that names the helper's end of the launcher's socket."""

PRELOAD = (
    "torch",
    "torch.distributed",
    "numpy",
    "flodl.worker",
    "flodl.backends.gloo",
    "numba",
    "flodl.averaging._fused",
    "setproctitle",
    "torch._dynamo",
)
"""What the helper imports before its first fork: what every rank imports first; numba
with flodl's averaging loops, which a rank imports when it first joins a group (their machine
code still loads in the rank, from numba's disk cache: running it here would start a thread
before the forks); and torch._dynamo, which torch imports at a rank's first optimizer
(``add_param_group``), two seconds of CPU per rank on a small machine (it starts no thread)."""

MAX_MESSAGE = 1 << 20
"""The largest request the helper reads (an environment of a few hundred variables)."""


def preload() -> None:
    """Import :data:`PRELOAD` (a module this install lacks, or cannot import, is left to the
    rank to miss or to report)."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:
            pass


def serve(control: socket.socket) -> dict[str, Any] | None:
    """Fork a child per request until the launcher closes ``control``; report each child's
    start and exit. Returns the request in a forked child (which then becomes that rank), and
    None in the helper once the launcher is gone."""
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ, None)
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        for key, _ in selector.select():
            if key.data is None:
                message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 1)
                if not message:
                    return None  # the launcher closed its end (or is gone)
                request = json.loads(message)
                (output,) = fds
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    control.close()
                    for pidfd in children:
                        os.close(pidfd)
                    request["output_fd"] = output
                    return dict(request)
                os.close(output)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = pid
                selector.register(pidfd, selectors.EVENT_READ, pid)
                socket.send_fds(control, [json.dumps({"pid": pid}).encode()], [pidfd])
            else:
                pidfd = key.fd
                pid = children.pop(pidfd)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                try:
                    control.send(json.dumps({"exited": pid, "code": code}).encode())
                except OSError:
                    pass  # the launcher is gone; the helper learns it at its next read


def become_rank(request: dict[str, Any], base_path: list[str]) -> None:
    """In a forked child: take on the rank's session, output, environment and argv, then run
    its script as ``__main__`` (what it raises is the interpreter's to report, as for
    ``python script.py``)."""
    os.setsid()
    # ps and top show the rank's command, not the helper's (set before the environment
    # changes: setproctitle takes its room from the process's original one).
    title = sys.modules.get("setproctitle")
    if title is not None:
        title.setproctitle(" ".join(request["argv"]))
    output = request["output_fd"]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(devnull)
    os.close(output)
    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = _text_stream(1, unbuffered)
    sys.stderr = _text_stream(2, True)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    script, *args = request["argv"][1:]
    sys.argv = [script, *args]
    # As a fresh interpreter would have it: the script's folder, PYTHONPATH, then the rest
    # (the helper's own path, less its working folder and its PYTHONPATH).
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *extra, *base_path]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # each rank its own draw, as a fresh process would have
    try:
        runpy.run_path(script, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:
        # What python script.py shows: the script's frames, not the helper's and runpy's.
        trace = error.__traceback__
        while trace is not None and trace.tb_frame.f_code.co_filename != script:
            trace = trace.tb_next
        error = error.with_traceback(trace or error.__traceback__)
        sys.excepthook(type(error), error, error.__traceback__)
        raise SystemExit(1) from None


def _text_stream(fd: int, write_through: bool) -> io.TextIOWrapper:
    """A text stream on ``fd`` as Python sets one up for a pipe (block-buffered unless
    ``write_through``: PYTHONUNBUFFERED, or stderr)."""
    raw = io.FileIO(fd, "w", closefd=False)
    errors = "backslashreplace" if fd == 2 else "strict"
    return io.TextIOWrapper(
        io.BufferedWriter(raw), encoding="utf-8", errors=errors, write_through=write_through
    )


def main() -> None:
    """The helper's life: preload, serve, and in each forked child, become that rank."""
    control = socket.socket(fileno=int(os.environ.pop(FD_VAR)))
    own = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    base_path = [p for p in sys.path[1:] if p not in own]  # sys.path[0]: the working folder
    preload()
    request = serve(control)
    if request is not None:
        become_rank(request, base_path)


if __name__ == "__main__":
    main()
