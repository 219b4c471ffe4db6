"""The rank's side of the protocol: one pure state machine driven by events and time.

:class:`RankMachine` is what a rank decides, with no trio, torch or sockets: the shell
(:mod:`flodl.worker.runtime`, :class:`flodl.testing.ScriptedRank`, the benchmark's simulated
ranks) feeds it events with the current time and performs the effects it returns
(:mod:`flodl.core.rank.effects`). The lifecycle is one :class:`~flodl.core.rank.state.RankState`
moved only through its table.

Events: the job is announced (:meth:`announce`); a message arrived (:meth:`receive`); the
training loop asks for its next batch (:meth:`boundary`, between :meth:`enter_boundary` and
:meth:`leave_boundary`), takes a batch reserved ahead (:meth:`take_reserved`) or finished one
(:meth:`batch_done`); a round, a blend or a save finished; the connection ended
(:meth:`connection_lost`).

The work protocol (what :mod:`flodl.core.coordinator.machine` relies on):

* messages that do not touch the parameters take effect at once (Throttle, SetGlobalStep,
  DeclareDead, group set-up, Shutdown); work, SyncNow and Checkpoint queue in arrival order for
  the next *batch boundary*, where the training loop is waiting. Work that arrives with
  nothing queued before it is queued at once (it needs no boundary);
* one ``Batch`` per finished batch (or, with ``coalesce=True``, ``Batches`` frames),
  ``SyncAck`` after each average, ``Note`` then ``Exiting`` when the run ends for this rank,
  in the frames and order :mod:`flodl.core.rank.reports` describes; ``step_count`` counts
  batches and finished averages;
* when the work runs dry (or the epoch changes), one ``Metrics`` for the chunk just finished
  (its completion frame, with the chunk's wall time and the idle time within it).

Parameters are read or written only at a boundary, so a step and an average never overlap;
under the Async policy a round runs in the background (:mod:`flodl.core.rank.averages`).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from flodl.core.common.job import Job
from flodl.core.common.policy import Policy
from flodl.core.common.work import BatchSlice
from flodl.core.rank.averages import RankAverages
from flodl.core.rank.batches import RankWork
from flodl.core.rank.effects import (
    Average,
    Blend,
    BoundaryStep,
    CancelRound,
    DoomGroup,
    Finish,
    GiveUp,
    Ignored,
    JoinGroup,
    PrepareGroup,
    Raise,
    RankEffect,
    Reaction,
    SaveAndStop,
    SaveCheckpoint,
    SaveOnLoss,
    Wait,
    Wake,
)
from flodl.core.rank.reports import MAX_COALESCED, MeasuredRound, RankReports, RoundFigures
from flodl.core.rank.state import Lifecycle, Move, RankState
from flodl.core.rank.times import RankTimes
from flodl.errors import ConfigError, FlodlError, OutOfTurn, UnexpectedMessage
from flodl.wire.messages import (
    STOP_SAVE_VERSION,
    Abort,
    Batches,
    Checkpoint,
    CoordHeartbeat,
    DeclareDead,
    EpochAggregated,
    ExtendPartition,
    Heartbeat,
    Intent,
    IntentKind,
    Message,
    NewGroupSession,
    Ready,
    RequestNewGroup,
    RunSettings,
    SaveConsensusModel,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    StartEpoch,
    SyncNow,
    Throttle,
)

__all__ = ["MAX_COALESCED", "MeasuredRound", "RankMachine", "RoundFigures"]

_NEEDS_JOB = (StartEpoch, ExtendPartition, SyncNow, Checkpoint, SaveConsensusModel)
"""Messages that only make sense once the job is announced."""


class RankMachine:
    """One rank's protocol state. Every method is synchronous and returns at once."""

    def __init__(
        self, rank: int, world_size: int, policy: Policy, *, coalesce: bool = False
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.policy = policy
        self.coalesce = coalesce
        """Batch reports go out coalesced, as ``Batches`` (:mod:`~flodl.core.rank.reports`)."""
        self._reports = RankReports(rank, coalesce)
        self.life = Lifecycle()
        """The state (``life.state``) and why the run ended for this rank."""
        self.job: Job | None = None
        self.step_count = 0
        """Batches finished plus averages finished (what Batch/SyncAck/Heartbeat carry)."""
        self.batches = 0
        self.syncs = 0
        self.global_step = 0
        """The run's global step as last set by the coordinator (SetGlobalStep)."""
        self._averages = RankAverages()
        self.times = RankTimes()
        self.last_epoch: EpochAggregated | None = None
        self.throttled = False
        self.work: RankWork | None = None
        """The batches: queued, out, reserved (set when the job is announced)."""
        self._inbox: deque[Message] = deque()
        self._step: BoundaryStep | None = None
        """The step handed to the shell and not reported finished yet."""

    # --- what the shells read and the job ---------------------------------------------------

    @property
    def current(self) -> BatchSlice | None:
        """The batch handed out and not reported done."""
        return None if self.work is None else self.work.current

    @property
    def reserved(self) -> BatchSlice | None:
        """The batch reserved ahead for a training thread (see :meth:`reserve`)."""
        return None if self.work is None else self.work.reserved

    @property
    def epoch(self) -> int:
        """The epoch of the batch handed out last."""
        return 0 if self.work is None else self.work.epoch

    @property
    def queued(self) -> int:
        """Messages waiting for the next batch boundary."""
        return len(self._inbox)

    @property
    def since_average(self) -> int:
        """Batches run since the last average this rank took part in."""
        return self._averages.since_average

    def announce(self, job: Job) -> list[RankEffect]:
        """The training loop describes its job: ``Ready``. ConfigError for a job that cannot
        run or differs from the one announced before; an identical second call does nothing."""
        if self.job is not None:
            if job != self.job:
                raise ConfigError(f"this rank already announced {self.job}, not {job}")
            return []
        job.check()
        self.life.raise_if_lost()
        self.job = job
        self.work = RankWork(self.rank, job)
        if self.life.state is not RankState.JOINED:
            return []  # the run ended before the job was described: nothing to announce
        self.life.move(Move.ANNOUNCE)
        ready = Ready(
            rank=self.rank,
            dataset_size=job.dataset_size,
            batch_size=job.batch_size,
            epochs=job.epochs,
        )
        return self._reports.send(ready)

    def connection_lost(self, error: FlodlError) -> list[Reaction]:
        """The coordinator fell silent or the connection broke. Once ending this changes
        nothing (the rank is leaving anyway)."""
        return [GiveUp(error), CancelRound(), Wake()] if self.life.lose(error) else []

    def tallies(self) -> dict[str, Any]:
        """What this rank did, for its exit report (``rank<N>.json``)."""
        counts = {"steps": self.step_count, "batches": self.batches, "syncs": self.syncs}
        times = {k: getattr(self.times, k) for k in ("idle_s", "averaging_s", "startup_s")}
        return {
            **counts,
            "global_step": self.global_step,
            **times,
            "exit_reason": self.life.exit_reason,
        }

    @property
    def held(self) -> int:
        """Batch reports held back for the next ``Batches`` frame (coalescing only)."""
        return self._reports.held

    def heartbeat(self) -> Heartbeat | Batches | None:
        """What to send at the heartbeat interval: a ``Heartbeat``; when coalescing, the held
        reports instead (a sign of life too), or nothing when another frame went out since
        the last call. The shell sends it in order with the machine's other messages."""
        return self._reports.heartbeat(self.step_count)

    def request_checkpoint(self) -> list[RankEffect]:
        """The script asks for a bundle of this rank: ``Intent(CHECKPOINT_NOW)``; the
        coordinator asks for it after the next settled round. Nothing once the run is ending
        (a bundle is saved then anyway, or the run is over); CoordinatorError once lost."""
        return self.ask(IntentKind.CHECKPOINT_NOW)

    def ask(self, kind: IntentKind, reason: str | None = None) -> list[RankEffect]:
        """Send ``Intent(kind, reason)`` (``STOP``: end the training at the next round);
        nothing once the run is ending or over; CoordinatorError once lost."""
        self.life.raise_if_lost()
        if self.life.ending or self.life.done:
            return []
        return self._reports.send(Intent(rank=self.rank, kind=kind, reason=reason))

    # --- messages ----------------------------------------------------------------------------

    def receive(self, message: Message) -> list[Reaction]:
        """Act on one message from the coordinator; what must wait for a boundary is queued.

        UnexpectedMessage for work, SyncNow or Checkpoint before the job was announced. Once
        the rank is ending, work, rounds and throttles are dropped (group messages still act:
        a collective in flight must still be abandoned); once it is done, everything is.
        """
        life = self.life
        if life.state is RankState.JOINED and isinstance(message, _NEEDS_JOB):
            raise UnexpectedMessage(
                f"rank {self.rank}: {type(message).__name__} before the job was announced"
            )
        if life.done:
            return []
        if isinstance(message, Abort):  # the next boundary raises RunAborted
            return [CancelRound(), Wake()] if life.abort(message.reason) else []
        if isinstance(message, CoordHeartbeat | RunSettings):
            return []  # RunSettings: the shell applied them before the machine was built
        if isinstance(message, EpochAggregated):
            self.last_epoch = message
            return []
        if isinstance(message, Shutdown | ShutdownWithSave):
            return self._on_shutdown(message)
        if isinstance(message, DeclareDead):
            return [DoomGroup(message.rank), CancelRound(), Wake()]
        if isinstance(message, RequestNewGroup):
            return [PrepareGroup(message), Wake()]
        if isinstance(message, NewGroupSession):
            return [JoinGroup(message), Wake()]
        if life.ending:
            return []  # work, rounds and throttles no longer matter
        return self._on_training_message(message)

    def _on_training_message(self, message: Message) -> list[Reaction]:
        if isinstance(message, StartEpoch | ExtendPartition):
            assert self.work is not None
            if not self._inbox and self.work.add_now(message):
                return [Wake(boundary=False)]
            self._inbox.append(message)
        elif isinstance(message, SyncNow):
            self.throttled = False
            self._inbox.append(message)
        elif isinstance(message, Checkpoint):
            self._inbox.append(message)
        elif isinstance(message, SaveConsensusModel):
            return [Ignored(message, "SaveConsensusModel is not supported")]
        elif isinstance(message, SetGlobalStep):
            self.global_step = message.global_step
            if not self.throttled:
                return []  # nothing for a boundary to do
            self.throttled = False
        elif isinstance(message, Throttle):
            self.throttled = True
        else:
            return [Ignored(message, "not a message for a rank")]
        return [Wake()]

    def _on_shutdown(self, message: Shutdown | ShutdownWithSave) -> list[Reaction]:
        reason = message.reason if isinstance(message, ShutdownWithSave) else None
        if not self.life.shut_down(reason):
            return []
        self.throttled = False
        return [CancelRound(), Wake()]

    # --- the batch boundary ------------------------------------------------------------------

    def enter_boundary(self, now: float) -> None:
        """The training loop waits for its next batch from ``now`` (see :meth:`boundary`)."""
        if self.job is None:
            raise OutOfTurn("announce the job (dataset_size, batch_size, epochs) first")
        if self.current is not None:
            raise OutOfTurn("the batch handed out is not done: report it (batch_done) first")
        self.times.enter(now)

    def leave_boundary(self, now: float) -> None:
        """The wait ended (a batch, the end, an error or cancellation): count the time lost
        in it, averaging excluded. Idempotent."""
        idle = self.times.leave(now, handed_out=self.current is not None)
        if idle is not None and self.work is not None:
            self.work.count_idle(*idle)

    def boundary(self, now: float) -> list[RankEffect]:
        """The next thing to do at the boundary: reactions, then one step (see
        :mod:`flodl.core.rank.effects`). After a step that takes time, report its end, then
        call again; after :class:`Wait`, call again once something changed. Bad work
        queued behind other messages raises ProtocolError here, to the training loop."""
        return self._reports.out(self._boundary(now))

    def _boundary(self, now: float) -> list[RankEffect]:
        if not self.times.in_boundary:
            raise OutOfTurn("boundary() outside enter_boundary() / leave_boundary()")
        life = self.life
        state = life.state
        if state is RankState.LOST and life.loss_save_due and self._step is None:
            if self.batches > 0:
                self._step = SaveOnLoss()
                return [CancelRound(), self._step]
            life.loss_save_due = False  # nothing trained: nothing to keep
        if state in (RankState.LOST, RankState.STOPPED, RankState.ABORTED):
            assert life.error is not None
            return [Raise(life.error)]
        if state is RankState.EXITED:
            return [Finish()]
        if self._step is not None:
            raise OutOfTurn(f"boundary() before the {type(self._step).__name__} step finished")
        if state is RankState.ENDING:
            life.move(Move.GOODBYE)
            life.note_exit("completed")
            return [*self._reports.goodbye("shut down by the coordinator"), Finish()]
        if state is RankState.SAVE_PENDING:
            assert life.save_reason is not None
            life.move(Move.START_SAVE)
            self._step = SaveAndStop(life.save_reason.name)
            return [CancelRound(), self._step]
        if state is RankState.SAVING:
            raise OutOfTurn("boundary() while the bundle is being saved")
        averages = self._averages  # a background round is settled before another starts
        if averages.landed:
            self._step = averages.blend()
            return [self._step]
        if averages.running and self._inbox and isinstance(self._inbox[0], SyncNow):
            return [Wait()]  # a redo behind an abandoned round: it lands soon
        step = self._step = self._next_queued()
        if step is not None:
            return [step]
        assert self.work is not None
        return list(self.work.next_step(now, self.throttled))

    def _next_queued(self) -> Average | SaveCheckpoint | None:
        """Carry out the inbox in order up to the first message that needs a step."""
        assert self.work is not None
        while self._inbox:
            message = self._inbox.popleft()
            if isinstance(message, StartEpoch | ExtendPartition):
                self.work.queue.add(message)  # ProtocolError for bad work reaches the loop
            elif isinstance(message, SyncNow):
                return Average(message, background=self.policy is Policy.ASYNC)
            elif isinstance(message, Checkpoint):
                if message.target_rank == self.rank:
                    return SaveCheckpoint(message)
        return None

    # --- batches -------------------------------------------------------------------------

    def reserve(self) -> BatchSlice | None:
        """Reserve the batch after the current one for a training thread to take without a
        boundary, when nothing needs one first: no message queued, not throttled, not ending,
        no landed round, and the batch continues the current chunk (same epoch). None: no
        batch can be reserved now."""
        if (
            self.work is None
            or not self.life.takes_rounds
            or self._inbox
            or self.throttled
            or self._averages.landed
        ):
            return None
        return self.work.reserve()

    def take_reserved(self, now: float) -> list[RankEffect]:
        """The training thread took the reserved batch: it is the current one now (a
        current batch not reported done is reported with a NaN loss first)."""
        if self.reserved is None:
            raise OutOfTurn("take_reserved() with no batch reserved")
        effects = self.batch_done(math.nan, 0.0, now) if self.current is not None else []
        assert self.work is not None
        self.work.take_reserved(now)
        return effects

    def batch_done(self, loss: float, data_ms: float, now: float) -> list[RankEffect]:
        """The current batch finished with ``loss``: ``Batch`` (OutOfTurn if none is out).
        Coalescing: the report is held (:mod:`~flodl.core.rank.reports`); nothing is sent
        unless that makes :data:`MAX_COALESCED`."""
        if self.work is None:
            raise OutOfTurn("batch_done() before the job was announced")
        batch_ms = self.work.finish(loss, now)
        self.batches += 1
        self.step_count += 1
        self._averages.trained()
        return self._reports.batch(self.step_count, batch_ms, data_ms, loss)

    # --- averaging ---------------------------------------------------------------------------

    def round_weight(self, sync: SyncNow, group_rank: int) -> int:
        """The weight (batches since the last average) this rank brings to ``sync``.

        The run's first round comes before any batch: group rank 0 alone carries weight, so
        every rank starts from its parameters (a broadcast through the weighted mean).
        """
        if sync.generation == 0 and self.syncs == 0 and self.batches == 0:
            return 1 if group_rank == 0 else 0
        return self.since_average

    def _finish_step(
        self, call: str, kind: type[BoundaryStep], sync: SyncNow | None = None
    ) -> None:
        """End the outstanding step, which must be a ``kind`` (for ``sync``, if given)."""
        step = self._step
        if not isinstance(step, kind) or (isinstance(step, Average) and step.sync != sync):
            out = "no step" if step is None else type(step).__name__
            raise OutOfTurn(f"{call}() with no {kind.__name__} step for it outstanding ({out})")
        self._step = None

    def average_finished(
        self, sync: SyncNow, figures: RoundFigures | None, elapsed_s: float
    ) -> list[RankEffect]:
        """A collective for ``sync`` ended after ``elapsed_s``: with its figures, SyncAck;
        None (failed, abandoned, or this rank is not in the round's group): no ack, the
        coordinator re-forms and redoes the round. Ends the Average step."""
        self._finish_step("average_finished", Average, sync)
        self.times.averaging_s += elapsed_s
        if figures is None:
            return []
        self._averages.averaged()
        return self._acknowledge(sync, figures)

    def background_started(self, sync: SyncNow) -> None:
        """Async: the Average step's round for ``sync`` runs in the background on a snapshot
        of the batches since the last average (ends the step; its start failing is
        ``average_finished(sync, None, ...)``)."""
        self._finish_step("background_started", Average, sync)
        self._averages.start_background(sync)

    def background_landed(self) -> list[Reaction]:
        """Async: the background round's collective ended (its result waits to be blended)."""
        return [Wake()] if self._averages.land() else []

    def blend_finished(self, figures: RoundFigures | None, elapsed_s: float) -> list[RankEffect]:
        """Async: the landed round was blended in (figures) or did not land (None: its
        batches count as never averaged)."""
        self._finish_step("blend_finished", Blend)
        sync = self._averages.blended(averaged=figures is not None)
        self.times.averaging_s += elapsed_s
        return [] if figures is None else self._acknowledge(sync, figures)

    def _acknowledge(self, sync: SyncNow, figures: RoundFigures) -> list[RankEffect]:
        self.step_count += 1
        self.syncs += 1
        return self._reports.ack(sync, self.step_count, figures)

    # --- saving ------------------------------------------------------------------------------

    def checkpoint_finished(
        self,
        request: Checkpoint,
        elapsed_ms: float,
        error: str | None,
        path: str | None = None,
    ) -> list[RankEffect]:
        """A Checkpoint's bundle was saved to ``path`` (or not: ``error``): CheckpointResult."""
        self._finish_step("checkpoint_finished", SaveCheckpoint)
        return self._reports.send(self._reports.saved(request.version, elapsed_ms, error, path))

    def loss_save_finished(self, outcome: str) -> list[RankEffect]:
        """The bundle of :class:`SaveOnLoss` was written (``outcome`` says where, or why
        not): the next boundary raises the loss, naming it."""
        self._finish_step("loss_save_finished", SaveOnLoss)
        self.life.saved_after_loss(outcome)
        return []

    def save_finished(
        self, outcome: str, elapsed_ms: float, error: str | None, path: str | None = None
    ) -> list[RankEffect]:
        """The bundle for ShutdownWithSave was written to ``path`` (or not: ``error``;
        ``outcome`` says either in words): its CheckpointResult (version
        :data:`~flodl.wire.messages.STOP_SAVE_VERSION`), then goodbye; the next boundary raises
        ShutdownRequested to the loop."""
        self._finish_step("save_finished", SaveAndStop)
        reason = self.life.saved(outcome)
        result = self._reports.saved(STOP_SAVE_VERSION, elapsed_ms, error, path)
        return self._reports.goodbye(f"saving and stopping: {reason.name}", result)
