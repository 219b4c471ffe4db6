"""The rank machine's work protocol as the coordinator relies on it (pure: time is a float).

The helpers at the top drive a :class:`RankMachine` the way the trio shell does
(:mod:`flodl.worker.runtime`): ``enter_boundary`` -> ``boundary`` repeatedly, performing each
step and reporting how it went -> ``leave_boundary``. The other rank test modules import them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TypeVar

import attrs
import pytest

from flodl.core.common.job import Job
from flodl.core.common.policy import Policy
from flodl.core.common.work import BatchSlice
from flodl.core.rank.effects import (
    Average,
    Blend,
    CancelRound,
    DoomGroup,
    Finish,
    GiveUp,
    HandOut,
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
from flodl.core.rank.machine import MeasuredRound, RankMachine
from flodl.core.rank.state import RankState
from flodl.errors import (
    ConfigError,
    CoordinatorError,
    FlodlError,
    OutOfTurn,
    ProtocolError,
    ShutdownRequested,
)
from flodl.wire.messages import (
    Batch,
    Checkpoint,
    CheckpointResult,
    DeclareDead,
    EpochAggregated,
    Exiting,
    ExtendPartition,
    Heartbeat,
    Message,
    Metrics,
    Note,
    Ready,
    SaveReason,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
)

# --- helpers -------------------------------------------------------------------------------

M = TypeVar("M", bound=Message)

JOB = Job(dataset_size=20, batch_size=4, epochs=2)
ENDS = (HandOut, Wait, Finish, Raise)
"""Boundary steps after which the loop stops asking (a batch, a wait, the end, an error)."""


FIGURES = MeasuredRound(divergence=0.25, post_norm=2.0, pre_norm=3.0)


def new_machine(
    policy: Policy = Policy.CADENCE,
    *,
    rank: int = 0,
    world_size: int = 2,
    job: Job | None = JOB,
) -> RankMachine:
    """A machine for ``rank``, its job announced (``job=None``: still JOINED)."""
    machine = RankMachine(rank, world_size, policy)
    if job is not None:
        ready = Ready(
            rank=rank, dataset_size=job.dataset_size, batch_size=job.batch_size, epochs=job.epochs
        )
        assert machine.announce(job) == [Send(ready)]
    return machine


def state_of(machine: RankMachine) -> RankState:
    """The machine's state (a call, so that one check does not narrow the next for mypy)."""
    return machine.life.state


def sent(effects: Iterable[RankEffect]) -> list[Message]:
    """The messages ``effects`` send, in order."""
    return [effect.message for effect in effects if isinstance(effect, Send)]


def sent_of(effects: Iterable[RankEffect], kind: type[M]) -> list[M]:
    return [message for message in sent(effects) if isinstance(message, kind)]


def epoch_work(epoch: int, offset: int, size: int) -> StartEpoch:
    return StartEpoch(epoch=epoch, partition_offset=offset, partition_size=size)


def extend(epoch: int, offset: int, size: int) -> ExtendPartition:
    return ExtendPartition(epoch=epoch, offset=offset, size=size)


def receive_all(machine: RankMachine, messages: Sequence[Message]) -> list[RankEffect]:
    effects: list[RankEffect] = []
    for message in messages:
        effects += machine.receive(message)
    return effects


@attrs.define
class Boundary:
    """What one pass through a batch boundary did."""

    steps: list[RankEffect] = attrs.Factory(list)
    """Every step the machine returned, in order (the last one ends the pass)."""
    effects: list[RankEffect] = attrs.Factory(list)
    """Everything returned: reactions, steps, and what reporting each step returned."""
    weights: list[int] = attrs.Factory(list)
    """The round weight taken for each Average step."""

    @property
    def last(self) -> RankEffect:
        return self.steps[-1]

    @property
    def sent(self) -> list[Message]:
        return sent(self.effects)

    @property
    def batch(self) -> BatchSlice:
        last = self.last
        assert isinstance(last, HandOut), f"expected a batch, got {last}"
        return last.batch


def drive_boundary(
    machine: RankMachine,
    now: float,
    *,
    figures: MeasuredRound | None = FIGURES,
    average_s: float = 0.0,
    group_rank: int = 0,
    save_outcome: str = "saved to /tmp/bundle",
) -> Boundary:
    """Call ``boundary(now)`` and perform its steps like the shell, until a batch, a Wait,
    Finish or Raise. Averages take ``average_s`` and end with ``figures`` (None: failed)."""
    out = Boundary()
    for _ in range(50):
        effects = machine.boundary(now)
        *reactions, step = effects
        assert all(isinstance(r, Reaction) for r in reactions), effects
        assert not isinstance(step, Reaction), f"no step at the end of {effects}"
        out.effects += effects
        out.steps.append(step)
        if isinstance(step, ENDS):
            return out
        if isinstance(step, Average):
            weight = machine.round_weight(step.sync, group_rank)
            out.weights.append(weight)
            if step.background:
                machine.background_started(step.sync)
            else:
                out.effects += machine.average_finished(step.sync, figures, average_s)
        elif isinstance(step, Blend):
            out.effects += machine.blend_finished(figures, average_s)
        elif isinstance(step, SaveCheckpoint):
            out.effects += machine.checkpoint_finished(step.request, 7.0, None)
        elif isinstance(step, SaveAndStop):
            out.effects += machine.save_finished(save_outcome, 5.0, None, "/runs/bundle")
        elif isinstance(step, SaveOnLoss):
            out.effects += machine.loss_save_finished(save_outcome)
        else:  # pragma: no cover - every step kind is handled above
            raise AssertionError(f"unknown step {step}")
    raise AssertionError("the boundary never settled")


def next_batch(
    machine: RankMachine,
    now: float,
    *,
    figures: MeasuredRound | None = FIGURES,
    average_s: float = 0.0,
) -> Boundary:
    """enter_boundary -> drive_boundary -> leave_boundary, all at ``now``."""
    machine.enter_boundary(now)
    try:
        return drive_boundary(machine, now, figures=figures, average_s=average_s)
    finally:
        machine.leave_boundary(now)


