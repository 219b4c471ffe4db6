"""Who trains: the job the ranks agreed on, the members of the group, the ranks waiting to join.

A run starts when every rank has said ``Ready`` with the same job before the join deadline;
a rank that describes a job that cannot run, or another job than the others, is refused.
Once training, a rank that (re)connects with the run's job and is not a member waits as a
*joiner* until the next round grows the group. :class:`Membership` decides those admissions,
which ranks may be in the next group (alive, and members or joiners once training), and when
the rendezvous has formed a generation that the run has not adopted yet. It holds no
connection state; liveness is asked for by the caller. Pure: no clocks, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from flodl.core.job import Job
from flodl.core.rendezvous import Rendezvous
from flodl.wire.messages import Ready

__all__ = ["Membership"]


class Membership:
    """The job, the members of the current group and the joiners of a run of ``world_size``.

    ``join_deadline``: when the world must have joined (None once it has).
    """

    def __init__(self, world_size: int, *, join_deadline: float) -> None:
        self.world_size = world_size
        self.join_deadline: float | None = join_deadline
        self.job: Job | None = None
        self.members: tuple[int, ...] = ()
        self.member_set: frozenset[int] = frozenset()
        """``members`` as a set: membership tests run on every report."""
        self.joiners: set[int] = set()
        """Ranks that reconnected after a death and wait for the next round to rejoin."""
        self._ready: set[int] = set()
        self._adopted: int | None = None
        """The generation the members were taken from."""

    def join(self, rank: int, ready: Ready) -> str | None:
        """``rank`` is ready while the world joins; why it is refused, or None."""
        job = Job(ready.dataset_size, ready.batch_size, ready.epochs)
        problem = job.problem()
        if problem is not None:
            return f"rank {rank} described a job that cannot run: {problem}"
        if self.job is None:
            self.job = job
        elif job != self.job:
            return f"rank {rank} describes job {job}, others {self.job}"
        self._ready.add(rank)
        return None

    def all_joined(self, alive: frozenset[int]) -> bool:
        """Every rank is alive and ready: the join deadline no longer applies."""
        if len(self._ready & alive) < self.world_size:
            return False
        self.join_deadline = None
        return True

    def missing(self) -> list[int]:
        """The ranks that have not said Ready, ascending."""
        return sorted(set(range(self.world_size)) - self._ready)

    def rejoin(self, rank: int, ready: Ready) -> str | None:
        """``rank`` (re)connected to the running job; why it is refused, or None (a joiner)."""
        job = Job(ready.dataset_size, ready.batch_size, ready.epochs)
        if job != self.job:
            return f"rank {rank} describes job {job}, the run is {self.job}"
        if rank in self.member_set:
            return f"rank {rank} is already a member of the group"
        self.joiners.add(rank)
        return None

    def forget(self, rank: int) -> None:
        """``rank``'s connection is gone: its Ready no longer counts."""
        self._ready.discard(rank)

    def drop_joiners(self, ranks: Iterable[int]) -> None:
        """These ranks died: they no longer wait to join."""
        self.joiners -= set(ranks)

    def eligible(self, alive: frozenset[int], *, forming: bool) -> frozenset[int]:
        """Ranks that may be in the next group: alive and (once training) members or joiners."""
        if forming:
            return alive
        return alive & (self.member_set | self.joiners)

    def newly_formed(self, rendezvous: Rendezvous) -> bool:
        """The rendezvous finished a generation the run has not adopted; it is adopted now."""
        generation = rendezvous.generation
        if generation is None or generation == self._adopted or rendezvous.pending:
            return False
        self._adopted = generation
        return True

    def adopt(self, members: tuple[int, ...], *, welcome: bool) -> None:
        """``members`` are the group now; with ``welcome`` the joiners among them stop waiting."""
        self.members = members
        self.member_set = frozenset(members)
        if welcome:
            self.joiners -= set(members)
