"""Who joins the run and when it starts: the decisions of the joining phase, and rejoins.

Until the world has joined, every rank the run waits for connects and says ``Ready`` before the
join deadline. A rank whose process dies first is waited for when it is restarted, else the run
goes on without it while enough ranks remain (:meth:`Membership.died_joining`); when the join
timeout passes, the run starts without the ranks still missing, or fails
(:meth:`Membership.give_up_on`). When every rank's process is the launcher's (``flodl run``), a
rank that exits 0 before any rank connected may be a plain torchrun script that never joins
flodl: such exits are held back and the join timeout does not apply; when every rank exits so,
the run is complete, and once one rank connects the held-back exits are deaths before joining.
Once training, a rank that says ``Ready`` with the run's job waits as a joiner for the next round.

:class:`Joining` decides what those events mean and records them; it never forms the group.
A decision after which the run goes on returns None, and the machine then asks
:meth:`Joining.world_joined` whether generation 0 can form. Pure: no clocks, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from flodl.core.coordinator.effects import Broadcast
from flodl.core.coordinator.ending import Ending
from flodl.core.coordinator.liveness import Liveness
from flodl.core.coordinator.membership import Membership
from flodl.core.coordinator.settings import MachineSettings
from flodl.core.coordinator.stats import RankStats
from flodl.core.coordinator.timeline import EventKind, Timeline
from flodl.wire.messages import Ready

__all__ = ["Joining"]


class Joining:
    """The joining decisions of a run of ``world_size`` ranks (module docstring).

    ``supervised``: every rank's process is the launcher's, which reports their exits.
    ``membership`` holds the job and the ranks the run waits for; ``liveness`` says which are
    connected; ``ending`` ends a run that cannot start; ``timeline`` and ``stats`` record.
    """

    def __init__(
        self,
        world_size: int,
        settings: MachineSettings,
        membership: Membership,
        liveness: Liveness,
        ending: Ending,
        timeline: Timeline,
        stats: Sequence[RankStats],
        *,
        supervised: bool,
    ) -> None:
        self._world_size = world_size
        self._settings = settings
        self._supervised = supervised
        self._membership = membership
        self._liveness = liveness
        self._ending = ending
        self._timeline = timeline
        self._stats = stats
        self._unjoined_exits: set[int] = set()
        """Ranks whose process exited 0 before any rank connected: a script that may never
        join flodl (a plain torchrun script), or ranks that are deaths once another joins."""
        self._any_joined = False
        """Some rank connected (a stats entry has ``joined_at``): kept as a flag because
        the machine's next_deadline() asks after every report, and a scan of 4,096 entries
        there made the joining phase quadratic."""

    @property
    def deadline(self) -> float | None:
        """When the world must have joined, while the join timeout applies; else None (the
        world joined, or none of a launcher's ranks connected yet: a plain torchrun script
        runs as long as it needs, and their exits end the run)."""
        deadline = self._membership.join_deadline
        if deadline is None or (self._supervised and not self._any_joined):
            return None
        return deadline

    def connected(self, rank: int, now: float) -> None:
        """``rank`` completed its handshake (a first join or a rejoin): recorded."""
        self._stats[rank].joined_at = now
        self._any_joined = True
        self._timeline.add(now, EventKind.RANK_JOINED, rank=rank)

    def held_back_exit(self) -> int | None:
        """Take one held-back exit (:meth:`exited_unjoined`); None when none is left. Once a
        rank connected, each is a death before joining, for the caller to pass to :meth:`died`."""
        return self._unjoined_exits.pop() if self._unjoined_exits else None

    def exited_unjoined(self, rank: int, now: float) -> list[Broadcast] | None:
        """``rank`` exited 0 without connecting (and is not restarted). Before any rank
        connected, the exit is held back: ``[]``, or the effects of the run's end once every
        rank exited so (flodl run as a plain launcher). Once one connected, it is a death before
        joining: None, and the caller passes it to :meth:`died`."""
        if self._any_joined:
            return None
        self._unjoined_exits.add(rank)
        if len(self._unjoined_exits) < self._world_size:
            return []
        why = "every rank exited 0 without joining flodl (the script never calls flodl.worker.join)"
        return list(self._ending.shutdown(now, why))

    def died(self, rank: int, why: str, now: float, *, restarting: bool) -> list[Broadcast] | None:
        """``rank``'s process died before the world joined (its connection, if it had one, is
        already lost): the death is recorded unless its hang-up recorded it. Returns the effects
        that end the run when it cannot start, ``[]`` when the restarted rank is waited for, or
        None when the run goes on without it (recorded as ``GoingOnWithout``)."""
        if rank not in self._membership.left:  # else recorded when it hung up
            self._stats[rank].lost_at = now
            self._timeline.add(now, EventKind.RANK_DEAD, rank=rank, cause="exited", why=why)
        fails = self._membership.died_joining(rank, restarting, self._settings)
        if fails is not None:
            return list(self._ending.fail(now, why + fails))
        if restarting:
            return []
        remaining = sorted(self._membership.expected())
        self._timeline.add(now, EventKind.GOING_ON_WITHOUT, rank=rank, why=why, ranks=remaining)
        return None

    def timed_out(self, now: float) -> list[Broadcast] | None:
        """The join deadline passed with ranks missing: the effects that end the run when too
        few joined, else None (the run goes on without them, recorded as ``GoingOnWithout``)."""
        missing = self._membership.missing()
        timeout = self._settings.timeouts.join
        why = f"ranks {missing} did not join within the join timeout ({timeout:g} s)"
        fails = self._membership.give_up_on(missing, self._settings)
        if fails is not None:
            return list(self._ending.fail(now, why + fails))
        remaining = sorted(self._membership.expected())
        self._timeline.add(now, EventKind.GOING_ON_WITHOUT, ranks=remaining, why=why, rank=None)
        return None

    def ready(self, rank: int, ready: Ready, now: float, *, running: bool) -> str | None:
        """``rank`` said ``Ready``: why it is refused, or None. While the world joins it counts
        towards the world; once ``running``, it waits as a joiner for the next round (recorded
        as a rejoin)."""
        if not running:
            return self._membership.join(rank, ready)
        refused = self._membership.rejoin(rank, ready)
        if refused is None:
            self._timeline.add(now, EventKind.RANK_JOINED, rank=rank, rejoin=True)
        return refused

    def world_joined(self) -> list[int] | None:
        """The ranks to form generation 0 with, ascending, once every rank the run waits for is
        connected and ready (the join deadline then no longer applies); else None."""
        if not self._membership.all_joined(self._liveness.alive_view):
            return None
        return sorted(self._membership.expected())