def train(machine: RankMachine, now: float, loss: float = 0.5) -> tuple[BatchSlice, Batch]:
    """Take the next batch (it must be one) and finish it: the batch and its report."""
    batch = next_batch(machine, now).batch
    reports = sent_of(machine.batch_done(loss, 0.0, now + 1.0), Batch)
    assert len(reports) == 1
    return batch, reports[0]


def first_error(machine: RankMachine, now: float) -> Exception:
    """The error the next boundary surfaces, raised or as a Raise step."""
    machine.enter_boundary(now)
    try:
        last = drive_boundary(machine, now).last
    except FlodlError as err:
        return err
    finally:
        machine.leave_boundary(now)
    assert isinstance(last, Raise), f"expected an error, got {last}"
    return last.error


# --- announcing ----------------------------------------------------------------------------


def test_announce_sends_ready_once_and_refuses_another_job() -> None:
    machine = new_machine(job=None, rank=1)
    assert state_of(machine) is RankState.JOINED
    ready = machine.announce(JOB)
    assert ready == [Send(Ready(rank=1, dataset_size=20, batch_size=4, epochs=2))]
    assert state_of(machine) is RankState.TRAINING and machine.job == JOB
    assert machine.announce(Job(20, 4, 2)) == []  # the same job again: nothing
    with pytest.raises(ConfigError, match="already announced"):
        machine.announce(Job(20, 5, 2))
    assert machine.job == JOB and state_of(machine) is RankState.TRAINING


@pytest.mark.parametrize("job", [Job(20, 0, 1), Job(20, 4, 0), Job(3, 4, 1)])
def test_a_job_that_cannot_run_is_refused_and_nothing_is_announced(job: Job) -> None:
    machine = new_machine(job=None)
    with pytest.raises(ConfigError):
        machine.announce(job)
    assert machine.job is None and state_of(machine) is RankState.JOINED
    with pytest.raises(OutOfTurn, match="announce"):
        machine.enter_boundary(0.0)


# --- work, Batch, Metrics --------------------------------------------------------------------


def test_work_with_nothing_queued_is_queued_at_once_without_a_boundary() -> None:
    machine = new_machine()
    assert machine.receive(epoch_work(0, 0, 10)) == [Wake(boundary=False)]
    assert machine.queued == 0  # not waiting in the inbox
    assert machine.receive(extend(0, 12, 3)) == [Wake(boundary=False)]
    assert machine.queued == 0


def test_spans_are_trained_in_arrival_order_in_batches_that_never_cross_a_span() -> None:
    machine = new_machine()
    receive_all(machine, [epoch_work(0, 8, 6), extend(0, 0, 5), extend(0, 17, 3)])
    batches = [train(machine, float(i))[0] for i in range(5)]
    assert batches == [
        BatchSlice(0, 8, 12),
        BatchSlice(0, 12, 14),
        BatchSlice(0, 0, 4),
        BatchSlice(0, 4, 5),
        BatchSlice(0, 17, 20),
    ]
    assert isinstance(next_batch(machine, 9.0).last, Wait)


def test_one_batch_report_per_finished_batch_with_its_timing_and_loss() -> None:
    machine = new_machine(rank=1)
    machine.receive(epoch_work(0, 0, 8))
    assert next_batch(machine, 10.0).batch == BatchSlice(0, 0, 4)
    assert machine.current == BatchSlice(0, 0, 4)
    effects = machine.batch_done(0.75, 3.5, 10.25)
    assert effects == [
        Send(Batch(rank=1, batch_ms=250.0, data_ms=3.5, step_count=1, batch_loss=0.75))
    ]
    assert machine.current is None
    assert (machine.batches, machine.step_count, machine.since_average) == (1, 1, 1)
    next_batch(machine, 11.0)
    (report,) = sent_of(machine.batch_done(0.5, -2.0, 10.5), Batch)  # clock went back
    assert report.step_count == 2 and report.batch_ms == 0.0 and report.data_ms == 0.0
    with pytest.raises(OutOfTurn, match="batch_done"):
        machine.batch_done(0.5, 0.0, 12.0)
    assert machine.step_count == 2  # the refused call counted nothing


def test_metrics_completion_frame_when_the_work_runs_dry() -> None:
    machine = new_machine(rank=1)
    machine.receive(epoch_work(1, 4, 10))  # batches of 4, 4, 2
    machine.enter_boundary(100.0)
    assert drive_boundary(machine, 100.0).batch == BatchSlice(1, 4, 8)
    machine.leave_boundary(100.0)
    machine.batch_done(1.0, 0.0, 101.0)
    for loss, entered in ((2.0, 101.0), (4.5, 102.5)):
        machine.enter_boundary(entered)
        drive_boundary(machine, entered + 0.5)  # half a second lost at each of these
        machine.leave_boundary(entered + 0.5)
        machine.batch_done(loss, 0.0, entered + 1.5)
    machine.enter_boundary(104.0)
    dry = drive_boundary(machine, 105.0)
    assert dry.steps == [Wait()]
    (metrics,) = dry.sent
    assert metrics == Metrics(
        rank=1,
        epoch=1,
        avg_loss=7.5 / 3,
        batches_processed=3,
        samples_processed=10,
        epoch_ms=5000.0,
        scalars=(("idle_ms", 1000.0),),
    )
    # One frame per chunk: asking again at the barrier sends nothing more.
    assert drive_boundary(machine, 106.0).effects == [Wait()]
    machine.leave_boundary(106.0)
    # The next chunk's frame counts only its own batches.
    machine.receive(extend(1, 0, 3))
    train(machine, 107.0, loss=9.0)
    (second,) = sent_of(next_batch(machine, 109.0).effects, Metrics)
    assert (second.batches_processed, second.samples_processed, second.avg_loss) == (1, 3, 9.0)
    assert second.epoch_ms == 2000.0


