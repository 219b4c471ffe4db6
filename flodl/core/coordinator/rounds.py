"""The averaging rounds of training: when the next one starts, what starting and settling one does.

A round is due once every member has run the batches it was planned (the count trigger,
:meth:`~flodl.core.coordinator.cycle.Cycle.ready`; a member with nothing left in flight is exempt).
Under Cadence a due round still waits, at most ``window_wait``, for members that owe a completion
frame or run an idle-fill batch, so that the window closes with their delivered time. Starting
a round arms it in the :class:`~flodl.core.coordinator.cycle.Cycle`, closes the window (ElChe learns
its timings and the guard judges its divergences: :class:`~flodl.core.coordinator.pacing.Pacing`)
and hands out the next window's work (:class:`~flodl.core.coordinator.dispatch.Dispatch`). A round
settles once every member acknowledged it; the checkpoints ranks asked for are requested then. A
round lost with a dead member is redone on the next generation of the group.

:class:`Rounds` owns those three parts. Whether a round may start at all (the run is training
and no group is forming) and what ends the run are the coordinator machine's to decide.
Pure: no clocks, no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import attrs

from flodl.core.common.job import Job
from flodl.core.common.policy import Policy
from flodl.core.coordinator.cycle import Cycle
from flodl.core.coordinator.dispatch import Dispatch
from flodl.core.coordinator.effects import Effect, Send
from flodl.core.coordinator.liveness import Liveness
from flodl.core.coordinator.membership import Membership
from flodl.core.coordinator.pacing import Pacing
from flodl.core.coordinator.round_log import RoundLog
from flodl.core.coordinator.saves import SaveSchedule
from flodl.core.coordinator.settings import MachineSettings
from flodl.core.coordinator.timeline import EventKind, Timeline
from flodl.wire.messages import Batch, Batches, CheckpointResult, JoinResult, Metrics, SyncAck

__all__ = ["BatchSeen", "Due", "ResumeState", "Rounds"]


@attrs.frozen
class _LiveMembers(Collection[int]):
    """The members still alive, as a view: ``in`` is O(1), so waiting for 4,096 ranks' final
    saves does not scan them all once per answer."""

    membership: Membership
    liveness: Liveness

    def __contains__(self, rank: object) -> bool:
        return rank in self.membership.member_set and self.liveness.is_alive(rank)

    def __iter__(self) -> Iterator[int]:
        return (rank for rank in self.membership.members if self.liveness.is_alive(rank))

    def __len__(self) -> int:
        return sum(1 for _ in self)


@attrs.frozen
class ResumeState:
    """Where a resumed run starts: from a checkpoint's meta (see flodl.checkpoint)."""

    epoch: int = 0
    global_step: int = 0
    sync_round: int = 0
    elche_state: Mapping[str, Any] | None = None


class Due(enum.Enum):
    """Whether the next round is due (:meth:`Rounds.due`)."""

    NOT_YET = "not yet"
    NOW = "now"
    ALL_DONE = "all done"
    """Every epoch's batches are done and no round is left to run."""


@attrs.frozen
class BatchSeen:
    """What a member's ``Batch`` report did (:meth:`Rounds.on_batch`)."""

    effects: list[Effect]
    """Throttles for ranks now too far ahead."""
    out_of_work: bool
    """That was the last batch the member was handed."""
    may_be_due: bool
    """The next round may have become due."""


