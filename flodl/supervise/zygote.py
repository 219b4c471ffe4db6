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

Started as ``python -m flodl.supervise.zygote --listen PATH`` (``flodl warm-helper PATH``), the
helper is shared: it listens on a Unix socket at PATH, greets each launcher of its user that
connects with its interpreter and the environment it imported in (:func:`import_environment`,
for the launcher to check that its ranks would import alike), serves each connection as above
and outlives them, until SIGTERM or SIGINT.

The child leads a session of its own, has the rank's environment, working directory, argv,
``sys.path`` (the script's folder first, then ``PYTHONPATH``) and output, reseeds numpy's global
generator (Python's ``random`` reseeds itself after a fork), and runs the script as
``__main__`` at this module's top level, so that it exits as ``python script.py`` would: its
exceptions, ``SystemExit``, atexit handlers and threads are the interpreter's to handle.

The helper never touches CUDA: a CUDA context does not survive a fork.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
from collections.abc import Mapping
from typing import Any

FD_VAR = "FLODL_ZYGOTE_FD"
"""The environment variable that names the helper's end of the launcher's socket."""

SHARED_VAR = "FLODL_WARM_HELPER"
"""The environment variable that names the socket of a shared helper (``flodl warm-helper``)
for launchers and agents to use instead of starting their own."""

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


def serve(
    control: socket.socket | None = None,
    listener: socket.socket | None = None,
    greeting: bytes = b"",
) -> dict[str, Any] | None:
    """Fork a child per request and report each child's start and exit to the connection that
    asked for it. The connections: ``control``, the launcher's own (the helper returns None
    once it closes), and each one ``listener`` accepts from a process of this user (sent
    ``greeting`` first, served until it closes or sends a request that is not one; the helper
    serves them until it is signalled). Returns the request in a forked child, which then
    becomes that rank."""
    selector = selectors.DefaultSelector()
    children: dict[int, tuple[int, socket.socket | None]] = {}  # pidfd -> pid, who asked
    connections: list[socket.socket] = []
    if listener is not None:
        selector.register(listener, selectors.EVENT_READ, _LISTENER)
    if control is not None:
        selector.register(control, selectors.EVENT_READ, _CONNECTION)
        connections.append(control)

    def drop(connection: socket.socket) -> None:
        selector.unregister(connection)
        connections.remove(connection)
        connection.close()
        for pidfd, (pid, owner) in children.items():
            if owner is connection:  # its exit is reaped, and reported to nobody
                children[pidfd] = (pid, None)

    while True:
        for key, _ in selector.select():
            if key.data is _LISTENER:
                assert listener is not None
                connection, _ = listener.accept()
                if not _same_user(connection) or not _sent(connection, greeting):
                    connection.close()
                    continue
                selector.register(connection, selectors.EVENT_READ, _CONNECTION)
                connections.append(connection)
            elif key.data is _CONNECTION:
                asking = key.fileobj
                assert isinstance(asking, socket.socket)
                request, output = _read_request(asking)
                if request is None or output is None:
                    drop(asking)
                    if asking is control:
                        return None  # the launcher closed its end (or is gone)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                # What the helper holds goes to the collector's permanent generation, which no
                # collection walks: the child's collections and its exit then leave those
                # shared pages unwritten, where walking them copied some hundreds of MB per
                # rank (about a CPU-second at each rank's exit on a 2-core machine). Garbage is
                # collected first (only what is new since the last fork is walked), or a
                # shared helper serving for days would keep every cycle it made.
                gc.collect()
                gc.freeze()
                pid = os.fork()
                if pid == 0:
                    # A rank handles signals as ``python script.py`` would (a listening
                    # helper has its own for SIGTERM and SIGINT).
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    selector.close()
                    for open_socket in [*connections, *([listener] if listener else [])]:
                        open_socket.close()
                    for pidfd in children:
                        os.close(pidfd)
                    request["output_fd"] = output
                    return request
                os.close(output)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, asking)
                selector.register(pidfd, selectors.EVENT_READ, pid)
                reply = [json.dumps({"pid": pid}).encode()]
                with contextlib.suppress(OSError):  # gone: it learns nothing more
                    socket.send_fds(asking, reply, [pidfd])
            else:
                pidfd = key.fd
                pid, owner = children.pop(pidfd)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                if owner is not None:
                    _sent(owner, json.dumps({"exited": pid, "code": code}).encode())


_LISTENER = "listener"
_CONNECTION = "connection"


def _read_request(connection: socket.socket) -> tuple[dict[str, Any] | None, int | None]:
    """The next request on ``connection`` and the output descriptor sent with it; (None, None)
    at its end, or when what came is not a request (its descriptors closed)."""
    try:
        message, fds, _, _ = socket.recv_fds(connection, MAX_MESSAGE, 1)
    except OSError:
        return None, None
    try:
        request = json.loads(message) if message else None
        valid = (
            isinstance(request, dict)
            and isinstance(request.get("argv"), list)
            and isinstance(request.get("env"), dict)
            and isinstance(request.get("cwd"), str)
            and len(fds) == 1
        )
    except ValueError:
        valid = False
    if not valid:
        for fd in fds:
            os.close(fd)
        return None, None
    return request, fds[0]


def _sent(connection: socket.socket, message: bytes) -> bool:
    """Send ``message``; False when the other end is gone."""
    try:
        connection.send(message)
    except OSError:
        return False
    return True


def _same_user(connection: socket.socket) -> bool:
    """Whether the process at the other end runs as this user (a request runs any script)."""
    credentials = connection.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
    )
    _, uid, _ = struct.unpack("3i", credentials)
    return bool(uid == os.getuid())


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