def test_metrics_when_the_epoch_changes_then_the_new_epoch_starts() -> None:
    machine = new_machine()
    receive_all(machine, [epoch_work(0, 0, 6), epoch_work(1, 10, 4)])
    train(machine, 0.0, 1.0)
    train(machine, 2.0, 3.0)
    change = next_batch(machine, 4.0)
    assert change.batch == BatchSlice(1, 10, 14)
    (metrics,) = sent_of(change.effects, Metrics)
    assert (metrics.epoch, metrics.batches_processed, metrics.samples_processed) == (0, 2, 6)
    assert metrics.avg_loss == 2.0 and metrics.epoch_ms == 4000.0
    assert change.effects.index(Send(metrics)) < change.effects.index(change.last)
    assert machine.epoch == 1
    machine.batch_done(5.0, 0.0, 5.0)
    (last,) = sent_of(next_batch(machine, 6.0).effects, Metrics)
    assert (last.epoch, last.batches_processed, last.samples_processed) == (1, 1, 4)


def test_losses_that_are_not_finite_are_left_out_of_the_average_loss() -> None:
    machine = new_machine()
    machine.receive(epoch_work(0, 0, 12))
    for now, loss in ((0.0, math.nan), (1.0, 3.0), (2.0, math.inf)):
        next_batch(machine, now)
        machine.batch_done(loss, 0.0, now + 0.5)
    (metrics,) = sent_of(next_batch(machine, 3.0).effects, Metrics)
    assert metrics.avg_loss == 3.0 and metrics.batches_processed == 3
    machine.receive(extend(0, 12, 4))
    next_batch(machine, 4.0)
    machine.batch_done(math.nan, 0.0, 4.5)
    (only_nan,) = sent_of(next_batch(machine, 5.0).effects, Metrics)
    assert math.isnan(only_nan.avg_loss) and only_nan.batches_processed == 1


def test_bad_work_fails_the_boundary_and_is_not_trained() -> None:
    machine = new_machine()
    reactions = machine.receive(extend(0, 18, 4))  # past the 20 samples
    assert reactions == [Wake()] and machine.queued == 1
    assert isinstance(first_error(machine, 0.0), ProtocolError)
    assert machine.queued == 0
    machine.receive(extend(0, 0, 4))
    assert train(machine, 1.0)[0] == BatchSlice(0, 0, 4)  # the machine goes on


def test_heartbeat_carries_the_step_count() -> None:
    machine = new_machine(rank=1)
    assert machine.heartbeat() == Heartbeat(rank=1, step_count=0)
    machine.receive(epoch_work(0, 0, 8))
    train(machine, 0.0)
    assert machine.heartbeat() == Heartbeat(rank=1, step_count=1)


def test_epoch_aggregated_is_kept_for_the_loop() -> None:
    machine = new_machine()
    summary = EpochAggregated(epoch=0, avg_loss=0.5, samples=20, epoch_ms=10.0)
    assert machine.receive(summary) == []
    assert machine.last_epoch == summary


# --- averaging -------------------------------------------------------------------------------


def test_sync_now_averages_at_the_next_boundary_and_acks_with_its_round() -> None:
    machine = new_machine(rank=1)
    machine.receive(epoch_work(0, 0, 20))
    train(machine, 0.0)
    train(machine, 2.0)
    sync = SyncNow(round=3, generation=0)
    assert machine.receive(sync) == [Wake()] and machine.queued == 1
    machine.enter_boundary(4.0)
    effects = machine.boundary(4.0)
    assert effects == [Average(sync, background=False)]
    assert machine.round_weight(sync, group_rank=0) == 2
    ack = machine.average_finished(sync, MeasuredRound(0.5, math.inf, 1.0), 1.5)
    assert ack == [
        Send(SyncAck(rank=1, round=3, step_count=3, divergence=0.5, post_norm=None, pre_norm=1.0))
    ]
    assert (machine.syncs, machine.since_average, machine.times.averaging_s) == (1, 0, 1.5)
    assert drive_boundary(machine, 5.5).batch == BatchSlice(0, 8, 12)  # the work goes on
    machine.leave_boundary(5.5)
    assert machine.times.idle_s == 0.0  # 1.5 s averaging, not idle
    (report,) = sent_of(machine.batch_done(0.1, 0.0, 6.0), Batch)
    assert report.step_count == 4  # batches plus finished averages


def test_a_failed_average_sends_no_ack_and_keeps_the_batches_unaveraged() -> None:
    machine = new_machine()
    machine.receive(epoch_work(0, 0, 20))
    train(machine, 0.0)
    sync = SyncNow(round=1, generation=0)
    machine.receive(sync)
    done = next_batch(machine, 2.0, figures=None, average_s=0.5)
    assert done.steps == [Average(sync), HandOut(BatchSlice(0, 4, 8))]
    assert sent_of(done.effects, SyncAck) == []
    assert (machine.syncs, machine.step_count, machine.since_average) == (0, 1, 1)
    assert machine.times.averaging_s == 0.5
    # The redone round (next number, new generation) carries the same batches.
    machine.batch_done(0.1, 0.0, 3.0)
    redo = SyncNow(round=2, generation=1)
    machine.receive(redo)
    again = next_batch(machine, 4.0)
    assert again.weights == [2]
    assert [ack.round for ack in sent_of(again.effects, SyncAck)] == [2]


def test_sync_now_waits_in_the_inbox_behind_earlier_messages_and_ahead_of_later_work() -> None:
    machine = new_machine()
    machine.receive(epoch_work(0, 0, 8))
    train(machine, 0.0)  # positions 4..8 still queued
    # Behind a queued message, work waits in the inbox too (arrival order is kept).
    assert machine.receive(Checkpoint(version=1, target_rank=1)) == [Wake()]
    assert machine.receive(extend(0, 18, 5)) == [Wake()]  # bad work, queued before the sync
    sync = SyncNow(round=1, generation=0)
    machine.receive(sync)
    assert machine.queued == 3
    assert isinstance(first_error(machine, 1.0), ProtocolError)  # reached before the average
    # Work behind the SyncNow is queued only once the average is done.
    machine.receive(extend(0, 12, 2))
    assert machine.queued == 2
    assert machine.reserve() is None  # nothing goes past a queued message
    passes = next_batch(machine, 2.0)
    assert passes.steps == [Average(sync), HandOut(BatchSlice(0, 4, 8))]
    assert machine.queued == 0
    machine.batch_done(0.1, 0.0, 3.0)
    assert train(machine, 3.0)[0] == BatchSlice(0, 12, 14)


