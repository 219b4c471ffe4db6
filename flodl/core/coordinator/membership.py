"""Who trains: the job the ranks agreed on, the members of the group, the ranks waiting to join.

A run starts when every rank has said ``Ready`` with the same job before the join deadline;
a rank that describes a job that cannot run, or another job than the others, is refused. A
rank whose process died before that and will not be started again is *gone*: the run starts
with the others (:meth:`Membership.give_up`; whether enough remain is the machine's call).
Once training, a rank that (re)connects with the run's job and is not a member waits as a
*joiner* until the next round grows the group. :class:`Membership` decides those admissions,
which ranks may be in the next group (alive, and members or joiners once training), and when
the rendezvous has formed a generation that the run has not adopted yet. It holds no
connection state; liveness is asked for by the caller. Pure: no clocks, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set

from flodl.core.common.job import Job
from flodl.core.coordinator.liveness import unrecoverable_reason
from flodl.core.coordinator.rendezvous import Rendezvous
from flodl.core.coordinator.settings import MachineSettings
from flodl.wire.messages import Ready

__all__ = ["Membership"]


class Membership:
    """The job, the members of the current group and the joiners of a run of ``world_size``.

    ``join_deadline``: when the world must have joined (None once it has).
    """

    def __init__(self, world_size: int, join_deadline: float, *, first_epoch: int = 0) -> None:
        self.world_size = world_size
        self.first_epoch = first_epoch
        """The epoch the run starts at (a resumed run's; 0 for a fresh one)."""
        self.join_deadline: float | None = join_deadline
        self.job: Job | None = None
        self.members: tuple[int, ...] = ()
        self.member_set: frozenset[int] = frozenset()
        """``members`` as a set: membership tests run on every report."""
        self.joiners: set[int] = set()
        """Ranks that reconnected after a death and wait for the next round to rejoin."""
        self._ready: set[int] = set()
        self.gone: set[int] = set()
        """Ranks that died before the world joined and are not coming back."""
        self.died: set[int] = set()
        """Ranks whose process died (at least once) before the world joined."""
        self.left: set[int] = set()
        """Ranks whose connection ended while joining (the death was recorded then)."""
        self._adopted: int | None = None
        """The generation the members were taken from."""

    def join(self, rank: int, ready: Ready) -> str | None:
        """``rank`` is ready while the world joins; why it is refused, or None."""
        job = Job(ready.dataset_size, ready.batch_size, ready.epochs)
        problem = job.problem()
        if problem is None and job.epochs < self.first_epoch:
            problem = (
                f"it trains {job.epochs} epochs, and the run it resumes had reached epoch "
                f"{self.first_epoch} (resume with at least that many epochs)"
            )
        if problem is not None:
            return f"rank {rank} described a job that cannot run: {problem}"
        if self.job is None:
            self.job = job
        elif job != self.job:
            return f"rank {rank} describes job {job}, others {self.job}"
        self._ready.add(rank)
        return None

    def all_joined(self, alive: Set[int]) -> bool:
        """Every rank that is not gone is alive and ready (and one is): the join deadline no
        longer applies."""
        if len(self._ready) < self.world_size - len(self.gone):
            return False  # some rank is not ready yet: asked on every Ready, so no set built
        expected = self.expected()
        if not expected or not expected <= self._ready & alive:
            return False
        self.join_deadline = None
        return True

    def expected(self) -> frozenset[int]:
        """The ranks the run waits for: every rank but the gone ones."""
        return frozenset(range(self.world_size)) - self.gone

    def died_joining(self, rank: int, restarting: bool, settings: MachineSettings) -> str | None:
        """``rank``'s process died before the world joined: a death like any other. Restarted,
        it is waited for; else it is *gone*, and the run starts without it while enough ranks
        remain. Returns why the run cannot start (appended to the death's own reason), or None.
        A world whose every rank died unjoined has a broken script: it ends at once."""
        self.left.discard(rank)
        self.died.add(rank)
        if len(self.died) == self.world_size and not self._ready:
            return ""
        if restarting:
            return None
        self.gone.add(rank)
        self._ready.discard(rank)
        remaining = len(self.expected())
        if settings.min_ranks is not None and remaining < settings.min_ranks:
            return f"; {remaining} ranks remain, fewer than min_ranks {settings.min_ranks}"
        reason = unrecoverable_reason(
            world_size=self.world_size,
            alive=remaining,
            failures=len(self.died),
            max_failure=settings.max_failure,
            collective=settings.collective and settings.min_ranks is None,
        )
        return None if reason is None else f"; {remaining} ranks remain ({reason.name})"

    def give_up_on(self, ranks: Sequence[int], settings: MachineSettings) -> str | None:
        """The join timeout passed without ``ranks``: the run starts without them while at
        least ``min_ranks`` joined (default: 2 for a collective group, else 1). Returns why
        it cannot start (appended to the timeout's reason), or None; the join deadline is
        gone either way (a rank that joins later is a rejoiner)."""
        self.join_deadline = None
        joined = len(self.expected()) - len(ranks)
        required = settings.min_ranks or (2 if settings.collective else 1)
        if joined < max(required, 1):
            return f"; {joined} joined, fewer than min_ranks {required}"
        self.gone.update(ranks)
        return None

    def missing(self) -> list[int]:
        """The ranks that have not said Ready (the gone ones aside), ascending."""
        return sorted(self.expected() - self._ready)

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
