"""The processes of the time-to-quality bench: started in sessions of their own, always reaped.

:class:`Processes` starts each command as the leader of a new session (so it and whatever it
starts can be killed as a group, and a terminal's Ctrl-C reaches only the bench), its output
in a log file. Leaving the ``with`` block kills every group still running (SIGKILL) and every
extra pid it was told of (the ranks ``flodl run`` starts lead sessions of their own and write
their pid files), then waits for its own children. :func:`alive` tells a live process from a
gone or zombie one, so the bench can check that none it started is left.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType

__all__ = ["Processes", "alive", "kill_group", "pids_in", "wait_for_exits"]


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, waiting to be reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group ``pid`` leads (to ``pid`` alone if it leads none)."""
    try:
        os.killpg(pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def pids_in(folder: Path) -> list[int]:
    """The pids of the ``*.pid`` files in ``folder`` (what the ranks wrote)."""
    pids: list[int] = []
    for path in sorted(folder.glob("*.pid")) if folder.exists() else []:
        try:
            pids.append(int(path.read_text().strip()))
        except (OSError, ValueError):
            continue
    return pids


def wait_for_exits(pids: Sequence[int], timeout: float, *, every: bool) -> None:
    """Block until one of ``pids`` (``every``: all of them) has exited, or ``timeout`` seconds
    passed. Waits on each process's pidfd, so it wakes when a process exits, not on a timer;
    a pid already gone counts as exited. A child of this process must not have been reaped."""
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except ProcessLookupError:
                if not every:
                    return
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        waiting = len(fds)
        while waiting and (remaining := deadline - time.monotonic()) > 0:
            ready = poller.poll(remaining * 1000.0)
            if ready and not every:
                return
            for fd, _ in ready:
                poller.unregister(fd)
                waiting -= 1
    finally:
        for fd in fds:
            os.close(fd)


class Processes:
    """The processes of one run (a context manager; see the module docstring)."""

    def __init__(self) -> None:
        self.children: list[subprocess.Popen[bytes]] = []
        self.extra: set[int] = set()
        self.logs: list[Path] = []

    def start(
        self, command: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``command`` as the leader of a new session, its output into ``log``."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as sink:
            child = subprocess.Popen(
                list(command),
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        self.children.append(child)
        self.logs.append(log)
        return child

    def adopt(self, pids: Iterable[int]) -> None:
        """Also kill these (session leaders started by a child) when the block ends."""
        self.extra.update(pids)

    @property
    def pids(self) -> list[int]:
        """Every pid this run is known to have started."""
        return sorted({c.pid for c in self.children} | self.extra)

    def tail(self, chars: int = 4000) -> str:
        """The end of every log, for an error message."""
        parts = []
        for log in self.logs:
            text = log.read_text(errors="replace") if log.exists() else ""
            parts.append(f"--- {log.name}\n{text[-chars:]}")
        return "\n".join(parts)

    def kill_all(self) -> None:
        """SIGKILL every group still running, then reap this process's children."""
        for pid in [c.pid for c in self.children if c.poll() is None] + sorted(self.extra):
            kill_group(pid)
        for child in self.children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        # Grandchildren reparented to init are reaped by it; give it a moment.
        wait_for_exits(sorted(self.extra), 5.0, every=True)

    def __enter__(self) -> Processes:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill_all()
