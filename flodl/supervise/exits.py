"""Exits of rank processes: what a supervisor reports, and how an exit is named.

:class:`RankExit` is the one event through which the exit of a rank's process reaches the
coordinator; :class:`ExitSink` is what receives it. The coordinator's shell is one (``flodl
run``); a supervisor on another host would hand the same events to a channel. :class:`ExitLog`
keeps each rank's exits for the failure report, and tells the processes the supervisor killed
itself from those that died of something else.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from flodl.supervise.warm import RankHandle

__all__ = [
    "ExitFact",
    "ExitLog",
    "ExitSink",
    "RankExit",
    "describe_exit",
    "exit_text",
    "signal_name",
]


@attrs.frozen
class RankExit:
    """One exit of one rank's process, as its supervisor saw it."""

    rank: int
    pid: int
    returncode: int
    """The process's exit code; ``-N`` for death by signal ``N``."""
    exited_unix: float
    restarting: bool
    """The supervisor starts the rank again (it rejoins the group)."""


class ExitSink(Protocol):
    """Takes the exits of rank processes (the coordinator's shell, or a channel to it)."""

    @property
    def run_ended(self) -> bool:
        """The run is over: a rank that fails now is not restarted."""
        ...

    def rank_exited(self, exit: RankExit) -> Sequence[str]:
        """Feed ``exit`` to the run's death detection at once; returns what a person should
        hear of it (say, the run going on without a rank that died before it joined)."""
        ...


@attrs.frozen
class ExitFact:
    """One exit of one rank's process, as the launcher saw it."""

    rank: int
    pid: int
    returncode: int
    exited_unix: float
    killed_by_launcher: bool
    """The launcher sent this process SIGKILL (teardown, a declared-dead rank, a second
    Ctrl-C) and it died of it."""


@attrs.define
class ExitLog:
    """The exits of one rank's processes, in order, and the pids the launcher killed."""

    facts: list[ExitFact] = attrs.field(factory=list)
    killed: dict[int, float] = attrs.field(factory=dict)
    """pid -> unix time the launcher sent it SIGKILL."""

    def killing(self, process: RankHandle) -> None:
        """The launcher is about to SIGKILL ``process``: noted only if it still runs, so the
        kill of a process that died already (of another's SIGKILL, not yet reaped) is not
        claimed as ours."""
        if process.returncode is None and _running(process.pid):
            self.killed.setdefault(process.pid, time.time())

    def exited(self, rank: int, pid: int, returncode: int, when: float) -> ExitFact:
        by_us = pid in self.killed and returncode == -signal.SIGKILL
        fact = ExitFact(rank, pid, returncode, when, by_us)
        self.facts.append(fact)
        return fact


def _running(pid: int) -> bool:
    """Our child ``pid`` has not exited (a zombie has); looked at without reaping it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:  # reaped already, or not our child: not ours to kill
        return False


def signal_name(returncode: int | None) -> str | None:
    """``SIGKILL`` for -9 (a process killed by a signal); None for a plain exit code."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def describe_exit(returncode: int | None) -> dict[str, Any]:
    """``{"exit_code": 3, "signal": None}`` or ``{"exit_code": None, "signal": "SIGKILL"}``."""
    name = signal_name(returncode)
    return {"exit_code": None if name else returncode, "signal": name}


def exit_text(returncode: int | None) -> str:
    """What the summary table shows for an exit: ``0``, ``3``, ``SIGKILL``, ``-`` (none)."""
    if returncode is None:
        return "-"
    return signal_name(returncode) or str(returncode)