def test_sync_now_is_taken_before_work_already_queued() -> None:
    machine = new_machine()
    machine.receive(epoch_work(0, 0, 20))
    train(machine, 0.0)
    sync = SyncNow(round=1, generation=0)
    machine.receive(sync)
    passes = next_batch(machine, 1.0)
    assert passes.steps == [Average(sync), HandOut(BatchSlice(0, 4, 8))]
    assert passes.sent == [
        SyncAck(rank=0, round=1, step_count=2, divergence=0.25, post_norm=2.0, pre_norm=3.0)
    ]


def test_two_rounds_then_more_work_keep_step_count_batches_plus_averages() -> None:
    machine = new_machine()
    machine.receive(epoch_work(0, 0, 20))
    rounds = [SyncNow(round=r, generation=0) for r in (1, 2)]
    acks: list[SyncAck] = []
    for sync in rounds:
        train(machine, 0.0)
        machine.receive(sync)
        acks += sent_of(next_batch(machine, 1.0).effects, SyncAck)
        machine.batch_done(0.0, 0.0, 2.0)
    assert [(a.round, a.step_count) for a in acks] == [(1, 2), (2, 5)]
    assert machine.step_count == machine.batches + machine.syncs == 6


def test_round_weight_first_round_is_a_broadcast_from_group_rank_zero() -> None:
    machine = new_machine(rank=1)
    first = SyncNow(round=1, generation=0)
    assert machine.round_weight(first, group_rank=0) == 1
    assert machine.round_weight(first, group_rank=1) == 0
    assert machine.round_weight(first, group_rank=3) == 0
    # A failed first round leaves it the first one.
    machine.receive(first)
    next_batch(machine, 0.0, figures=None)
    assert machine.round_weight(SyncNow(round=2, generation=0), group_rank=0) == 1
    # After it settled, weights are the batches since the last average, whatever the group rank.
    machine.receive(SyncNow(round=2, generation=0))
    machine.receive(epoch_work(0, 0, 20))
    assert next_batch(machine, 1.0).weights == [1]
    machine.batch_done(0.0, 0.0, 2.0)
    later = SyncNow(round=3, generation=0)
    assert machine.round_weight(later, group_rank=0) == 1
    assert machine.round_weight(later, group_rank=1) == 1
    machine.receive(later)
    assert next_batch(machine, 3.0).weights == [1]
    assert machine.round_weight(SyncNow(round=4, generation=0), group_rank=0) == 0


def test_round_weight_after_batches_or_in_a_later_generation_is_the_batch_count() -> None:
    machine = new_machine()
    machine.receive(epoch_work(0, 0, 20))
    train(machine, 0.0)
    train(machine, 1.0)
    sync = SyncNow(round=1, generation=0)
    assert machine.round_weight(sync, group_rank=0) == 2
    assert machine.round_weight(sync, group_rank=1) == 2
    fresh = new_machine()
    # Generation 1 before any batch (re-formed before training): no broadcast rule.
    assert fresh.round_weight(SyncNow(round=1, generation=1), group_rank=0) == 0


# --- throttle --------------------------------------------------------------------------------


def test_throttle_parks_the_boundary_until_set_global_step_lifts_it() -> None:
    machine = new_machine()
    machine.receive(epoch_work(0, 0, 20))
    next_batch(machine, 0.0)
    assert machine.receive(Throttle()) == [Wake()] and machine.throttled
    assert machine.reserve() is None
    machine.batch_done(0.1, 0.0, 1.0)
    machine.enter_boundary(1.0)
    assert drive_boundary(machine, 1.0).effects == [Wait()]  # work queued, but parked
    assert drive_boundary(machine, 2.0).effects == [Wait()]
    assert machine.receive(SetGlobalStep(global_step=40)) == [Wake()]
    assert not machine.throttled and machine.global_step == 40
    assert drive_boundary(machine, 3.0).batch == BatchSlice(0, 4, 8)
    machine.leave_boundary(3.0)
    assert machine.times.idle_s == 2.0
    # SetGlobalStep without a throttle only re-bases the step: nothing for a boundary.
    assert machine.receive(SetGlobalStep(global_step=50)) == []
    assert machine.global_step == 50


def test_throttle_is_lifted_by_sync_now_which_averages_first() -> None:
    machine = new_machine()
    machine.receive(epoch_work(0, 0, 20))
    train(machine, 0.0)
    machine.receive(Throttle())
    machine.enter_boundary(1.0)
    assert drive_boundary(machine, 1.0).last == Wait()
    sync = SyncNow(round=1, generation=0)
    machine.receive(sync)
    assert not machine.throttled
    assert drive_boundary(machine, 2.0).steps == [Average(sync), HandOut(BatchSlice(0, 4, 8))]


def test_a_throttled_rank_at_the_end_of_its_work_still_sends_its_completion_frame() -> None:
    machine = new_machine()
    machine.receive(epoch_work(0, 0, 4))
    train(machine, 0.0)
    machine.receive(Throttle())
    parked = next_batch(machine, 2.0)
    assert parked.last == Wait()
    assert [m.batches_processed for m in sent_of(parked.effects, Metrics)] == [1]


# --- checkpoints -----------------------------------------------------------------------------


def test_checkpoint_for_this_rank_is_saved_at_the_boundary_and_reported() -> None:
    machine = new_machine(rank=1)
    machine.receive(epoch_work(0, 0, 20))
    train(machine, 0.0)
    request = Checkpoint(version=4, target_rank=1)
    assert machine.receive(request) == [Wake()]
    machine.enter_boundary(1.0)
    assert machine.boundary(1.0) == [SaveCheckpoint(request)]
    result = machine.checkpoint_finished(request, 12.5, None)
    assert result == [Send(CheckpointResult(rank=1, version=4, elapsed_ms=12.5, error=None))]
    with pytest.raises(OutOfTurn, match="checkpoint_finished"):  # reported once only
        machine.checkpoint_finished(request, 1.0, None)
    again = Checkpoint(version=5, target_rank=1)
    machine.receive(again)
    assert machine.boundary(1.5) == [SaveCheckpoint(again)]
    failed = machine.checkpoint_finished(again, 1.0, "disk full")
    assert sent(failed) == [CheckpointResult(rank=1, version=5, elapsed_ms=1.0, error="disk full")]
    assert machine.boundary(2.0) == [HandOut(BatchSlice(0, 4, 8))]
    machine.leave_boundary(2.0)
    assert machine.step_count == 1  # a checkpoint is not a step