def listen(path: str) -> dict[str, Any] | None:
    """Serve as a helper shared by every launcher of this user that connects to the Unix socket
    at ``path`` (created once everything is imported, mode 0600), until SIGTERM or SIGINT; each
    connection is greeted with the helper's interpreter and :func:`import_environment`. On the
    way out the socket file is removed; ranks started run on. Returns the request in a forked
    child. SystemExit with a message when another helper serves ``path`` already."""
    if _serving(path):
        raise SystemExit(f"flodl: a warm-start helper serves {path} already")
    started_with = import_environment(os.environ)  # torch adds some of its own as it loads
    preload()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a helper that was killed left it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mask = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(mask)
    listener.listen(64)
    greeting = {
        "helper": os.getpid(),
        "python": sys.executable,
        "env": started_with,
    }
    try:
        # Within the try: a stop that comes as soon as "ready" is read removes the socket too.
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        print(f"flodl: warm-start helper ready; for runs to use it: export {SHARED_VAR}={path}")
        sys.stdout.flush()
        return serve(listener=listener, greeting=json.dumps(greeting).encode())
    except SystemExit:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise


def import_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that what the helper imports may read as it is imported (thread
    counts, torch's and numba's settings, the interpreter's own, where modules are found): a
    rank forked from a helper runs with the helper's values of these, so a shared helper
    serves only runs whose ranks would have the same."""
    return {
        name: value
        for name, value in env.items()
        if name.startswith(IMPORT_ENV_PREFIXES) and name not in PER_RANK_PYTHON_VARIABLES
    }


IMPORT_ENV_PREFIXES = (
    "PYTHON",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "TORCH_",
    "PYTORCH_",
    "TORCHDYNAMO_",
    "TORCHINDUCTOR_",
    "NUMBA_",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
)
PER_RANK_PYTHON_VARIABLES = frozenset(
    {"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING"}
)
"""Interpreter variables a forked rank applies from its own environment (its output streams)
or that change nothing it runs."""


def _serving(path: str) -> bool:
    """Whether a helper answers at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    """The helper's life: preload, serve (the launcher that started it, or with ``--listen
    PATH`` any launcher of this user), and in each forked child, become that rank."""
    args = sys.argv[1:] if argv is None else argv
    own = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    base_path = [p for p in sys.path[1:] if p not in own]  # sys.path[0]: the working folder
    if len(args) == 2 and args[0] == "--listen":
        request = listen(args[1])
    else:
        control = socket.socket(fileno=int(os.environ.pop(FD_VAR)))
        preload()
        request = serve(control)
    if request is not None:
        become_rank(request, base_path)


if __name__ == "__main__":
    main()
