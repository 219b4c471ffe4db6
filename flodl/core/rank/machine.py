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
* one ``Batch`` per finished batch; ``step_count`` counts batches and finished averages.
  A machine built with ``coalesce=True`` holds its reports instead and sends them together
  as one ``Batches`` frame: before anything else it sends (so the coordinator sees every
  report in order, and a chunk's reports before its ``Metrics``), in place of the next
  heartbeat, or once :data:`MAX_COALESCED` are held. Such a rank also skips a heartbeat when
  it sent another frame since the last one (any frame is a sign of life to the coordinator),
  so it sends a frame at least every two heartbeat intervals;
* when the work runs dry (or the epoch changes), one ``Metrics`` for the chunk just finished
  (its completion frame, with the chunk's wall time and the idle time within it);
* ``SyncAck`` after each average; ``Note`` then ``Exiting`` when the run ends for this rank.

Parameters are read or written only at a boundary, so a step and an average never overlap.
Under the Async policy the boundary only starts a background round on a snapshot; its result
is blended in at a later boundary, or taken exactly when nothing was trained since the
snapshot (:class:`~flodl.core.rank.effects.Blend`), as in the run's last round: every rank
ends with the same parameters.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Protocol

import attrs

from flodl.core.common.job import Job
from flodl.core.common.policy import Policy
from flodl.core.common.work import BatchSlice
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
    Send,
    Wait,
    Wake,
)
from flodl.core.rank.state import Lifecycle, Move, RankState
from flodl.core.rank.times import RankTimes
from flodl.errors import ConfigError, FlodlError, OutOfTurn, UnexpectedMessage
from flodl.wire.messages import (
    STOP_SAVE_VERSION,
    Abort,
    Batch,
    Batches,
    Checkpoint,
    CheckpointResult,
    CoordHeartbeat,
    DeclareDead,
    EpochAggregated,
    Exiting,
    ExtendPartition,
    Heartbeat,
    Intent,
    IntentKind,
    Message,
    NewGroupSession,
    Note,
    Ready,
    RequestNewGroup,
    RunSettings,
    SaveConsensusModel,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
)

__all__ = ["MeasuredRound", "RankMachine", "RoundFigures"]

MAX_COALESCED = 1024
"""A coalescing rank sends its held reports once it holds this many (a frame's size bound)."""

_NEEDS_JOB = (StartEpoch, ExtendPartition, SyncNow, Checkpoint, SaveConsensusModel)
"""Messages that only make sense once the job is announced."""


class RoundFigures(Protocol):
    """What a finished average reports (the backend's result has these attributes)."""

    @property
    def divergence(self) -> float: ...
    @property
    def post_norm(self) -> float: ...
    @property
    def pre_norm(self) -> float: ...


@attrs.frozen
class MeasuredRound:
    """Figures of an average for a shell with no backend result to hand (a simulation, a
    test). NaN: not measured (the SyncAck then carries None)."""

    divergence: float = math.nan
    post_norm: float = math.nan
    pre_norm: float = math.nan


@attrs.define
class _Background:
    """An Async round reducing a snapshot of ``batches`` batches."""

    sync: SyncNow
    batches: int
    landed: bool = False


class RankMachine:
    """One rank's protocol state. Every method is synchronous and returns at once."""

    def __init__(
        self, rank: int, world_size: int, policy: Policy, *, coalesce: bool = False
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.policy = policy
        self.coalesce = coalesce
        """Batch reports go out coalesced, as ``Batches`` (module docstring)."""
        self._held_ms: list[float] = []
        self._held_data_ms: list[float] = []
        self._held_loss: list[float] = []
        """Coalescing: the reports not sent yet, oldest first (one entry per batch)."""
        self._held_step = 0
        """Coalescing: the step count right after the last held batch."""
        self._sent_since_beat = False
        """Coalescing: a frame went out since the last :meth:`heartbeat`."""
        self.life = Lifecycle()
        """The state (``life.state``) and why the run ended for this rank."""
        self.job: Job | None = None
        self.step_count = 0
        """Batches finished plus averages finished (what Batch/SyncAck/Heartbeat carry)."""
        self.batches = 0
        self.syncs = 0
        self.global_step = 0
        """The run's global step as last set by the coordinator (SetGlobalStep)."""
        self.since_average = 0
        """Batches run since the last average this rank took part in."""
        self.times = RankTimes()
        self.last_epoch: EpochAggregated | None = None
        self.throttled = False
        self.work: RankWork | None = None
        """The batches: queued, out, reserved (set when the job is announced)."""
        self._inbox: deque[Message] = deque()
        self._background: _Background | None = None
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
        return self._out([Send(ready)])

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
        return len(self._held_ms)

    def heartbeat(self) -> Heartbeat | Batches | None:
        """What to send at the heartbeat interval: a ``Heartbeat``; when coalescing, the held
        reports instead (a sign of life too), or nothing when another frame went out since
        the last call. The shell sends it in order with the machine's other messages."""
        if not self.coalesce:
            return Heartbeat(rank=self.rank, step_count=self.step_count)
        sent, self._sent_since_beat = self._sent_since_beat, False
        if self._held_ms:
            return self._take_held()
        return None if sent else Heartbeat(rank=self.rank, step_count=self.step_count)

    def _take_held(self) -> Batches:
        """The held reports as one frame (they are no longer held)."""
        batches = Batches(
            rank=self.rank,
            step_count=self._held_step,
            batch_ms=tuple(self._held_ms),
            data_ms=tuple(self._held_data_ms),
            batch_loss=tuple(self._held_loss),
        )
        self._held_ms.clear()
        self._held_data_ms.clear()
        self._held_loss.clear()
        return batches

    def _out(self, effects: list[RankEffect]) -> list[RankEffect]:
        """Coalescing: the held reports go out just before the first message of ``effects``."""
        if self.coalesce:
            for at, effect in enumerate(effects):
                if isinstance(effect, Send):
                    self._sent_since_beat = True
                    if self._held_ms:
                        effects.insert(at, Send(self._take_held()))
                    break
        return effects

    def request_checkpoint(self) -> list[RankEffect]:
        """The script asks for a bundle of this rank: ``Intent(CHECKPOINT_NOW)``; the
        coordinator asks for it after the next settled round. Nothing once the run is ending
        (a bundle is saved then anyway, or the run is over); CoordinatorError once lost."""
        self.life.raise_if_lost()
        if self.life.ending or self.life.done:
            return []
        return self._out([Send(Intent(rank=self.rank, kind=IntentKind.CHECKPOINT_NOW))])

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
        return self._out(self._boundary(now))

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
            return [*self._goodbye("shut down by the coordinator"), Finish()]
        if state is RankState.SAVE_PENDING:
            assert life.save_reason is not None
            life.move(Move.START_SAVE)
            self._step = SaveAndStop(life.save_reason.name)
            return [CancelRound(), self._step]
        if state is RankState.SAVING:
            raise OutOfTurn("boundary() while the bundle is being saved")
        background = self._background
        if background is not None:  # its batches are settled before another round starts
            if background.landed:  # since_average: batches trained since its snapshot
                self._step = Blend(background.sync, exact=self.since_average == 0)
                return [self._step]
            if self._inbox and isinstance(self._inbox[0], SyncNow):
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

    def _goodbye(self, why: str, first: Send | None = None) -> list[RankEffect]:
        """Note(why) and Exiting, after ``first`` when given."""
        bye: list[RankEffect] = [
            Send(Note(rank=self.rank, detail=why)),
            Send(Exiting(rank=self.rank)),
        ]
        return self._out(bye if first is None else [first, *bye])

    # --- batches -------------------------------------------------------------------------

    def reserve(self) -> BatchSlice | None:
        """Reserve the batch after the current one for a training thread to take without a
        boundary, when nothing needs one first: no message queued, not throttled, not ending,
        no landed round, and the batch continues the current chunk (same epoch). None: no
        batch can be reserved now."""
        background = self._background
        if (
            self.work is None
            or not self.life.takes_rounds
            or self._inbox
            or self.throttled
            or (background is not None and background.landed)
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
        Coalescing: the report is held (module docstring); nothing is sent unless that makes
        :data:`MAX_COALESCED`."""
        if self.work is None:
            raise OutOfTurn("batch_done() before the job was announced")
        batch_ms = self.work.finish(loss, now)
        self.batches += 1
        self.step_count += 1
        self.since_average += 1
        if self.coalesce:
            self._held_ms.append(batch_ms)
            self._held_data_ms.append(max(float(data_ms), 0.0))
            self._held_loss.append(float(loss))
            self._held_step = self.step_count
            if len(self._held_ms) < MAX_COALESCED:
                return []
            self._sent_since_beat = True
            return [Send(self._take_held())]
        report = Batch(
            rank=self.rank,
            batch_ms=batch_ms,
            data_ms=max(float(data_ms), 0.0),
            step_count=self.step_count,
            batch_loss=float(loss),
        )
        return [Send(report)]

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
        self.since_average = 0
        return self._acknowledge(sync, figures)

    def background_started(self, sync: SyncNow) -> None:
        """Async: the Average step's round for ``sync`` runs in the background on a snapshot
        of the batches since the last average (ends the step; its start failing is
        ``average_finished(sync, None, ...)``)."""
        self._finish_step("background_started", Average, sync)
        self._background = _Background(sync, self.since_average)
        self.since_average = 0

    def background_landed(self) -> list[Reaction]:
        """Async: the background round's collective ended (its result waits to be blended)."""
        if self._background is None:
            return []
        self._background.landed = True
        return [Wake()]

    def blend_finished(self, figures: RoundFigures | None, elapsed_s: float) -> list[RankEffect]:
        """Async: the landed round was blended in (figures) or did not land (None: its
        batches count as never averaged)."""
        self._finish_step("blend_finished", Blend)
        round_ = self._background
        assert round_ is not None
        self._background = None
        self.times.averaging_s += elapsed_s
        if figures is None:
            self.since_average += round_.batches
            return []
        return self._acknowledge(round_.sync, figures)

    def _acknowledge(self, sync: SyncNow, figures: RoundFigures) -> list[RankEffect]:
        self.step_count += 1
        self.syncs += 1
        ack = SyncAck(
            rank=self.rank,
            round=sync.round,
            step_count=self.step_count,
            divergence=_finite(figures.divergence),
            post_norm=_finite(figures.post_norm),
            pre_norm=_finite(figures.pre_norm),
        )
        return self._out([Send(ack)])

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
        result = CheckpointResult(
            rank=self.rank,
            version=request.version,
            elapsed_ms=elapsed_ms,
            error=error,
            path=path,
        )
        return self._out([Send(result)])

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
        result = CheckpointResult(
            rank=self.rank,
            version=STOP_SAVE_VERSION,
            elapsed_ms=elapsed_ms,
            error=error,
            path=path,
        )
        return self._goodbye(f"saving and stopping: {reason.name}", first=Send(result))


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
