"""Supervising the rank processes of one host: relay their output, report their exits, restart
the ones that fail, and leave none behind.

Each rank leads a session of its own (``start_new_session``), so the signals a terminal sends to
its foreground process group never reach a rank, and :func:`kill_rank_groups` can kill a rank
with every child it started. What becomes of a rank's exit is not decided here: the exit goes to
an :class:`~flodl.supervise.exits.ExitSink`, and the supervisor only asks it whether the run is
over before it restarts a rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path

import attrs
import trio

from flodl.host.appender import Appender
from flodl.host.console import say
from flodl.supervise.exits import ExitLog, ExitSink, RankExit
from flodl.supervise.warm import RankHandle, WarmStarter, WarmStartError

__all__ = [
    "LOST_RANK_GRACE",
    "RankHandle",
    "RankProcess",
    "RankStarter",
    "RestartBudget",
    "Supervision",
    "kill_rank_groups",
    "kill_ranks",
    "let_ranks_exit",
    "open_rank_process",
    "start_rank_process",
    "supervise_rank",
]

LOST_RANK_GRACE = 2.0
"""Seconds a lost rank's process gets to exit on its own (its traceback, its report) before
the supervisor kills it at the end of the run."""


@attrs.define
class RankProcess:
    """One spawned rank and what became of it."""

    rank: int
    process: RankHandle
    started_unix: float
    exit_code: int | None = None
    exited_unix: float | None = None
    exits: list[tuple[int, float]] = attrs.field(factory=list)
    """Every exit of this rank's processes: (code, unix time); more than one after restarts."""
    restarts: int = 0
    exit_log: ExitLog = attrs.field(factory=ExitLog)
    """Each exit with its pid, and the processes the supervisor killed (the failure report's)."""


@attrs.define
class RestartBudget:
    """Restarts shared by every rank of a host (``flodl agent --restarts``)."""

    left: int

    def take(self) -> bool:
        """Spend one restart; False when none is left."""
        if self.left <= 0:
            return False
        self.left -= 1
        return True


@attrs.frozen
class Supervision:
    """How the ranks of one host are supervised."""

    log_dir: Path
    """Each rank's output goes to ``log_dir/rank<N>.log`` (appended across restarts)."""
    restarts: int = 0
    """How many times a rank whose process failed is started again."""
    echo: bool = True
    """Relay the ranks' output, prefixed ``[rank N]``, to this process's stdout."""
    show_ranks: frozenset[int] | None = None
    """Relay only these ranks' output (None: every rank's)."""
    shared: RestartBudget | None = None
    """Restarts the host's ranks share (None: each rank may restart ``restarts`` times)."""

    def may_restart(self, spawned: RankProcess) -> bool:
        """Whether ``spawned``, whose process just failed, is started again (spends one)."""
        if self.shared is not None:
            return self.shared.take()
        return spawned.restarts < self.restarts

    def log_of(self, rank: int) -> Path:
        return self.log_dir / f"rank{rank}.log"

    def echoes(self, rank: int) -> bool:
        return self.echo and (self.show_ranks is None or rank in self.show_ranks)