def test_checkpoint_for_another_rank_is_ignored() -> None:
    machine = new_machine(rank=0)
    machine.receive(epoch_work(0, 0, 20))
    train(machine, 0.0)
    machine.receive(Checkpoint(version=4, target_rank=1))
    passes = next_batch(machine, 1.0)
    assert passes.steps == [HandOut(BatchSlice(0, 4, 8))]
    assert passes.sent == [] and machine.queued == 0


# --- ending ----------------------------------------------------------------------------------


def test_shutdown_says_goodbye_at_the_next_boundary_then_finishes_for_good() -> None:
    machine = new_machine(rank=1)
    machine.receive(epoch_work(0, 0, 20))
    next_batch(machine, 0.0)
    machine.receive(SyncNow(round=1, generation=0))  # queued: never averaged now
    assert machine.receive(Shutdown()) == [CancelRound(), Wake()]
    assert state_of(machine) is RankState.ENDING and machine.life.ending and not machine.life.done
    assert not machine.life.takes_rounds
    assert machine.reserve() is None
    machine.batch_done(0.5, 0.0, 1.0)  # the batch in hand is still reported
    bye = next_batch(machine, 2.0)
    assert bye.effects == [
        Send(Note(rank=1, detail="shut down by the coordinator")),
        Send(Exiting(rank=1)),
        Finish(),
    ]
    assert state_of(machine) is RankState.EXITED and machine.life.done
    assert machine.life.exit_reason == "completed"
    for now in (3.0, 4.0):
        assert next_batch(machine, now).effects == [Finish()]


def test_shutdown_with_save_saves_then_says_goodbye_then_raises_with_the_reason() -> None:
    machine = new_machine(rank=1)
    machine.receive(epoch_work(0, 0, 20))
    train(machine, 0.0)
    machine.receive(Throttle())
    reactions = machine.receive(ShutdownWithSave(reason=SaveReason.REDUCE_STALL))
    assert reactions == [CancelRound(), Wake()]
    assert state_of(machine) is RankState.SAVE_PENDING and not machine.throttled
    machine.enter_boundary(1.0)
    assert machine.boundary(1.0) == [CancelRound(), SaveAndStop("REDUCE_STALL")]
    assert state_of(machine) is RankState.SAVING
    with pytest.raises(OutOfTurn):
        machine.boundary(1.5)  # nothing to do while the bundle is written
    bye = machine.save_finished("saved to /runs/r1", 30.0, None, "/runs/r1")
    assert bye == [
        Send(CheckpointResult(rank=1, version=0, elapsed_ms=30.0, error=None, path="/runs/r1")),
        Send(Note(rank=1, detail="saving and stopping: REDUCE_STALL")),
        Send(Exiting(rank=1)),
    ]
    assert state_of(machine) is RankState.STOPPED
    assert machine.life.exit_reason == "shutdown_with_save:REDUCE_STALL"
    for now in (2.0, 3.0):
        (step,) = machine.boundary(now)
        assert isinstance(step, Raise)
        error = step.error
        assert isinstance(error, ShutdownRequested)
        assert error.reason is SaveReason.REDUCE_STALL
        assert "REDUCE_STALL" in str(error) and "saved to /runs/r1" in str(error)
    with pytest.raises(OutOfTurn):
        machine.save_finished("again", 1.0, None, "/runs/r1")


def test_a_second_shutdown_of_either_kind_changes_nothing() -> None:
    machine = new_machine()
    machine.receive(ShutdownWithSave(reason=SaveReason.GRACEFUL))
    assert machine.receive(Shutdown()) == []
    assert machine.receive(ShutdownWithSave(reason=SaveReason.MAX_FAILURE)) == []
    assert state_of(machine) is RankState.SAVE_PENDING
    machine.enter_boundary(0.0)
    assert machine.boundary(0.0)[-1] == SaveAndStop("GRACEFUL")


def test_shutdown_before_the_job_is_announced_ends_without_ready() -> None:
    machine = new_machine(job=None)
    machine.receive(Shutdown())
    assert state_of(machine) is RankState.ENDING
    assert machine.announce(JOB) == []  # too late to announce: no Ready
    bye = next_batch(machine, 1.0)
    assert [type(m) for m in bye.sent] == [Note, Exiting] and bye.last == Finish()


# --- losing the coordinator ------------------------------------------------------------------


def test_connection_lost_gives_up_and_every_later_boundary_raises_it() -> None:
    machine = new_machine()
    machine.receive(epoch_work(0, 0, 20))
    next_batch(machine, 0.0)
    error = CoordinatorError("silent for 30 s")
    assert machine.connection_lost(error) == [GiveUp(error), CancelRound(), Wake()]
    assert state_of(machine) is RankState.LOST and machine.life.done and machine.life.error is error
    assert machine.life.exit_reason == "coordinator_lost: silent for 30 s"
    with pytest.raises(CoordinatorError):
        machine.life.raise_if_lost()
    machine.batch_done(0.5, 0.0, 1.0)  # never raises for a lost coordinator
    # The first boundary saves the rank's own bundle, then raises the loss naming it.
    machine.enter_boundary(2.0)
    assert machine.boundary(2.0) == [CancelRound(), SaveOnLoss()]
    assert machine.loss_save_finished("saved to /runs/r1/flodl-step0") == []
    for now in (2.0, 3.0):
        (raised,) = machine.boundary(now)
        assert isinstance(raised, Raise) and isinstance(raised.error, CoordinatorError)
        assert str(raised.error) == "silent for 30 s; saved to /runs/r1/flodl-step0"
    machine.leave_boundary(3.0)
    assert machine.connection_lost(CoordinatorError("again")) == []
    assert machine.receive(SyncNow(round=1, generation=0)) == []


