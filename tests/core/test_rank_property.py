"""A random but legal run against one rank machine: every sample trained once, reports add up.

A simulated coordinator hands out each epoch's positions ``0..dataset_size-1`` as random
spans (StartEpoch, then ExtendPartition), starts rounds only once the previous one is
acknowledged (round numbers increase), throttles and lifts throttles, regroups between rounds,
beats, broadcasts epoch summaries and may ask for one checkpoint; it shuts down (with or
without a save) once the rank's completion frames cover all the work and nothing is pending.
A simulated loop, shaped like the trio shell, asks for batches, finishes them, sometimes takes
the reserved batch, performs every boundary step, and (Async) sees background rounds land.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Sequence

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.core.common.job import Job
from flodl.core.common.policy import Policy
from flodl.core.common.work import BatchSlice
from flodl.core.rank.effects import (
    Average,
    Blend,
    Finish,
    HandOut,
    Raise,
    RankEffect,
    SaveAndStop,
    SaveCheckpoint,
    SaveOnLoss,
    Send,
    Wait,
    Wake,
)
from flodl.core.rank.machine import RankMachine
from flodl.core.rank.state import RankState
from flodl.errors import ShutdownRequested
from flodl.wire.messages import (
    STOP_SAVE_VERSION,
    Batch,
    Batches,
    Checkpoint,
    CheckpointResult,
    CoordHeartbeat,
    EpochAggregated,
    Exiting,
    ExtendPartition,
    Message,
    Metrics,
    NewGroupSession,
    Note,
    RequestNewGroup,
    SaveReason,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
)
from tests.core.test_rank_machine import FIGURES

MAX_ACTIONS = 250


@st.composite
def jobs(draw: st.DrawFn) -> Job:
    dataset_size = draw(st.integers(1, 24))
    batch_size = draw(st.integers(1, min(dataset_size, 6)))
    return Job(dataset_size, batch_size, draw(st.integers(1, 3)))


@st.composite
def epoch_spans(draw: st.DrawFn, epoch: int, dataset_size: int) -> list[Message]:
    """The epoch's positions as random contiguous spans (some may be empty), in random order:
    the first as StartEpoch, the rest as ExtendPartition."""
    cuts = sorted(draw(st.lists(st.integers(0, dataset_size), max_size=4)))
    bounds = [0, *cuts, dataset_size]
    spans = [(a, b - a) for a, b in itertools.pairwise(bounds)]
    spans = draw(st.permutations(spans))
    first, *rest = spans
    messages: list[Message] = [
        StartEpoch(epoch=epoch, partition_offset=first[0], partition_size=first[1])
    ]
    messages += [ExtendPartition(epoch=epoch, offset=o, size=s) for o, s in rest]
    return messages


@attrs.define
class Run:
    """One simulated coordinator and training loop around ``machine``."""

    machine: RankMachine
    job: Job
    work: deque[Message]
    now: float = 0.0
    # -- the coordinator's side --
    round: int = 0
    generation: int = 0
    outstanding: SyncNow | None = None
    """The round sent and not acknowledged yet."""
    rounds_sent: list[int] = attrs.Factory(list)
    throttled: bool = False
    global_step: int = 0
    summary: EpochAggregated | None = None
    checkpoint: Checkpoint | None = None
    shutdown: Shutdown | ShutdownWithSave | None = None
    received: list[Message] = attrs.Factory(list)
    """Everything the rank sent, in order."""
    # -- the loop's side --
    waiting: bool = False
    """Entered a boundary that answered Wait."""
    takeable: bool = False
    """The reserved batch may be taken without a boundary (the shell's staged batch)."""
    in_flight: bool = False
    """Async: a background round started and not landed."""
    trained: list[BatchSlice] = attrs.Factory(list)
    end: RankEffect | None = None

    # --- the coordinator ---

    def deliver(self, message: Message) -> None:
        self.perform(self.machine.receive(message))
        self.reserve()

    def perform(self, effects: Sequence[RankEffect]) -> None:
        for effect in effects:
            if isinstance(effect, Wake) and effect.boundary:
                self.takeable = False  # the shell's staged batch is invalidated
            elif isinstance(effect, Send):
                self.received.append(effect.message)
                if isinstance(effect.message, SyncAck):
                    assert self.outstanding is not None
                    assert effect.message.round == self.outstanding.round
                    self.outstanding = None

    @property
    def completed(self) -> int:
        """Samples the rank's completion frames report."""
        return sum(m.samples_processed for m in self.received if isinstance(m, Metrics))

    @property
    def checkpoint_pending(self) -> bool:
        if self.checkpoint is None or self.checkpoint.target_rank != self.machine.rank:
            return False
        return not any(isinstance(m, CheckpointResult) for m in self.received)

    @property
    def may_shut_down(self) -> bool:
        return (
            self.shutdown is None
            and not self.work
            and self.completed == self.job.dataset_size * self.job.epochs
            and self.outstanding is None
            and not self.checkpoint_pending
        )

    def start_round(self, skip: int) -> None:
        self.round += 1 + skip
        sync = SyncNow(round=self.round, generation=self.generation)
        self.outstanding, self.throttled = sync, False
        self.rounds_sent.append(self.round)
        self.deliver(sync)

    def regroup(self) -> None:
        self.generation += 1
        self.deliver(RequestNewGroup(generation=self.generation, world_size=2))
        self.deliver(
            NewGroupSession(
                generation=self.generation,
                new_rank=self.machine.rank,
                new_world_size=2,
                info=b"group",
            )
        )

    # --- the training loop ---

    def reserve(self) -> None:
        """The shell reserves the next batch after each message and each hand-out."""
        if self.machine.reserve() is not None:
            self.takeable = True

    @property
    def idle(self) -> bool:
        """Between batches: no batch out and not in a boundary."""
        return self.machine.current is None and not self.waiting and self.end is None

    def batch_done(self, loss: float) -> None:
        self.perform(self.machine.batch_done(loss, 0.0, self.now))

    def take(self) -> None:
        batch = self.machine.reserved
        assert batch is not None and self.takeable
        # Taken without a boundary: nothing may be waiting for one.
        assert self.machine.queued == 0 and not self.machine.throttled
        assert self.machine.life.state is RankState.TRAINING
        self.takeable = False
        self.perform(self.machine.take_reserved(self.now))
        self.trained.append(batch)
        self.reserve()

    def boundary(self) -> None:
        """Enter (unless waiting already) and perform steps until a batch, a Wait or the end."""
        machine = self.machine
        if not self.waiting:
            machine.enter_boundary(self.now)
        for _ in range(20):
            effects = machine.boundary(self.now)
            step = effects[-1]
            self.perform(effects[:-1])
            if isinstance(step, Wait):
                self.waiting = True
                return
            if isinstance(step, HandOut | Finish | Raise):
                self.waiting = False
                machine.leave_boundary(self.now)
                if isinstance(step, HandOut):
                    assert not machine.throttled and machine.life.state is RankState.TRAINING
                    if step.reserved:
                        self.takeable = False  # reclaimed from the staged slot
                    self.trained.append(step.batch)
                    self.reserve()
                else:
                    self.end = step
                return
            if isinstance(step, Average):
                machine.round_weight(step.sync, machine.rank)
                if step.background:
                    machine.background_started(step.sync)
                    self.in_flight = True
                else:
                    self.perform(machine.average_finished(step.sync, FIGURES, 0.1))
            elif isinstance(step, Blend):
                self.perform(machine.blend_finished(FIGURES, 0.1))
            elif isinstance(step, SaveCheckpoint):
                self.perform(machine.checkpoint_finished(step.request, 3.0, None))
            elif isinstance(step, SaveAndStop):
                self.perform(
                    machine.save_finished("saved to /runs/bundle", 2.0, None, "/runs/bundle")
                )
            elif isinstance(step, SaveOnLoss):
                self.perform(machine.loss_save_finished("saved to /runs/own"))
            else:
                raise AssertionError(f"unexpected step {step}")
        raise AssertionError("the boundary never settled")

    def land(self) -> None:
        self.in_flight = False
        self.perform(self.machine.background_landed())

    # --- the end, deterministically ---

    def finish(self, with_save: bool) -> None:
        """Deliver what is left, let the loop drain it, then shut down and run to the end."""
        # Each queued message, batch and round needs a few loop turns: never thousands.
        for _ in range(50 + 4 * (len(self.work) + self.job.dataset_size * self.job.epochs)):
            self.now += 0.5
            if self.end is not None:
                return
            if self.throttled:
                self.global_step += 1
                self.throttled = False
                self.deliver(SetGlobalStep(global_step=self.global_step))
            elif self.work:
                self.deliver(self.work.popleft())
            elif self.machine.current is not None:
                self.batch_done(0.5)
            elif self.in_flight:
                self.land()
            elif self.shutdown is None and self.may_shut_down:
                self.send_shutdown(with_save)
            else:
                self.boundary()
        raise AssertionError("the run never ended")

    def send_shutdown(self, with_save: bool) -> None:
        shutdown: Shutdown | ShutdownWithSave = (
            ShutdownWithSave(reason=SaveReason.GRACEFUL) if with_save else Shutdown()
        )
        self.shutdown = shutdown
        self.deliver(shutdown)


def play(choices: Sequence[int], run: Run) -> None:
    """Random legal actions of the coordinator and the loop: ``choices[i]`` picks the i-th
    among those legal at that point (and, divided down, the details of the one it picks)."""
    machine = run.machine
    for choice in choices:
        run.now += 0.25
        actions = ["heartbeat", "summary"]
        if run.work:
            actions += ["work", "work", "work"]
        if run.outstanding is None and run.round < 40:
            actions += ["sync", "regroup"]
        actions.append("lift" if run.throttled else "throttle")
        if run.checkpoint is None:
            actions.append("checkpoint")
        if run.in_flight:
            actions.append("land")
        if machine.current is not None:
            actions += ["done", "done", "done"]
        if run.takeable and machine.current is None and not run.waiting:
            actions.append("take")
        if run.takeable and machine.current is not None:
            actions.append("take")  # the current batch is reported with a NaN loss first
        if run.idle or run.waiting:
            actions += ["boundary", "boundary", "boundary"]
        action = actions[choice % len(actions)]
        detail = choice // len(actions)
        if action == "heartbeat":
            run.deliver(CoordHeartbeat())
            beat = machine.heartbeat()  # and the rank's own beat (coalescing: its reports)
            if beat is not None:
                run.received.append(beat)
        elif action == "summary":
            run.summary = EpochAggregated(
                epoch=machine.epoch, avg_loss=0.5, samples=run.job.dataset_size, epoch_ms=9.0
            )
            run.deliver(run.summary)
        elif action == "work":
            run.deliver(run.work.popleft())
        elif action == "sync":
            run.start_round(detail % 3)
        elif action == "regroup":
            run.regroup()
        elif action == "throttle":
            run.throttled = True
            run.deliver(Throttle())
        elif action == "lift":
            if detail % 2 and run.outstanding is None:
                run.start_round(0)
            else:
                run.global_step += 1 + detail % 5
                run.throttled = False
                run.deliver(SetGlobalStep(global_step=run.global_step))
        elif action == "checkpoint":
            target = machine.rank if detail % 2 else 1 - machine.rank
            run.checkpoint = Checkpoint(version=1, target_rank=target)
            run.deliver(run.checkpoint)
        elif action == "land":
            run.land()
        elif action == "done":
            run.batch_done(float(detail % 7))
        elif action == "take":
            run.take()
        else:
            run.boundary()


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    job=jobs(),
    policy=st.sampled_from(Policy),
    rank=st.integers(0, 1),
    with_save=st.booleans(),
    coalesce=st.booleans(),
)
def test_a_random_legal_run_trains_every_sample_once_and_reports_it(
    data: st.DataObject, job: Job, policy: Policy, rank: int, with_save: bool, coalesce: bool
) -> None:
    work: deque[Message] = deque()
    for epoch in range(job.epochs):
        work += data.draw(epoch_spans(epoch, job.dataset_size), label=f"epoch {epoch}")
    machine = RankMachine(rank, 2, policy, coalesce=coalesce)
    machine.announce(job)
    run = Run(machine, job, work)
    length = data.draw(st.integers(0, MAX_ACTIONS), label="length")
    play(data.draw(st.binary(min_size=length, max_size=length), label="actions"), run)
    run.finish(with_save)
    if coalesce:
        # Reports only as Batches, each batch's before any message sent after it: before a
        # chunk's completion frame, every batch of the chunk was reported.
        assert not any(isinstance(m, Batch) for m in run.received)
        reported = finished = 0
        for message in run.received:
            if isinstance(message, Batches):
                reported += len(message.batch_ms)
            elif isinstance(message, Metrics):
                finished += message.batches_processed
                assert reported >= finished
        run.received = [
            r for m in run.received for r in (m.reports() if isinstance(m, Batches) else [m])
        ]
        assert machine.held == 0

    # Every position of every epoch trained exactly once.
    trained = Counter((b.epoch, p) for b in run.trained for p in range(b.start, b.stop))
    expected = {(e, p): 1 for e in range(job.epochs) for p in range(job.dataset_size)}
    assert dict(trained) == expected
    assert all(0 < b.size <= job.batch_size for b in run.trained)

    # One Batch per batch handed out; step counts are batches plus finished averages.
    reports = [m for m in run.received if isinstance(m, Batch)]
    acks = [m for m in run.received if isinstance(m, SyncAck)]
    assert len(reports) == len(run.trained) == machine.batches
    assert [a.round for a in acks] == run.rounds_sent  # every round acked once, in order
    assert machine.syncs == len(acks)
    assert machine.step_count == machine.batches + len(acks)
    counted = [m.step_count for m in run.received if isinstance(m, Batch | SyncAck)]
    assert counted == list(range(1, machine.step_count + 1))

    # The completion frames cover the work, epoch by epoch, batch for batch.
    frames = [m for m in run.received if isinstance(m, Metrics)]
    assert sum(f.batches_processed for f in frames) == machine.batches
    per_epoch = Counter[int]()
    for frame in frames:
        per_epoch[frame.epoch] += frame.samples_processed
    assert per_epoch == {e: job.dataset_size for e in range(job.epochs)}

    # A checkpoint for this rank was answered once; one for another rank never.
    results = [m for m in run.received if isinstance(m, CheckpointResult)]
    numbered = [m for m in results if m.version != STOP_SAVE_VERSION]
    targeted = run.checkpoint is not None and run.checkpoint.target_rank == rank
    assert len(numbered) == (1 if targeted else 0)
    # The stop's bundle is reported once, just before the goodbye, when a save was asked.
    stop_saves = [m for m in results if m.version == STOP_SAVE_VERSION]
    assert stop_saves == ([run.received[-3]] if with_save else [])

    # What the coordinator set reached the rank.
    assert machine.global_step == run.global_step
    assert machine.last_epoch == run.summary

    # The run ended for this rank: goodbye last, then a terminal state.
    assert [type(m) for m in run.received[-2:]] == [Note, Exiting]
    assert sum(isinstance(m, Exiting) for m in run.received) == 1
    assert machine.life.done
    if with_save:
        assert machine.life.state is RankState.STOPPED
        assert isinstance(run.end, Raise) and isinstance(run.end.error, ShutdownRequested)
    else:
        assert machine.life.state is RankState.EXITED and run.end == Finish()
