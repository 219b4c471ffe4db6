"""What the end-to-end tests share: the `flodl` command, the digits example, free ports, the
children of a supervising process, and reading a process's output up to a line."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits.py"
FLODL = [sys.executable, "-m", "flodl.cli"]


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