def test_a_rank_that_trained_nothing_saves_nothing_when_the_coordinator_is_lost() -> None:
    machine = new_machine()
    machine.receive(epoch_work(0, 0, 20))
    error = CoordinatorError("connection reset")
    machine.connection_lost(error)
    machine.enter_boundary(0.0)
    assert machine.boundary(0.0) == [Raise(error)]


def test_connection_lost_before_the_job_makes_announce_raise() -> None:
    machine = new_machine(job=None)
    error = CoordinatorError("connection reset")
    machine.connection_lost(error)
    with pytest.raises(CoordinatorError, match="connection reset"):
        machine.announce(JOB)


@pytest.mark.parametrize("shutdown", [Shutdown(), ShutdownWithSave(reason=SaveReason.GRACEFUL)])
def test_connection_lost_once_ending_changes_nothing(shutdown: Message) -> None:
    machine = new_machine(rank=1)
    machine.receive(shutdown)
    state = machine.life.state
    assert machine.connection_lost(CoordinatorError("gone")) == []
    assert state_of(machine) is state and machine.life.error is None
    machine.enter_boundary(0.0)
    steps = drive_boundary(machine, 0.0).steps
    machine.leave_boundary(0.0)
    if isinstance(shutdown, Shutdown):
        assert steps == [Finish()] and state_of(machine) is RankState.EXITED
    else:
        assert [type(s) for s in steps] == [SaveAndStop, Raise]
        assert state_of(machine) is RankState.STOPPED
        assert isinstance(machine.life.error, ShutdownRequested)
    assert machine.connection_lost(CoordinatorError("gone")) == []
    assert (
        machine.life.exit_reason is not None and "coordinator_lost" not in machine.life.exit_reason
    )


def test_connection_lost_while_saving_still_stops_after_the_save() -> None:
    machine = new_machine()
    machine.receive(ShutdownWithSave(reason=SaveReason.SINGLE_SURVIVOR))
    machine.enter_boundary(0.0)
    machine.boundary(0.0)
    assert machine.connection_lost(CoordinatorError("gone")) == []
    bye = sent(machine.save_finished("saved", 1.0, None, "/runs/bundle"))
    assert [type(m) for m in bye] == [CheckpointResult, Note, Exiting]
    assert state_of(machine) is RankState.STOPPED


# --- the Async policy ------------------------------------------------------------------------


def test_async_round_runs_in_the_background_and_is_blended_at_a_later_boundary() -> None:
    machine = new_machine(Policy.ASYNC, rank=1)
    machine.receive(epoch_work(0, 0, 20))
    train(machine, 0.0)
    train(machine, 1.0)
    sync = SyncNow(round=1, generation=0)
    machine.receive(sync)
    machine.enter_boundary(2.0)
    assert machine.boundary(2.0) == [Average(sync, background=True)]
    machine.background_started(sync)
    assert machine.since_average == 0
    assert drive_boundary(machine, 2.0).batch == BatchSlice(0, 8, 12)  # training goes on
    machine.leave_boundary(2.0)
    assert machine.reserve() == BatchSlice(0, 12, 16)
    machine.batch_done(0.1, 0.0, 3.0)
    assert machine.since_average == 1
    assert machine.background_landed() == [Wake()]
    machine.enter_boundary(3.0)
    assert machine.boundary(3.0) == [Blend(sync)]  # before the reserved batch
    acked = machine.blend_finished(FIGURES, 0.25)
    assert sent(acked) == [
        SyncAck(rank=1, round=1, step_count=4, divergence=0.25, post_norm=2.0, pre_norm=3.0)
    ]
    assert (machine.syncs, machine.since_average, machine.times.averaging_s) == (1, 1, 0.25)
    assert machine.boundary(3.25) == [HandOut(BatchSlice(0, 12, 16), reserved=True)]
    with pytest.raises(OutOfTurn, match="blend_finished"):
        machine.blend_finished(FIGURES, 0.0)  # blended already


def test_async_round_that_does_not_land_puts_its_batches_back() -> None:
    machine = new_machine(Policy.ASYNC)
    machine.receive(epoch_work(0, 0, 20))
    train(machine, 0.0)
    train(machine, 1.0)
    sync = SyncNow(round=1, generation=0)
    machine.receive(sync)
    first = next_batch(machine, 2.0)
    assert first.steps == [Average(sync, background=True), HandOut(BatchSlice(0, 8, 12))]
    assert first.weights == [2] and machine.since_average == 0
    machine.batch_done(0.1, 0.0, 3.0)
    machine.background_landed()
    machine.enter_boundary(3.0)
    assert machine.boundary(3.0) == [Blend(sync)]
    assert machine.blend_finished(None, 0.5) == []
    assert machine.since_average == 3 and machine.syncs == 0 and machine.step_count == 3
    assert machine.times.averaging_s == 0.5


def test_async_background_round_calls_out_of_turn() -> None:
    machine = new_machine(Policy.ASYNC)
    machine.receive(epoch_work(0, 0, 20))
    next_batch(machine, 0.0)
    sync = SyncNow(round=1, generation=0)
    assert machine.background_landed() == []  # nothing in flight: nothing to wake
    with pytest.raises(OutOfTurn):
        machine.blend_finished(FIGURES, 0.0)  # nothing landed
    with pytest.raises(OutOfTurn, match="background_started"):
        machine.background_started(sync)  # no Average step asked for it
    machine.batch_done(0.1, 0.0, 0.5)
    machine.receive(sync)
    machine.enter_boundary(0.5)
    assert machine.boundary(0.5) == [Average(sync, background=True)]
    with pytest.raises(OutOfTurn, match="background_started"):
        machine.background_started(SyncNow(round=2, generation=0))  # not the step's round
    machine.background_started(sync)
    assert machine.boundary(0.5) == [HandOut(BatchSlice(0, 4, 8))]
    machine.leave_boundary(0.5)
    with pytest.raises(OutOfTurn):
        machine.blend_finished(FIGURES, 0.0)  # in flight, not landed
    with pytest.raises(OutOfTurn, match="background_started"):
        machine.background_started(SyncNow(round=2, generation=0))
    assert machine.background_landed() == [Wake()]
    assert machine.reserve() is None  # a landed round needs a boundary
    machine.batch_done(0.1, 0.0, 1.0)
    machine.enter_boundary(1.0)
    assert machine.boundary(1.0) == [Blend(sync)]
    machine.blend_finished(FIGURES, 0.0)
    assert machine.reserve() == BatchSlice(0, 8, 12)  # once blended, it reserves again
    assert machine.boundary(1.0) == [HandOut(BatchSlice(0, 8, 12), reserved=True)]