class Rounds:
    """The cycle, the pacing and the work of a training run (module docstring).

    ``membership`` and ``liveness`` are read for the live members; ``resume`` says where a
    resumed run goes on from.
    """

    def __init__(
        self,
        settings: MachineSettings,
        timeline: Timeline,
        membership: Membership,
        liveness: Liveness,
        resume: ResumeState,
    ) -> None:
        world_size = membership.world_size
        policy = settings.policy
        cadence = settings.cadence
        # Sync runs windows of exactly one batch per rank through the count trigger, so the
        # epoch's tail (where some ranks get no batch) is handled by the quiesced exemption.
        self.cycle = Cycle(
            world_size,
            Policy.ASYNC if policy is Policy.ASYNC else Policy.CADENCE,
            global_step=resume.global_step,
            round=resume.sync_round,
            reduce_stall_ceiling=settings.timeouts.reduce_stall,
            heartbeat_timeout=settings.timeouts.heartbeat,
            max_batch_diff=cadence.max_batch_diff,
        )
        self.pacing = Pacing(settings, timeline, world_size, saved=resume.elche_state)
        fills = cadence.fill_idle_ranks and policy is Policy.CADENCE
        # A throttled rank would not run an extra batch, so throttling turns the fill off.
        self.dispatch = Dispatch(
            world_size, timeline, fills=fills and cadence.max_batch_diff is None
        )
        self.wait_until: float | None = None
        """Cadence: a due round waits for completion frames and idle-fill batches until then."""
        self._first_epoch = resume.epoch
        self._policy = policy
        self._membership = membership
        self._liveness = liveness
        self._timeline = timeline
        self.log = RoundLog()
        self.started_at: float | None = None
        """When training started (the first group formed); None before."""
        """Per-rank facts of each window and round, for the SyncEnd event."""
        self._progressive = policy is not Policy.SYNC
        self._waits = policy is Policy.CADENCE
        self._window_wait = settings.timeouts.window_wait
        saves = settings.checkpoints
        self.saves = SaveSchedule(
            every_rounds=saves.every_rounds,
            every_epochs=saves.every_epochs,
            deadline=settings.timeouts.reduce_stall,
            first_epoch=resume.epoch,
            first_step=resume.global_step,
        )

    def position(self) -> dict[str, int]:
        """Where training stands, for a checkpoint: the epoch running (once all are done,
        their number, so a resumed run starts with the first epoch it adds; after a stop, the
        epoch it cut short, which a resumed run trains again), global step and round."""
        work = self.dispatch.work
        finished = work is not None and work.done and not work.stopped
        epoch = 0 if work is None else work.epochs if finished else work.current_epoch
        return {
            "epoch": epoch,
            "global_step": self.cycle.global_step,
            "sync_round": self.cycle.round,
        }

    def working(self, rank: int) -> bool:
        """``rank`` is a live member of the group."""
        return rank in self._membership.member_set and self._liveness.is_alive(rank)

    def next_deadline(self) -> float | None:
        """When the round in flight stalls, a due round stops waiting or the final save is
        given up on (None: none of them)."""
        deadlines = (self.cycle.next_deadline(), self.wait_until, self.saves.final_until)
        return min((d for d in deadlines if d is not None), default=None)

    # --- groups -----------------------------------------------------------------------------

    def begin(self, job: Job, now: float, generation: int) -> list[Effect]:
        """The first group formed: training starts, and round 1 with it, before any batch.

        With no steps anywhere that round makes every rank start from the same parameters
        (the ranks give group rank 0's copy all the mass in it, as DDP broadcasts from rank 0).
        """
        members = self._membership.members
        self.started_at = now
        for rank in set(range(self._membership.world_size)) - set(members):
            self.cycle.drop_rank(now, rank)
        self.pacing.form(members)
        self.dispatch.open(job, self._first_epoch)
        self.log.batch_size = job.batch_size
        self.log.open_window(now)
        work = self.dispatch.work
        assert work is not None
        self._timeline.add(
            now,
            EventKind.TRAINING_STARTED,
            dataset_size=job.dataset_size,
            batch_size=job.batch_size,
            epochs=job.epochs,
            first_epoch=self._first_epoch,
            epoch_batches=work.epoch_batches,
            members=list(members),
            policy=self._policy.value,
            generation=generation,
        )
        return self.start(now, generation, delivered=False)

    def carry_over(self, members: Sequence[int]) -> None:
        """A later group of ``members`` formed: the ones new to the run join the rounds."""
        for rank in self.pacing.carry_over(members):
            self.cycle.add_rank(rank)
            self.dispatch.readmit(rank)

    def drop(self, rank: int, survivors: Sequence[int], now: float) -> list[Effect]:
        """Member ``rank`` is dead: it leaves the round, its work goes to ``survivors``."""
        self.cycle.drop_rank(now, rank)
        return self.dispatch.reassign(rank, survivors)

    def abandon(self) -> None:
        """The group is lost: the round in flight is redone on the next one, none waits."""
        self.cycle.abandon_round()
        self.wait_until = None

    # --- reports ----------------------------------------------------------------------------

    def on_batch(self, rank: int, batch: Batch, now: float) -> BatchSeen:
        """A member finished a batch."""
        out_of_work = self.dispatch.on_batch(rank, batch, now)
        self.log.on_batch(rank, batch.batch_ms + batch.data_ms, batch.batch_loss, now)
        # A Batch never settles a round (only SyncAcks do), so there is nothing to settle here.
        self.cycle.on_batch(now, batch)
        throttles = list(self.cycle.throttle())
        for throttle in throttles:
            if isinstance(throttle, Send):
                self._timeline.add(now, EventKind.THROTTLE, rank=throttle.rank)
        # The count trigger can only turn true when this rank reaches its planned count, runs
        # out of work, or a rank was just throttled (throttled ranks are exempt); every other
        # report leaves it false, so most reports skip the check.
        may_be_due = (
            out_of_work or bool(throttles) or self.cycle.steps_of(rank) >= self.dispatch.plan[rank]
        )
        return BatchSeen(throttles, out_of_work, may_be_due)

    def quiet_reports(self, rank: int, limit: int) -> int:
        """How many of member ``rank``'s next ``limit`` batch reports would each leave
        :meth:`on_batch` with nothing to do: no throttle, work left after it, and the rank
        still short of its planned count (so the round cannot become due on them)."""
        if self.cycle.throttling:
            return 0
        short = self.dispatch.plan[rank] - self.cycle.steps_of(rank) - 1
        left = self.dispatch.in_flight(rank) - 1
        return max(0, min(limit, short, left))

    def absorb(self, rank: int, batches: Batches, start: int, count: int, now: float) -> None:
        """Take entries ``start`` to ``start + count`` of ``batches`` as :meth:`on_batch`
        would one by one; they must be quiet (:meth:`quiet_reports`)."""
        stop = start + count
        batches_ms = batches.batch_ms[start:stop]
        data_ms = batches.data_ms[start:stop]
        walls = [batch + data for batch, data in zip(batches_ms, data_ms, strict=True)]
        self.dispatch.on_batches(rank, batches_ms, walls, batches.batch_loss[start:stop], now)
        self.log.on_batches(rank, walls, batches.batch_loss[start:stop], now)
        step_count = batches.step_count - len(batches.batch_ms) + stop
        self.cycle.on_batches(rank, count, step_count)

    def fill(self, rank: int, now: float) -> list[Effect]:
        """Cadence: the batches ``rank``, out of work before the round triggered, gets now."""
        if self.wait_until is not None:
            return []
        return self.dispatch.fill(rank, now, steps_of=self.cycle.steps_of, working=self.working)

    def on_join_result(self, now: float, result: JoinResult) -> None:
        """A rank's join of a generation ended (the stall clock may start); a failed one is
        recorded (``JoinFailed``)."""
        self.cycle.on_join_result(now, result.rank, result.generation)
        if not result.joined:
            self._timeline.add(
                now, EventKind.JOIN_FAILED, rank=result.rank, generation=result.generation
            )

    def on_completion(self, rank: int, metrics: Metrics, now: float) -> bool:
        """A member's completion frame; True when a waiting round now waits for no one."""
        self.dispatch.on_completion(rank, metrics)
        self.log.on_report(rank, now)
        return self.wait_until is not None and not self.dispatch.awaits(self.working)

    def close_epochs(self, now: float) -> list[Effect]:
        """EpochAggregated for every epoch whose batches are all done (and reported)."""
        if self.dispatch.awaits(self.working):
            return []
        return self.dispatch.close_epochs(self._membership.members, now)

    # --- starting ---------------------------------------------------------------------------

    def all_work_done(self) -> bool:
        """Every batch of every epoch is done and none has run since the last round."""
        work = self.dispatch.work
        return work is not None and work.done and not any(self.cycle.steps)

    def due(self) -> Due:
        """Whether the next round is due (never while one is in flight or waiting)."""
        work = self.dispatch.work
        if work is None or self.wait_until is not None or not self.cycle.settled:
            return Due.NOT_YET
        if self.saves.final_requested:
            # Asked only once every epoch was done, which stays so; the scans below are O(N)
            # and would otherwise run once per final answer (O(N^2) at the run's end).
            return Due.ALL_DONE
        if self.cycle.ready(self.dispatch.plan, work.quiesced(self._membership.members)):
            return Due.NOW
        return Due.ALL_DONE if self.all_work_done() else Due.NOT_YET

    def start_or_wait(self, now: float, generation: int) -> list[Effect]:
        """Start the due round, or (Cadence) wait for the live members it awaits."""
        if self._waits and self.dispatch.awaits(self.working):
            self.wait_until = now + self._window_wait
            return []
        return self.start(now, generation, delivered=self._progressive)

    def start(self, now: float, generation: int, *, delivered: bool) -> list[Effect]:
        """Start a round on ``generation``: close the window and hand out the next one.

        ``delivered``: ElChe may time the window by the ranks' delivered wall time.
        """
        self.wait_until = None
        started = self.cycle.start_round(now, generation)
        effects: list[Effect] = list(started.effects)
        steps = started.steps
        self._timeline.add(now, EventKind.SYNC_START, round=started.round, steps=list(steps))
        members = self._membership.members
        dispatch = self.dispatch
        verdict = None
        self.log.start(
            now,
            round=started.round,
            generation=generation,
            members=members,
            redo=False,
            global_step=started.global_step,
        )
        if self.pacing.feeds and any(steps):
            reduce_ms = (self.cycle.last_sync_duration or 0.0) * 1000.0
            windows = dispatch.reports(members, steps, delivered)
            verdict = self.pacing.close_window(
                windows, steps, reduce_ms, delivered=delivered, now=now
            )
        dispatch.new_window()
        work = dispatch.work
        assert work is not None
        if work.exhausted:
            return effects
        counts = self.pacing.window_counts(members, work.epoch_batches)
        anchor = self.pacing.elche.anchor if self.pacing.feeds else None
        self.log.set_plan(anchor, counts, verdict)
        return effects + dispatch.hand_out(counts, self.pacing.ms_per_batch(), now)

    def redo(self, now: float, generation: int) -> list[Effect]:
        """Reissue the round a dead member interrupted, on the re-formed ``generation``."""
        started = self.cycle.redo_round(now, generation)
        # The redo takes the next round number: the one it redoes is the one before.
        self._timeline.add(
            now, EventKind.SYNC_START, round=started.round, redo=True, redoes=started.round - 1
        )
        self.log.start(
            now,
            round=started.round,
            generation=generation,
            members=self._membership.members,
            redo=True,
            global_step=started.global_step,
        )
        return list(started.effects)

    # --- settling ---------------------------------------------------------------------------

    def request_checkpoint(self, rank: int) -> None:
        """``rank`` asked to be saved: it is, at the next settled round."""
        self.saves.ask(rank)

    def final_saves(self, now: float) -> list[Effect] | None:
        """Every epoch is done: the final save's requests, [] while they are awaited, None
        once the run may shut down (see :meth:`SaveSchedule.final`)."""
        saves = self.saves.final(_LiveMembers(self._membership, self._liveness), now)
        return None if saves is None else list(saves)

    def on_checkpoint_result(self, result: CheckpointResult) -> bool:
        """A rank answered a Checkpoint; True when the final save may now be complete."""
        return self.saves.on_result(result)

    def on_ack(self, ack: SyncAck, now: float) -> bool:
        """A member acknowledged a round; True when that settled the round in flight."""
        if ack.round == self.cycle.round and ack.divergence is not None:
            self.pacing.on_divergence(ack.divergence)
        self.log.on_ack(ack, now)
        return self.cycle.on_sync_ack(now, ack)

    def settled(self, now: float) -> list[Effect]:
        """The round in flight settled: the checkpoints asked for and scheduled are requested."""
        duration = self.cycle.last_sync_duration or 0.0
        record = self.log.settled(now)
        record.update(round=self.cycle.round, duration_s=duration)
        self._timeline.add(now, EventKind.SYNC_END, **record)
        live = [rank for rank in self._membership.members if self._liveness.is_alive(rank)]
        position = self.position()
        saves = self.saves.settled(
            live,
            epoch=position["epoch"],
            global_step=position["global_step"],
            last=self.all_work_done(),
        )
        return list(saves)
