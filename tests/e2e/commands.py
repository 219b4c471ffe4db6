"""What the end-to-end tests share: the `flodl` command, the digits example, free ports, the
children of a supervising process, waiting for processes to exit, and reading a process's
output up to a line."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from flodl.host.environment import OP_TIMEOUT

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits.py"
FLODL = [sys.executable, "-m", "flodl.cli"]


def short_collectives_env() -> dict[str, str]:
    """This process's environment with a 10 s collective timeout for the ranks of a run it
    starts. A rank whose round was under way when its launcher died ends only once that
    collective has (an abandoned op still writes its buffer): up to the timeout plus 5 s, 35 s
    at the default of 30, beyond the 30 s the tests give such ranks to exit."""
    return {**os.environ, OP_TIMEOUT: "10"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def children_of(pid: int) -> list[int]:
    """``pid``'s child processes, from every thread (trio starts processes from its worker
    threads, and /proc lists each thread's children apart)."""
    tasks = Path(f"/proc/{pid}/task")
    return [
        int(child) for task in tasks.iterdir() for child in (task / "children").read_text().split()
    ]


def rank_pids(host: int) -> list[int]:
    """The rank processes a ``flodl agent`` or ``flodl run`` process ``host`` started, oldest
    first: its children, or the children of its warm-start helper (which forks them)."""
    pids = []
    for child in children_of(host):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        pids += children_of(child) if b"flodl.supervise.zygote" in cmdline else [child]
    return sorted(pids)  # pids rise: they do not wrap around within a test


def wait_exits(pids: Iterable[int], limit: float, leaving: int = 0) -> None:
    """Return once at most ``leaving`` of ``pids`` still run. Each is watched through a pidfd
    (any process, not only a child), so the wait wakes at an exit, not on a timer; the ones
    gone already count as exited. AssertionError naming those still running after ``limit``
    seconds."""
    watched: dict[int, int] = {}
    try:
        for pid in pids:
            try:
                watched[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                continue
        poller = select.poll()
        for fd in watched:
            poller.register(fd, select.POLLIN)
        running = set(watched)
        deadline = time.monotonic() + limit
        while len(running) > leaving:
            remaining = deadline - time.monotonic()
            left = sorted(watched[fd] for fd in running)
            assert remaining > 0, f"still running after {limit} s: {left}"
            for fd, _ in poller.poll(remaining * 1000):
                running.discard(fd)
                poller.unregister(fd)
    finally:
        for fd in watched:
            os.close(fd)


def read_until(proc: subprocess.Popen[str], needle: str) -> str:
    """``proc``'s output up to the line holding ``needle``; AssertionError with what was read
    if the output ends first."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"{needle!r} never printed:\n" + "".join(seen))