# --- reserve / take_reserved -----------------------------------------------------------------


def test_a_reserved_batch_is_handed_out_before_the_queue() -> None:
    machine = new_machine()
    machine.receive(epoch_work(0, 0, 20))
    assert machine.reserve() is None  # no batch out yet: nothing to continue
    next_batch(machine, 0.0)
    reserved = machine.reserve()
    assert reserved == BatchSlice(0, 4, 8) == machine.reserved
    assert machine.reserve() is None  # one at a time
    machine.batch_done(0.1, 0.0, 1.0)
    assert next_batch(machine, 1.0).steps == [HandOut(reserved, reserved=True)]
    assert machine.reserved is None
    machine.batch_done(0.1, 0.0, 2.0)
    assert train(machine, 2.0)[0] == BatchSlice(0, 8, 12)


def test_take_reserved_makes_it_the_current_batch_and_reports_one_left_open() -> None:
    machine = new_machine(rank=1)
    machine.receive(epoch_work(0, 0, 20))
    next_batch(machine, 0.0)
    machine.reserve()
    effects = machine.take_reserved(1.0)  # the current batch was not reported done
    (report,) = sent(effects)
    assert isinstance(report, Batch) and math.isnan(report.batch_loss)
    assert report.step_count == 1 and report.batch_ms == 1000.0
    assert machine.current == BatchSlice(0, 4, 8) and machine.reserved is None
    (done,) = sent_of(machine.batch_done(0.5, 0.0, 1.5), Batch)
    assert done.step_count == 2 and done.batch_ms == 500.0  # timed from the take
    assert machine.reserve() == BatchSlice(0, 8, 12)
    assert machine.take_reserved(2.0) == []  # nothing was out
    assert machine.current == BatchSlice(0, 8, 12)
    with pytest.raises(OutOfTurn, match="take_reserved"):
        machine.take_reserved(3.0)


def test_take_reserved_with_nothing_reserved_is_out_of_turn() -> None:
    machine = new_machine()
    with pytest.raises(OutOfTurn):
        machine.take_reserved(0.0)


def test_reserve_refuses_when_a_boundary_is_needed_first() -> None:
    def in_batch() -> RankMachine:
        machine = new_machine()
        receive_all(machine, [epoch_work(0, 0, 8), epoch_work(1, 0, 8)])
        next_batch(machine, 0.0)
        return machine

    queued = in_batch()
    queued.receive(SyncNow(round=1, generation=0))
    assert queued.reserve() is None
    throttled = in_batch()
    throttled.receive(Throttle())
    assert throttled.reserve() is None
    ending = in_batch()
    ending.receive(Shutdown())
    assert ending.reserve() is None
    saving = in_batch()
    saving.receive(ShutdownWithSave(reason=SaveReason.GRACEFUL))
    assert saving.reserve() is None
    lost = in_batch()
    lost.connection_lost(CoordinatorError("gone"))
    assert lost.reserve() is None
    other_epoch = in_batch()
    assert other_epoch.reserve() == BatchSlice(0, 4, 8)
    other_epoch.take_reserved(1.0)
    assert other_epoch.reserve() is None  # the next batch is epoch 1's
    dry = new_machine()
    dry.receive(epoch_work(0, 0, 4))
    next_batch(dry, 0.0)
    assert dry.reserve() is None  # nothing left
    # And when nothing stands in the way, it does reserve.
    assert in_batch().reserve() == BatchSlice(0, 4, 8)


def test_a_reserved_batch_waits_out_a_throttle_and_a_queued_sync() -> None:
    machine = new_machine()
    machine.receive(epoch_work(0, 0, 8))
    next_batch(machine, 0.0)
    reserved = machine.reserve()
    assert reserved is not None
    machine.receive(Throttle())
    machine.batch_done(0.1, 0.0, 1.0)
    machine.enter_boundary(1.0)
    assert drive_boundary(machine, 1.0).effects == [Wait()]  # no Metrics: a batch is reserved
    sync = SyncNow(round=1, generation=0)
    machine.receive(sync)
    passes = drive_boundary(machine, 2.0)
    assert passes.steps == [Average(sync), HandOut(reserved, reserved=True)]


# --- idle and startup accounting -------------------------------------------------------------


def test_time_before_the_first_batch_is_startup_and_after_it_idle() -> None:
    machine = new_machine()
    times = machine.times
    machine.enter_boundary(1.0)
    assert drive_boundary(machine, 1.0).last == Wait()
    first = SyncNow(round=1, generation=0)
    machine.receive(first)  # the opening broadcast round, 2 s of it averaging
    machine.receive(epoch_work(0, 0, 20))
    assert drive_boundary(machine, 2.0, average_s=2.0).last == HandOut(BatchSlice(0, 0, 4))
    machine.leave_boundary(5.0)
    assert times.startup_s == 2.0  # 4 s in the boundary, 2 s of it averaging
    assert times.idle_s == 0.0 and times.averaging_s == 2.0
    machine.leave_boundary(9.0)  # idempotent
    assert times.startup_s == 2.0
    machine.batch_done(0.1, 0.0, 6.0)
    machine.enter_boundary(6.0)
    drive_boundary(machine, 6.5)
    machine.leave_boundary(6.5)
    assert times.idle_s == 0.5 and times.startup_s == 2.0
    machine.batch_done(0.1, 0.0, 7.0)
    machine.receive(SyncNow(round=2, generation=0))
    machine.enter_boundary(7.0)
    drive_boundary(machine, 7.0, average_s=1.0)
    machine.leave_boundary(8.25)  # 1.25 s at the boundary, 1 s averaging
    assert times.idle_s == pytest.approx(0.75) and times.averaging_s == 3.0


