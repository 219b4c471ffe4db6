"""The running of a host's ranks (:class:`~flodl.agent.host_ranks.HostRanks`), shared by ``flodl
agent`` and ``flodl run``, on real processes: exits reported at once, a failed rank restarted,
the run's end lets ranks exit and kills the ones that do not, lost ranks first."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Collection, Sequence
from pathlib import Path

import trio

from flodl.agent.host_ranks import HostRanks
from flodl.supervise.exits import RankExit
from flodl.supervise.ranks import Supervision

# Rank 0 fails on its first start and exits 0 once restarted; rank 1 runs until killed.
SCRIPT = """
import sys, time
rank, restarts = int(sys.argv[1]), int(sys.argv[2])
print(f"rank {rank} start {restarts}", flush=True)
if rank == 0:
    sys.exit(3 if restarts == 0 else 0)
time.sleep(600)
"""


class Link:
    """A run that ends when the test says so; it keeps every exit it hears of."""

    def __init__(self, lost: Collection[int] = ()) -> None:
        self.exits: list[RankExit] = []
        self.heard = trio.Event()
        self.ended = trio.Event()
        self.stops: list[bool] = []
        self._lost = lost

    @property
    def run_ended(self) -> bool:
        return self.ended.is_set()

    def rank_exited(self, exit: RankExit) -> Sequence[str]:
        self.exits.append(exit)
        self.heard.set()
        return []

    def request_stop(self, save: bool = True) -> None:
        self.stops.append(save)

    async def wait_ended(self) -> None:
        await self.ended.wait()

    def lost_ranks(self) -> Collection[int]:
        return self._lost


def host_of(tmp_path: Path, exit_grace: float) -> HostRanks:
    async def start(rank: int, restarts: int) -> trio.Process:
        return await trio.lowlevel.open_process(
            [sys.executable, "-c", SCRIPT, str(rank), str(restarts)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    supervision = Supervision(tmp_path, restarts=1, echo=False)
    return HostRanks(range(2), start, supervision, exit_grace=exit_grace, kill_says=("a", "b"))


async def test_a_failed_rank_is_restarted_and_the_end_kills_a_rank_that_stays(
    tmp_path: Path,
) -> None:
    link = Link()
    host = host_of(tmp_path, exit_grace=0.5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(host.run, link)
        while len(link.exits) < 2:  # rank 0's failure, then its restarted process's exit
            await link.heard.wait()
            link.heard = trio.Event()
        link.ended.set()
    first, second, killed = link.exits  # the kill at the end is reported too
    assert (first.rank, first.returncode, first.restarting) == (0, 3, True)
    assert (second.rank, second.returncode, second.restarting) == (0, 0, False)
    assert (killed.rank, killed.returncode, killed.restarting) == (1, -9, False)
    rank0, rank1 = host.spawned
    assert rank0.restarts == 1 and [code for code, _ in rank0.exits] == [3, 0]
    assert rank1.exit_code == -9  # it outlived the exit grace
    assert (tmp_path / "rank0.log").read_text() == "rank 0 start 0\nrank 0 start 1\n"
    assert link.stops == []


async def test_a_lost_rank_is_killed_without_waiting_out_the_exit_grace(tmp_path: Path) -> None:
    link = Link(lost={1})
    host = host_of(tmp_path, exit_grace=600.0)  # only a lost rank's short grace can end it
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(host.run, link)
            while len(link.exits) < 2:
                await link.heard.wait()
                link.heard = trio.Event()
            link.ended.set()
    assert [item.exit_code for item in host.spawned] == [0, -9]
