"""How the run ends: completed, saved or failed; whether it can go on; whether a stop waits.

A run *completes* when every epoch is done or a stop without a save is asked for: everyone
gets ``Shutdown``. A ``Shutdown`` sent while an averaging round is in flight would stop ranks
in the middle of a collective, so it waits until the round settles (:attr:`Ending.pending`).
A run that cannot go on (too many failures or too few survivors, see
:meth:`Ending.unrecoverable`; a stalled average; no group could be formed) or a stop with a
save is *saved*: ``ShutdownWithSave`` goes out at once to every rank still connected, whatever
it is doing. A stop with a save that was asked for (a signal, an ``Intent``) first waits for
the round in flight to settle, up to the heartbeat timeout (:meth:`Ending.save_when_settled`):
a rank stopped in the middle of a collective strands its peers in it, and each then waits out
the collective timeout before it can exit, longer than the launcher's exit grace. A run whose
world never formed *fails*: every rank still connected gets ``Abort`` with the reason, so no
rank's script takes the end for a completed run.

After a save went out, each rank that was asked reports its bundle before it leaves
(``CheckpointResult`` with version :data:`~flodl.wire.messages.STOP_SAVE_VERSION`): the
timeline records each report (``CheckpointSaved``) and, once every rank asked has reported, a
last ``Shutdown`` saying which ranks saved, so a saved run's event log has an end as a completed
one has. Pure: no clocks, no I/O.
"""

from __future__ import annotations

import enum

import attrs

from flodl.core.coordinator.cycle import Cycle
from flodl.core.coordinator.effects import Broadcast
from flodl.core.coordinator.liveness import Liveness, unrecoverable_reason
from flodl.core.coordinator.settings import MachineSettings
from flodl.core.coordinator.timeline import EventKind, Timeline
from flodl.wire.fields import MAX_TEXT
from flodl.wire.messages import (
    Abort,
    CheckpointResult,
    Message,
    SaveReason,
    Shutdown,
    ShutdownWithSave,
)

__all__ = ["Ending", "Outcome", "Status", "listed_ranks", "record_save"]


class Status(enum.Enum):
    RUNNING = "running"
    COMPLETED = "completed"
    SAVED = "saved"
    FAILED = "failed"


@attrs.frozen
class Outcome:
    """How the run ended (``status`` RUNNING until it has)."""

    status: Status
    save_reason: SaveReason | None = None
    message: str = ""