def test_boundaries_that_end_without_a_batch_count_as_startup_until_the_first_one() -> None:
    machine = new_machine()
    times = machine.times
    machine.enter_boundary(0.0)
    drive_boundary(machine, 0.0)
    machine.leave_boundary(3.0)  # cancelled with nothing handed out
    assert times.startup_s == 3.0
    machine.enter_boundary(3.5)
    drive_boundary(machine, 3.5)
    machine.leave_boundary(4.0)  # again
    assert times.startup_s == 3.5 and times.idle_s == 0.0
    machine.receive(epoch_work(0, 0, 8))
    machine.enter_boundary(4.0)
    drive_boundary(machine, 4.5)
    machine.leave_boundary(4.5)  # the first batch: its wait is startup too
    assert times.startup_s == 4.0 and times.idle_s == 0.0
    machine.batch_done(0.1, 0.0, 5.0)
    machine.enter_boundary(5.0)
    drive_boundary(machine, 5.0)
    machine.leave_boundary(6.0)
    assert times.idle_s == 1.0 and times.startup_s == 4.0


def test_the_completion_frame_counts_the_idle_time_within_its_chunk() -> None:
    machine = new_machine()
    times = machine.times
    machine.enter_boundary(0.0)
    drive_boundary(machine, 0.0)
    machine.receive(epoch_work(0, 0, 12))
    drive_boundary(machine, 4.0)  # chunk starts at 4.0; 4 s of startup, not the chunk's
    machine.leave_boundary(4.0)
    machine.batch_done(0.1, 0.0, 5.0)
    machine.receive(Throttle())
    machine.enter_boundary(5.0)
    drive_boundary(machine, 5.0)
    machine.receive(SetGlobalStep(global_step=1))
    drive_boundary(machine, 7.0)  # 2 s parked, inside the chunk
    machine.leave_boundary(7.0)
    machine.batch_done(0.1, 0.0, 8.0)
    machine.receive(SyncNow(round=1, generation=0))
    machine.enter_boundary(8.0)
    drive_boundary(machine, 8.0, average_s=3.0)  # averaging is not idle
    machine.leave_boundary(11.5)
    machine.batch_done(0.1, 0.0, 12.0)
    (metrics,) = sent_of(next_batch(machine, 12.0).effects, Metrics)
    assert metrics.scalars == (("idle_ms", 2500.0),)
    assert metrics.epoch_ms == 8000.0
    assert times.idle_s == 2.5 and times.startup_s == 4.0


# --- found bugs ------------------------------------------------------------------------------


def test_a_batch_still_out_at_the_boundary_is_reported_or_refused() -> None:
    machine = new_machine()
    machine.receive(epoch_work(0, 0, 20))
    next_batch(machine, 0.0)
    try:
        passes = next_batch(machine, 1.0)  # batch_done was never called
    except OutOfTurn:
        return
    assert len(sent_of(passes.effects, Batch)) == 1
    assert machine.step_count == 1


def test_async_redo_after_declare_dead_while_a_round_is_in_flight() -> None:
    machine = new_machine(Policy.ASYNC)
    machine.receive(epoch_work(0, 0, 20))
    train(machine, 0.0)
    train(machine, 1.0)
    machine.receive(SyncNow(round=1, generation=0))
    assert next_batch(machine, 2.0).weights == [2]  # started in the background
    machine.batch_done(0.1, 0.0, 3.0)
    assert machine.receive(DeclareDead(rank=1)) == [DoomGroup(1), CancelRound(), Wake()]
    redo = SyncNow(round=2, generation=1)
    machine.receive(redo)
    machine.enter_boundary(3.0)
    weights = _until_average(machine, 3.0, redo)
    # Round 1 was cancelled: its 2 batches were never averaged, so round 2 carries 3.
    assert weights == 3


def test_async_landed_round_is_not_lost_to_the_next_sync() -> None:
    machine = new_machine(Policy.ASYNC)
    machine.receive(epoch_work(0, 0, 20))
    train(machine, 0.0)
    train(machine, 1.0)
    machine.receive(SyncNow(round=1, generation=0))
    assert next_batch(machine, 2.0).weights == [2]
    machine.batch_done(0.1, 0.0, 3.0)
    machine.background_landed()
    machine.receive(DeclareDead(rank=1))  # round 1 is cancelled after it landed
    redo = SyncNow(round=2, generation=1)
    machine.receive(redo)
    machine.enter_boundary(3.0)
    assert _until_average(machine, 3.0, redo) == 3


def test_average_finished_without_an_average_step_is_out_of_turn() -> None:
    machine = new_machine()
    with pytest.raises(OutOfTurn):
        machine.average_finished(SyncNow(round=7, generation=0), FIGURES, 0.0)
    assert machine.step_count == 0 and machine.syncs == 0


def test_checkpoint_finished_without_a_checkpoint_step_is_out_of_turn() -> None:
    machine = new_machine(rank=0)
    machine.receive(Checkpoint(version=3, target_rank=1))  # another rank's checkpoint
    with pytest.raises(OutOfTurn):
        machine.checkpoint_finished(Checkpoint(version=3, target_rank=1), 1.0, None)


def _until_average(machine: RankMachine, now: float, sync: SyncNow) -> int:
    """Drive the boundary like the shell after a CancelRound (a cancelled background round
    lands and fails to blend) until the Average for ``sync``; its round weight."""
    for _ in range(10):
        step = machine.boundary(now)[-1]
        if isinstance(step, Wait):
            machine.background_landed()
        elif isinstance(step, Blend):
            assert machine.blend_finished(None, 0.0) == []
        elif isinstance(step, Average):
            assert step.sync == sync
            weight = machine.round_weight(sync, group_rank=0)
            machine.background_started(sync)
            return weight
        else:
            raise AssertionError(f"unexpected step {step}")
    raise AssertionError("no average")
