"""Running one host's ranks from start to end: the agent's supervision, shared by ``flodl agent``
and ``flodl run``.

:class:`HostRanks` starts the host's rank processes, supervises them
(:func:`~flodl.supervise.ranks.supervise_rank`: output relayed, each exit reported at once,
failed ranks restarted), kills a rank the run declared dead for silence
(:meth:`HostRanks.kill_silenced`), turns stop signals into a save of the run, and once the run
is over lets the ranks exit and kills what is left. What it answers to is a :class:`RunLink`:
the agent's connection to a coordinator elsewhere (:class:`~flodl.agent.link.AgentLink`), or, under
``flodl run``, the coordinator in the same process. So one host and many are supervised by the
same code; only the link differs.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Protocol

import trio

from flodl.coordinator.signals import Stoppable, StopSignals, watch_signals
from flodl.core.coordinator.timeline import TimelineEvent
from flodl.supervise.exits import ExitSink
from flodl.supervise.ranks import (
    LOST_RANK_GRACE,
    RankHandle,
    RankProcess,
    Supervision,
    kill_rank_groups,
    kill_ranks,
    let_ranks_exit,
    supervise_rank,
)

__all__ = ["HostRanks", "RunLink", "StartRank", "silenced_ranks"]

StartRank = Callable[[int, int], Awaitable[RankHandle]]
"""``start(rank, restart_count)``: the rank's process, started (in a session of its own)."""


class RunLink(ExitSink, Stoppable, Protocol):
    """What a host's ranks answer to: where their exits go (:class:`ExitSink`) and stop
    requests are sent (:class:`Stoppable`), and what says the run ended."""

    async def wait_ended(self) -> None:
        """Return once the run is over for this host (ended, or its coordinator lost)."""
        ...

    def lost_ranks(self) -> Collection[int]:
        """Ranks the run lost (given a moment to exit on their own, then killed)."""
        ...


class HostRanks:
    """One host's rank processes for one run (:meth:`run`); :attr:`spawned` and :attr:`stops`
    say what became of them, also when :meth:`run` raised."""

    def __init__(
        self,
        ranks: Sequence[int],
        start: StartRank,
        supervision: Supervision,
        *,
        exit_grace: float,
        kill_says: tuple[str, str],
    ) -> None:
        self._ranks = ranks
        self._start = start
        self._supervision = supervision
        self._exit_grace = exit_grace
        self._kill_says = kill_says
        self.spawned: list[RankProcess] = []
        """Every rank started, in rank order, with its exits and restarts."""
        self.stops = StopSignals()
        """The stop signals received, and whether a second one killed the ranks."""

    async def run(self, link: RunLink) -> None:
        """Start the ranks, supervise them until ``link`` says the run ended, then let them exit:
        the ranks the run lost get a moment, every other ``exit_grace`` seconds, then what is
        left is killed.

        Guarantees: every process started here has exited, and each one's exit code is recorded
        in :attr:`spawned`, when this returns or raises, including on cancellation.
        """
        spawned = self.spawned
        try:
            async with trio.open_nursery() as nursery:
                kill = functools.partial(kill_rank_groups, spawned)
                await nursery.start(watch_signals, link, self.stops, kill, self._kill_says)
                async with trio.open_nursery() as supervising:
                    for rank in self._ranks:
                        item = RankProcess(rank, await self._start(rank, 0), time.time())
                        spawned.append(item)
                        supervising.start_soon(self._supervise, item, link)
                    await link.wait_ended()
                    lost = link.lost_ranks()
                    await let_ranks_exit(spawned, lost)
                    # Ranks declared dead for silence will not exit on their own.
                    kill_ranks(spawned, lost)
                    with trio.move_on_after(self._exit_grace):
                        for item in spawned:
                            await item.process.wait()
                    kill_rank_groups(spawned)
                    # The supervisors record the last exits; a relay held open by a stray
                    # child of a rank must not keep the host waiting.
                    supervising.cancel_scope.deadline = trio.current_time() + LOST_RANK_GRACE
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                kill_rank_groups(spawned, exited_too=True)
                for item in spawned:
                    code = await item.process.wait()
                    if item.exit_code is None:
                        item.exit_code = code
                        item.exited_unix = time.time()
                        item.exit_log.exited(item.rank, item.process.pid, code, item.exited_unix)

    def kill_silenced(self, rank: int) -> None:
        """SIGKILL ``rank``'s process if it is running: the run declared the rank dead for
        silence, and a paused (SIGSTOP) or stuck process does not exit on its own. Its
        supervisor sees the exit and restarts it, as after any failure (when restarts are left).

        Safe against killing a restarted process: a rank is declared silent only while its
        connection is open, and a process that exited first was reported (and the rank lost as
        exited) before its supervisor started another."""
        for item in self.spawned:
            if item.rank == rank and item.process.returncode is None:
                item.exit_log.killing(item.process)
                item.process.kill()

    async def _supervise(self, item: RankProcess, link: RunLink) -> None:
        async def restart(rank: int) -> RankHandle:
            return await self._start(rank, item.restarts)

        await supervise_rank(item, link, self._supervision, restart)


def silenced_ranks(kill: Callable[[int], None]) -> Callable[[int, TimelineEvent], None]:
    """An event sink (``Coordinator.add_event_sink``) that calls ``kill(rank)`` for each rank
    the run declares dead for silence: how ``flodl run`` has its host's paused or stuck ranks
    killed, and so restarted, at once (:meth:`HostRanks.kill_silenced`)."""

    def sink(seq: int, event: TimelineEvent) -> None:
        rank = event.silenced_rank
        if rank is not None:
            kill(rank)

    return sink
