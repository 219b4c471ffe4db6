"""Each generation of the group as the run takes it, and where the run is (:class:`RunPhase`).

The :class:`~flodl.core.coordinator.rendezvous.Rendezvous` forms generations of the collective
group; :class:`Formation` asks it for one and carries out what a formed one means for the run.
Generation 0 is formed once the world has joined: its members are adopted and training begins.
A later one is formed after a loss or to let joiners in: the members are adopted (the joiners
among them stop waiting), the ElChe state is carried over to them, the timeline records how long
the group took to answer the losses, and the round that was interrupted is redone, or, when
none was, a round may be due. A rendezvous that runs out of candidates ends the run with a save.

Whether a round is due is the machine's to decide, so every step answers with its effects and
whether a round may be due now (:class:`Answer`). Pure: no clocks, no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from flodl.core.coordinator.effects import Broadcast, Effect
from flodl.core.coordinator.ending import Ending
from flodl.core.coordinator.liveness import Liveness
from flodl.core.coordinator.membership import Membership
from flodl.core.coordinator.rendezvous import Rendezvous
from flodl.core.coordinator.rounds import Rounds
from flodl.core.coordinator.timeline import EventKind, Timeline
from flodl.wire.messages import NewGroupReady, ShutdownWithSave

__all__ = ["Answer", "Formation", "RunPhase"]


class RunPhase(enum.Enum):
    """Where the run is (see :mod:`flodl.core.coordinator.machine`); ElChe's calibration phase
    is another thing, :class:`flodl.core.cadence.phases.Phase`."""

    JOINING = "joining"
    FORMING = "forming"
    TRAINING = "training"
    REFORMING = "reforming"
    FINISHED = "finished"


@attrs.frozen
class Answer:
    """What a part answers to an event: ``effects`` to perform, in order, and then, with
    ``may_be_due``, the machine sees whether a round is due."""

    effects: list[Effect]
    may_be_due: bool = False


class Formation:
    """The run's phase and the generations of its group (module docstring).

    ``rendezvous`` forms them; ``membership`` takes their members; ``rounds`` begins, carries
    over and redoes the rounds; ``ending`` ends a run whose group cannot be formed, and says
    when the run is over (its phase is then FINISHED, which :attr:`phase` leaves to the caller).
    """

    def __init__(
        self,
        rendezvous: Rendezvous,
        membership: Membership,
        liveness: Liveness,
        rounds: Rounds,
        ending: Ending,
        timeline: Timeline,
    ) -> None:
        self._rendezvous = rendezvous
        self._membership = membership
        self._liveness = liveness
        self._rounds = rounds
        self._ending = ending
        self._timeline = timeline
        self.phase = RunPhase.JOINING
        """Where the run is, until it is over (never FINISHED)."""
        self._lost_since: float | None = None
        """When the first death the next re-formed group answers was detected."""

    @property
    def generation(self) -> int:
        """The generation of the group formed last (0 before one is)."""
        return self._rendezvous.generation or 0

    @property
    def pending(self) -> bool:
        """A generation is being formed."""
        return self._rendezvous.pending

    @property
    def running(self) -> bool:
        """Rounds may start and work be handed out: training, and no group is forming."""
        return (
            self.phase is RunPhase.TRAINING
            and not self._rendezvous.pending
            and not self._ending.over
        )

    def eligible(self) -> frozenset[int]:
        """The ranks that may be in the group being formed: every live rank for generation
        0, the live members and joiners for a later one."""
        forming = self.phase is RunPhase.FORMING and not self._ending.over
        return self._membership.eligible(self._liveness.alive, forming=forming)

    def note_losses(self, now: float) -> None:
        """Ranks were lost at ``now``: the next re-formed group answers them (the timeline
        records how long it took from the first)."""
        if self._lost_since is None:
            self._lost_since = now

    def form_initial(self, now: float, ranks: Sequence[int]) -> Answer:
        """The world has joined: form generation 0 with ``ranks``."""
        self.phase = RunPhase.FORMING
        return self._take(self._rendezvous.form_initial(now, ranks), now)

    def reform(self, now: float, members: tuple[int, ...]) -> Answer:
        """Form the next generation of the group with ``members``."""
        self.phase = RunPhase.REFORMING
        ms_per_batch = self._rounds.pacing.ms_per_batch()
        return self._take(self._rendezvous.begin(now, members, ms_per_batch=ms_per_batch), now)

    def poll(self, now: float, *, reforming: bool = False) -> Answer:
        """Let the pending formation act on the time and the eligible ranks (with
        ``reforming``: the run is re-forming from now on, so its next generation is asked of)."""
        if reforming:
            self.phase = RunPhase.REFORMING
        return self._take(self._rendezvous.poll(now, self.eligible()), now)

    def on_ready(self, now: float, message: NewGroupReady) -> Answer:
        """The generator of the pending formation says the new group is ready."""
        return self._take(self._rendezvous.on_ready(now, message, self.eligible()), now)

    def _take(self, effects: Sequence[Effect], now: float) -> Answer:
        """Pass on the rendezvous's effects; carry out a finished formation or end the run
        with a save on an exhausted one."""
        out: list[Effect] = []
        for effect in effects:
            if isinstance(effect, Broadcast) and isinstance(effect.message, ShutdownWithSave):
                reason = effect.message.reason
                out += self._ending.save(reason, now, "no group could be formed")
                return Answer(out)
            out.append(effect)
        if self._ending.over or not self._membership.newly_formed(self._rendezvous):
            return Answer(out)
        formed = self._formed(now)
        return Answer(out + formed.effects, formed.may_be_due)

    def _formed(self, now: float) -> Answer:
        """The rendezvous formed a generation the run has not adopted: adopt it."""
        members = self._rendezvous.members
        generation = self._rendezvous.generation
        assert generation is not None
        if self.phase is RunPhase.FORMING:
            self._membership.adopt(members, welcome=False)
            self.phase = RunPhase.TRAINING
            job = self._membership.job
            assert job is not None
            return Answer(list(self._rounds.begin(job, now, generation)))
        self._rounds.carry_over(members)
        self._membership.adopt(members, welcome=True)
        self.phase = RunPhase.TRAINING
        took = None if self._lost_since is None else now - self._lost_since
        self._lost_since = None
        self._timeline.add(
            now,
            EventKind.GROUP_REFORMED,
            generation=generation,
            members=list(members),
            took_s=took,
        )
        if self._rounds.cycle.settled:
            return Answer([], may_be_due=True)
        return Answer(list(self._rounds.redo(now, generation)))