class Ending:
    """The run's outcome, and a stop that waits for the round in flight (module docstring).

    ``cycle`` and ``liveness`` are read for the round in flight and the losses.
    """

    def __init__(
        self, settings: MachineSettings, timeline: Timeline, cycle: Cycle, liveness: Liveness
    ) -> None:
        self._settings = settings
        self._timeline = timeline
        self._cycle = cycle
        self._liveness = liveness
        self.outcome = Outcome(Status.RUNNING)
        self.pending = False
        """A Shutdown waits for the round in flight to settle."""
        self.held_save: tuple[SaveReason, str, float] | None = None
        """A save that waits for the round in flight: its reason, why, and until when."""
        self.held_for_last_round = False
        """The held save waits for the run's last round (the work was stopped), not for the
        round in flight: every rank then saves the same model."""
        self.stop_saves: dict[int, CheckpointResult | None] = {}
        """After a save went out: each rank asked -> its report (None until it reports)."""

    @property
    def over(self) -> bool:
        """The run has ended."""
        return self.outcome.status is not Status.RUNNING

    def unrecoverable(self) -> SaveReason | None:
        """Why the losses so far end the run (with a save), or None when it can go on."""
        liveness = self._liveness
        return unrecoverable_reason(
            world_size=liveness.world_size,
            alive=len(liveness.alive),
            failures=liveness.failures,
            max_failure=self._settings.max_failure,
            collective=self._settings.collective,
        )

    def save(self, reason: SaveReason, now: float, why: str) -> list[Broadcast]:
        """End the run with a save, at once."""
        self.outcome = Outcome(Status.SAVED, reason, why)
        self._timeline.add(now, EventKind.SAVE_REQUESTED, reason=reason.name, why=why)
        self.stop_saves = dict.fromkeys(sorted(self._liveness.alive_view))
        return [Broadcast(ShutdownWithSave(reason=reason))]

    def on_stop_save(self, rank: int, result: CheckpointResult, now: float) -> None:
        """``rank`` reports the bundle it wrote for the save (or why it could not): recorded;
        the last report of the ranks asked ends the timeline with ``Shutdown``. A report from a
        rank not asked, or a second one, is ignored."""
        if rank not in self.stop_saves or self.stop_saves[rank] is not None:
            return
        self.stop_saves[rank] = result
        record_save(self._timeline, now, rank, result)
        reports = self.stop_saves.values()
        if any(report is None for report in reports):
            return
        saved = [r for r, report in self.stop_saves.items() if report and report.error is None]
        failed = [r for r, report in self.stop_saves.items() if report and report.error]
        why = f"ended with a save ({self.outcome.message}): ranks {listed_ranks(saved)} saved"
        if failed:
            why += f"; ranks {listed_ranks(failed)} could not save"
        self._timeline.add(now, EventKind.SHUTDOWN, why=why)

    def save_when_settled(self, reason: SaveReason, now: float, why: str) -> list[Broadcast]:
        """End the run with a save once the round in flight settles (at once when none is),
        or at :attr:`held_until` if it has not by then (:meth:`release_save`)."""
        if self._cycle.may_shutdown():
            return self.save(reason, now, why)
        if self.held_save is None:
            self.held_save = (reason, why, now + self._settings.timeouts.heartbeat)
        return []

    def save_after_last_round(self, reason: SaveReason, now: float, why: str) -> None:
        """Hold the save until the run's last round settled (:meth:`release_save` once every
        batch handed out is averaged), or :attr:`held_until` if that takes longer."""
        if self.held_save is None:
            self.held_save = (reason, why, now + self._settings.timeouts.heartbeat)
            self.held_for_last_round = True

    @property
    def held_until(self) -> float | None:
        """When a held save goes out even though the round has not settled (None: none held)."""
        return None if self.held_save is None else self.held_save[2]

    def release_save(self, now: float, settled: bool) -> list[Broadcast]:
        """Send the held save (none held, or the run already ended: nothing). ``settled``:
        the round settled; else the wait ran out, which the reason's text says."""
        held, self.held_save = self.held_save, None
        last_round, self.held_for_last_round = self.held_for_last_round, False
        if held is None or self.over:
            return []
        reason, why, _until = held
        if not settled:
            waited = "the last round" if last_round else "the round in flight"
            why += f"; {waited} had not settled within the heartbeat timeout"
        return self.save(reason, now, why)

    def shutdown(self, now: float, why: str) -> list[Broadcast]:
        """End the run without a save; while a round is in flight, only once it settles."""
        if not self._cycle.may_shutdown():
            self.pending = True
            return []
        self.outcome = Outcome(Status.COMPLETED, None, why)
        self._timeline.add(now, EventKind.SHUTDOWN, why=why)
        return [Broadcast(Shutdown())]

    def farewell(self) -> Message:
        """What a rank that connects after the end is sent: Shutdown after a completed run,
        else Abort saying how the run ended."""
        if self.outcome.status is Status.COMPLETED:
            return Shutdown()
        return Abort(reason=f"the run has ended: {self.outcome.message}"[:MAX_TEXT])

    def fail(self, now: float, why: str) -> list[Broadcast]:
        """End a run that could not start: ``Abort(why)`` to every rank connected."""
        self.outcome = Outcome(Status.FAILED, None, why)
        self._timeline.add(now, EventKind.SHUTDOWN, why=why)
        return [Broadcast(Abort(reason=why[:MAX_TEXT]))]


def listed_ranks(ranks: list[int]) -> str:
    """``0, 1, 2`` (``none`` for no rank)."""
    return ", ".join(map(str, ranks)) if ranks else "none"


def record_save(timeline: Timeline, now: float, rank: int, result: CheckpointResult) -> None:
    """``rank``'s report of a bundle (a checkpoint's or the stop's) as a ``CheckpointSaved``."""
    timeline.add(
        now,
        EventKind.CHECKPOINT_SAVED,
        rank=rank,
        version=result.version,
        elapsed_ms=result.elapsed_ms,
        error=result.error,
        path=result.path,
    )