async def open_rank_process(argv: Sequence[str], env: dict[str, str]) -> trio.Process:
    """Start a rank's process: in a session of its own (out of the terminal's process group:
    the signals a terminal sends are the supervisor's to handle), its output piped for
    :func:`relay_output`, no input."""
    return await trio.lowlevel.open_process(
        list(argv),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


async def start_rank_process(
    warm: WarmStarter | None, argv: Sequence[str], env: dict[str, str]
) -> RankHandle:
    """Start a rank's process: forked by ``warm`` when there is one and it can (the notice of
    a warm start that failed goes to stdout), else cold (:func:`open_rank_process`)."""
    if warm is not None:
        try:
            return await warm.start(argv, env)
        except WarmStartError as err:
            say(f"flodl: {err}; starting the rank cold")
    return await open_rank_process(argv, env)


@attrs.define
class RankStarter:
    """Starts a host's rank processes, as :class:`~flodl.agent.host_ranks.HostRanks` asks
    (a rank and its restart count): :attr:`argv` with :attr:`environment`'s variables, forked
    by :attr:`warm` while it is set (:func:`start_rank_process`)."""

    argv: Sequence[str]
    environment: Callable[[int, int], dict[str, str]]
    """A rank's variables, given its rank and restart count."""
    warm: WarmStarter | None = None
    """The warm-start helper, once it is up (None: ranks start cold)."""

    async def __call__(self, rank: int, restart_count: int) -> RankHandle:
        return await start_rank_process(self.warm, self.argv, self.environment(rank, restart_count))


async def relay_output(rank: int, stream: trio.abc.ReceiveStream, echo: bool, log: Path) -> None:
    """Copy a rank's output to its log file and, prefixed, to our stdout (until a reader of
    ours is gone: the log still gets everything), to the end of the stream: the rank never
    blocks on a full pipe. A log that cannot be written (a full disk) is said once and tried
    again with each later chunk; what it missed meanwhile went to stdout only."""
    pending = b""
    sink = Appender(log, f"rank {rank}'s log {log}")
    sink.open()  # now, not at the first output: a rank's log is open while it runs
    try:
        async for chunk in stream:
            sink.append(chunk)
            if not echo:
                continue
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                echo = echo and say(f"[rank {rank}] {line.decode(errors='replace')}")
        if echo and pending:
            say(f"[rank {rank}] {pending.decode(errors='replace')}")
    finally:
        sink.close()


async def supervise_rank(
    spawned: RankProcess,
    sink: ExitSink,
    supervision: Supervision,
    restart: Callable[[int], Awaitable[RankHandle]],
) -> None:
    """Relay output until the process exits; report the exit to ``sink``; restart a failed rank.

    A rank whose process fails while the run goes on is started again (up to
    ``supervision.restarts`` times, or while the host's shared budget lasts); the new process
    rejoins the group at the next round, or joins the world if it died before the run started
    (the coordinator waits for it then).
    Each exit reaches ``sink`` as soon as the process is reaped, before any restart.
    """
    log = supervision.log_of(spawned.rank)
    while True:
        process = spawned.process
        async with trio.open_nursery() as nursery:
            if process.stdout is not None:
                echo = supervision.echoes(spawned.rank)
                nursery.start_soon(relay_output, spawned.rank, process.stdout, echo, log)
            code = await process.wait()
        spawned.exit_code = code
        spawned.exited_unix = time.time()
        spawned.exits.append((code, spawned.exited_unix))
        spawned.exit_log.exited(spawned.rank, process.pid, code, spawned.exited_unix)
        # After the run's end no rank is started again, and none spends the host's budget.
        restarting = code != 0 and not sink.run_ended and supervision.may_restart(spawned)
        exit = RankExit(spawned.rank, process.pid, code, spawned.exited_unix, restarting)
        for notice in sink.rank_exited(exit):
            if supervision.echo:
                say(f"flodl: {notice}")
        if not restarting or sink.run_ended:
            return
        spawned.restarts += 1
        spawned.process = await restart(spawned.rank)
        spawned.exit_code = None


async def let_ranks_exit(
    spawned: Sequence[RankProcess], ranks: Collection[int], grace: float = LOST_RANK_GRACE
) -> None:
    """Give the processes of ``ranks`` (those the coordinator lost and that did not rejoin) up
    to ``grace`` seconds, in all, to exit on their own before they are killed: a rank that
    raised has closed its connection before Python prints its traceback and the rank writes
    its report, and a kill at once would lose both."""
    with trio.move_on_after(grace):
        for item in spawned:
            if item.rank in ranks and item.process.returncode is None:
                await item.process.wait()


def kill_ranks(spawned: Sequence[RankProcess], ranks: Collection[int]) -> None:
    """SIGKILL the still running processes of ``ranks`` (ranks declared dead for silence,
    stopped or stuck, that will not exit on their own)."""
    for item in spawned:
        if item.rank in ranks and item.process.returncode is None:
            item.exit_log.killing(item.process)
            item.process.kill()


def kill_rank_groups(spawned: Sequence[RankProcess], *, exited_too: bool = False) -> None:
    """SIGKILL each rank's process group (the rank leads its own session).

    ``exited_too``: also the groups of ranks that already exited, for children they left. A
    group id stays reserved while any member lives, so it never names another user's process.
    """
    for item in spawned:
        process = item.process
        if process.returncode is not None and not exited_too:
            continue
        item.exit_log.killing(process)  # a no-op for a process that has exited
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
