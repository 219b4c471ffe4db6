"""What losing ranks does to the run: the account of each death, and what the group does next.

A rank is lost when its connection ends, it is silent past the heartbeat timeout, or its
process exits (:class:`~flodl.core.coordinator.liveness.Liveness`). Every loss is recorded (the
rank's stats, the timeline's ``RankDead``) and the rank's ``Ready`` no longer counts. While the
world joins, that is all (what a death before joining means is
:class:`~flodl.core.coordinator.joining.Joining`'s). While generation 0 forms, the run is saved
when the losses leave it unrecoverable, else the rendezvous looks again at who is alive. Once
training, each lost member is declared dead to the survivors and its share of the window's work
is handed back; then the run is saved when the losses leave it unrecoverable; the survivors go
on in the same group when there is no collective group to re-form (or every loss was a clean
exit and no work is left); else the round in flight is abandoned and the survivors form the
next generation (:class:`~flodl.core.coordinator.formation.Formation`).

Whether a round is due is the machine's to decide: :meth:`Losses.lose` answers with its effects
and whether one may be (:class:`~flodl.core.coordinator.formation.Answer`). Pure: no clocks, no
I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from flodl.core.coordinator.effects import Broadcast, Effect
from flodl.core.coordinator.ending import Ending
from flodl.core.coordinator.formation import Answer, Formation, RunPhase
from flodl.core.coordinator.liveness import Liveness, LossCause, RankLost
from flodl.core.coordinator.membership import Membership
from flodl.core.coordinator.rounds import Rounds
from flodl.core.coordinator.settings import MachineSettings
from flodl.core.coordinator.stats import RankStats
from flodl.core.coordinator.timeline import EventKind, Timeline
from flodl.wire.messages import DeclareDead

__all__ = ["Losses"]


class Losses:
    """The run's losses: recorded in ``stats`` and ``timeline``, and answered (module
    docstring).

    ``formation`` says where the run is and forms the next generation; ``membership`` and
    ``liveness`` say who was a member and who is alive; ``rounds`` takes back a lost member's
    work; ``ending`` says whether the losses leave the run unrecoverable and saves it.
    """

    def __init__(
        self,
        settings: MachineSettings,
        formation: Formation,
        membership: Membership,
        liveness: Liveness,
        rounds: Rounds,
        ending: Ending,
        timeline: Timeline,
        stats: Sequence[RankStats],
    ) -> None:
        self._settings = settings
        self._formation = formation
        self._membership = membership
        self._liveness = liveness
        self._rounds = rounds
        self._ending = ending
        self._timeline = timeline
        self._stats = stats

    def lost_ranks(self) -> frozenset[int]:
        """Ranks declared dead that did not join again since."""
        return frozenset(
            rank
            for rank, stats in enumerate(self._stats)
            if stats.lost_at is not None
            and (stats.joined_at is None or stats.joined_at <= stats.lost_at)
        )

    def lose(self, losses: Sequence[RankLost], now: float, why: str) -> Answer:
        """Record ``losses`` (detected at ``now``, for the reason ``why``) and carry out what
        they do to the run (module docstring). After the run's end, nothing: ranks hanging up
        then are not deaths."""
        if self._ending.over:
            return Answer([])
        membership = self._membership
        for loss in losses:
            stats = self._stats[loss.rank]
            stats.lost_at = now
            stats.loss_cause = loss.cause.value
            membership.forget(loss.rank)
            self._timeline.add(
                now, EventKind.RANK_DEAD, rank=loss.rank, cause=loss.cause.value, why=why
            )
        phase = self._formation.phase
        if phase is RunPhase.JOINING:
            membership.left.update(loss.rank for loss in losses)
            return Answer([])
        self._formation.note_losses(now)
        membership.drop_joiners(loss.rank for loss in losses)
        lost = [loss.rank for loss in losses if loss.rank in membership.member_set]
        survivors = tuple(r for r in membership.members if self._liveness.is_alive(r))
        if phase is RunPhase.FORMING:
            if unrecoverable := self._ending.unrecoverable():
                return Answer(list(self._ending.save(unrecoverable, now, why)))
            return self._formation.poll(now)
        effects: list[Effect] = []
        for rank in lost:
            effects.append(Broadcast(DeclareDead(rank=rank), survivors))
            effects += self._rounds.drop(rank, survivors, now)
        if unrecoverable := self._ending.unrecoverable():
            effects += self._ending.save(unrecoverable, now, why)
            return Answer(effects)
        if not lost:
            return Answer(effects)
        if not self._settings.collective or (all_exited(losses) and self._rounds.all_work_done()):
            # Without a collective group there is nothing to re-form: the survivors go on.
            return Answer(effects, may_be_due=True)
        self._rounds.abandon()
        if self._formation.pending:
            regrouped = self._formation.poll(now, reforming=True)
        else:
            regrouped = self._formation.reform(now, survivors)
        return Answer(effects + regrouped.effects, regrouped.may_be_due)


def all_exited(losses: Sequence[RankLost]) -> bool:
    """Every loss was a clean exit (the rank announced it)."""
    return all(loss.cause is LossCause.EXITED for loss in losses)
