"""What a rank's script asks of the run (``Intent``: a checkpoint, a save-and-stop, a stop of
the training), and the time budget.

A stop of the training before its epochs are done is asked by a rank's script
(``Intent(STOP)``, ``rank.stop(reason)``) or comes with the time budget (``max_time``).

A stop ends the run as a completed one, not a saved one: nothing more is handed out (the
batches not yet handed out are left untrained), the batches handed out are finished, a last
round averages them, and the run ends as when every epoch is done (the final bundles, then
``Shutdown``), so every rank ends with the same model. The time budget counts from the moment
training started (the first group formed), so start-up is not spent from it. A stop with a
save (a signal, ``Intent(SAVE_AND_STOP)``) takes the same path while every member is alive, and
ends with ``ShutdownWithSave`` after the last round instead. Pure: no clocks, no I/O.
"""

from __future__ import annotations

from flodl.core.coordinator.ending import Ending
from flodl.core.coordinator.formation import Answer
from flodl.core.coordinator.liveness import Liveness
from flodl.core.coordinator.membership import Membership
from flodl.core.coordinator.rounds import Rounds
from flodl.core.coordinator.timeline import EventKind, Timeline
from flodl.wire.messages import Intent, IntentKind, SaveReason

__all__ = ["ScriptRequests"]


class ScriptRequests:
    """Intents from ranks; whether (and why) the training was stopped, and when the time
    budget runs out."""

    def __init__(
        self,
        max_time: float | None,
        rounds: Rounds,
        ending: Ending,
        membership: Membership,
        liveness: Liveness,
        timeline: Timeline,
    ) -> None:
        self._max_time = max_time
        self._rounds = rounds
        self._ending = ending
        self._membership = membership
        self._liveness = liveness
        self._timeline = timeline
        self.why: str | None = None
        """Why the training was stopped (None: it was not)."""

    @property
    def deadline(self) -> float | None:
        """When the time budget runs out (None: no budget, training not started, or stopped)."""
        started = self._rounds.started_at
        if self._max_time is None or started is None or self.why is not None:
            return None
        return started + self._max_time

    def on_intent(self, rank: int, intent: Intent, now: float) -> Answer:
        """What ``rank`` asked for: a bundle after the next settled round, the run saved and
        stopped (once the round in flight settled), or the training stopped."""
        if intent.kind is IntentKind.CHECKPOINT_NOW:
            self._rounds.request_checkpoint(rank)
        elif intent.kind is IntentKind.SAVE_AND_STOP:
            return self.save_and_stop(now, f"rank {rank} asked to stop")
        elif intent.kind is IntentKind.STOP:
            why = f"rank {rank} stopped the training: {intent.reason or 'no reason given'}"
            return self.stop(now, why, rank)
        return Answer([])

    def save_and_stop(self, now: float, why: str) -> Answer:
        """End the run with a save (a signal, a rank's SAVE_AND_STOP). With every member of a
        training group alive, the training stops first (as :meth:`stop`) and the save goes out
        once a last round averaged every batch handed out, so every rank saves the same
        model; if that takes past the heartbeat timeout, it goes out anyway. Otherwise the
        save goes out once the round in flight settles."""
        work = self._rounds.dispatch.work
        members = self._membership.members
        whole = bool(members) and all(self._liveness.is_alive(rank) for rank in members)
        if work is None or not whole or self.why is not None:
            return Answer(list(self._ending.save_when_settled(SaveReason.GRACEFUL, now, why)))
        self._record(now, why, None, save=True)
        work.stop()
        self._ending.save_after_last_round(SaveReason.GRACEFUL, now, why)
        return Answer([], may_be_due=True)

    def on_tick(self, now: float) -> Answer:
        """Stop the training if the time budget has run out by ``now``."""
        deadline = self.deadline
        if deadline is None or now < deadline:
            return Answer([])
        return self.stop(now, f"the time budget ({self._max_time:g} s of training) is spent")

    def stop(self, now: float, why: str, by: int | None = None) -> Answer:
        """Stop handing out work (``by``: the rank that asked; None: the time budget).

        The first stop counts; later ones are ignored. Before training started, the run ends
        at once.
        """
        if self.why is not None:
            return Answer([])
        self._record(now, why, by, save=False)
        work = self._rounds.dispatch.work
        if work is None:
            return Answer(list(self._ending.shutdown(now, why)))
        work.stop()
        return Answer([], may_be_due=True)

    def _record(self, now: float, why: str, by: int | None, *, save: bool) -> None:
        """The training stops (``StopRequested``); later stops are ignored."""
        self.why = why
        self._timeline.add(now, EventKind.STOP_REQUESTED, why=why, rank=by, save=save)
