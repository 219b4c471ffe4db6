"""Coalesced batch reports (``Batches``): the rank holds them, the coordinator decides the same.

A rank built with ``coalesce=True`` sends its reports together: before anything else it sends,
in place of a heartbeat, or once it holds MAX_COALESCED. Its heartbeat is skipped when another
frame went out since the last one. The coordinator takes a ``Batches`` exactly as that many
``Batch`` reports arriving together, so a whole run (rank machines and the coordinator's
machine, pure, on a shared clock) makes the same decisions either way.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
from collections.abc import Callable

import attrs

from flodl.config import CoordinatorConfig
from flodl.core.common.job import Job
from flodl.core.common.policy import Policy
from flodl.core.coordinator.effects import Broadcast, Send
from flodl.core.coordinator.machine import CoordinatorMachine, Effect
from flodl.core.rank.effects import (
    Average,
    Finish,
    HandOut,
    PrepareGroup,
    RankEffect,
    SaveCheckpoint,
    Wait,
)
from flodl.core.rank.effects import Send as RankSend
from flodl.core.rank.machine import MAX_COALESCED, MeasuredRound, RankMachine
from flodl.wire.messages import (
    Batch,
    Batches,
    Heartbeat,
    Message,
    Metrics,
    NewGroupReady,
    StartEpoch,
    SyncAck,
    SyncNow,
)

JOB = Job(dataset_size=240, batch_size=2, epochs=2)


def sends(effects: list[RankEffect]) -> list[Message]:
    return [e.message for e in effects if isinstance(e, RankSend)]


def training_rank(coalesce: bool = True) -> RankMachine:
    machine = RankMachine(0, 2, Policy.CADENCE, coalesce=coalesce)
    machine.announce(JOB)
    machine.receive(StartEpoch(epoch=0, partition_offset=0, partition_size=6))
    return machine


def run_batch(machine: RankMachine, now: float, loss: float = 0.5) -> list[Message]:
    """Hand out the next batch at ``now`` and finish it 10 ms later; what that sent."""
    machine.enter_boundary(now)
    effects = machine.boundary(now)
    assert isinstance(effects[-1], HandOut), effects
    machine.leave_boundary(now)
    return sends(effects[:-1]) + sends(machine.batch_done(loss, 1.0, now + 0.01))


def test_reports_are_held_and_go_out_before_the_completion_frame() -> None:
    machine = training_rank()
    assert run_batch(machine, 0.0, 0.5) == [] and run_batch(machine, 0.1, 0.25) == []
    assert run_batch(machine, 0.2, math.nan) == []
    assert machine.held == 3
    machine.enter_boundary(0.3)
    effects = machine.boundary(0.3)  # the work ran dry: the completion frame
    assert isinstance(effects[-1], Wait)
    batches, metrics = sends(effects)
    assert isinstance(batches, Batches) and isinstance(metrics, Metrics)
    assert batches.step_count == 3 and [round(ms, 6) for ms in batches.batch_ms] == [10.0] * 3
    assert batches.data_ms == (1.0, 1.0, 1.0) and batches.batch_loss[:2] == (0.5, 0.25)
    assert [b.step_count for b in batches.reports()] == [1, 2, 3]
    assert machine.held == 0


def test_reports_go_before_the_ack_with_the_step_count_they_had() -> None:
    machine = training_rank()
    run_batch(machine, 0.0)
    machine.receive(SyncNow(round=1, generation=0))
    machine.enter_boundary(0.1)
    (step,) = machine.boundary(0.1)
    assert isinstance(step, Average)
    batches, ack = sends(machine.average_finished(step.sync, MeasuredRound(), 0.0))
    assert isinstance(batches, Batches) and isinstance(ack, SyncAck)
    assert (batches.step_count, ack.step_count) == (1, 2)


def test_the_heartbeat_carries_held_reports_or_is_skipped_after_another_frame() -> None:
    machine = training_rank()
    assert machine.heartbeat() is None  # Ready went out since
    assert machine.heartbeat() == Heartbeat(rank=0, step_count=0)
    run_batch(machine, 0.0)
    beat = machine.heartbeat()
    assert isinstance(beat, Batches) and beat.step_count == 1 and machine.held == 0
    assert machine.heartbeat() == Heartbeat(rank=0, step_count=1)
    for at in (0.1, 0.2):
        run_batch(machine, at)
    machine.enter_boundary(0.3)
    assert len(sends(machine.boundary(0.3))) == 2  # Batches + Metrics went out
    assert machine.heartbeat() is None  # a frame went out since the last beat
    assert machine.heartbeat() == Heartbeat(rank=0, step_count=3)


def test_without_coalescing_every_batch_is_reported_and_every_beat_sent() -> None:
    machine = training_rank(coalesce=False)
    (report,) = run_batch(machine, 0.0)
    assert isinstance(report, Batch) and report.step_count == 1
    assert machine.heartbeat() == Heartbeat(rank=0, step_count=1)
    assert machine.heartbeat() == Heartbeat(rank=0, step_count=1)


def test_a_full_hold_is_sent_at_once() -> None:
    machine = RankMachine(0, 1, Policy.CADENCE, coalesce=True)
    machine.announce(Job(dataset_size=MAX_COALESCED + 1, batch_size=1, epochs=1))
    machine.receive(StartEpoch(epoch=0, partition_offset=0, partition_size=MAX_COALESCED + 1))
    out: list[Message] = []
    for i in range(MAX_COALESCED):
        out += run_batch(machine, float(i))
    (full,) = out
    assert isinstance(full, Batches) and len(full.batch_ms) == MAX_COALESCED
    assert machine.held == 0


# --- the same run, reported batch by batch or coalesced --------------------------------------


@attrs.define
class CoSim:
    """A coordinator machine and ``world`` rank machines on one clock, no I/O: batches of
    per-rank, seeded durations; every message delivered at the time it is sent (to a rank,
    through the queue, in order); heartbeats every second on per-rank phases."""

    world: int
    coalesce: bool
    seed: int = 7
    job: Job = JOB
    now: float = 0.0
    coordinator: CoordinatorMachine = attrs.field(init=False)
    ranks: list[RankMachine] = attrs.field(init=False)
    frames: int = 0
    _speed: list[float] = attrs.Factory(list)
    _jitter: random.Random = attrs.Factory(random.Random)
    _queue: list[tuple[float, int, Callable[[], None]]] = attrs.Factory(list)
    _order: itertools.count[int] = attrs.Factory(itertools.count)

    def __attrs_post_init__(self) -> None:
        settings = CoordinatorConfig().machine_settings()
        self.coordinator = CoordinatorMachine(self.world, settings, now=0.0)
        self.ranks = [
            RankMachine(r, self.world, Policy.CADENCE, coalesce=self.coalesce)
            for r in range(self.world)
        ]
        rng = random.Random(self.seed)
        self._speed = [rng.uniform(0.05, 0.2) for _ in range(self.world)]
        self._jitter = random.Random(self.seed + 1)
        for rank in range(self.world):
            self.at(rng.uniform(0.0, 1.0), functools.partial(self._beat, rank))

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (when, next(self._order), action))

    def run(self, until: float) -> None:
        for rank in range(self.world):
            self._perform(self.coordinator.on_connect(rank, 0.0))
        for rank, machine in enumerate(self.ranks):
            self._to_coordinator(rank, sends(machine.announce(self.job)))
            machine.enter_boundary(0.0)
            self._boundary(rank)
        while self._queue and self._queue[0][0] <= until and not self.coordinator.finished:
            self.now, _, action = heapq.heappop(self._queue)
            action()

    def _beat(self, rank: int) -> None:
        beat = self.ranks[rank].heartbeat()
        if beat is not None:
            self._to_coordinator(rank, [beat])
        self.at(self.now + 1.0, lambda: self._beat(rank))

    def _to_coordinator(self, rank: int, messages: list[Message]) -> None:
        for message in messages:
            self.frames += 1
            self._perform(self.coordinator.on_message(rank, message, self.now))

    def _perform(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Send):
                self._to_rank(effect.rank, effect.message)
            elif isinstance(effect, Broadcast):
                for rank in effect.ranks or range(self.world):
                    self._to_rank(rank, effect.message)

    def _to_rank(self, rank: int, message: Message) -> None:
        # Delivered from the queue at the same time (in order): never inside a rank's
        # boundary that is sending.
        self.at(self.now, lambda: self._deliver(rank, message))

    def _deliver(self, rank: int, message: Message) -> None:
        machine = self.ranks[rank]
        for effect in machine.receive(message):
            if isinstance(effect, PrepareGroup):
                ready = NewGroupReady(rank, effect.request.generation, b"sim")
                self._to_coordinator(rank, [ready])
        if machine.times.in_boundary and machine.current is None:
            self._boundary(rank)  # waiting: act on it now

    def _boundary(self, rank: int) -> None:
        machine = self.ranks[rank]
        while True:
            effects = machine.boundary(self.now)
            step = effects.pop()
            self._to_coordinator(rank, sends(effects))
            if isinstance(step, Wait):
                return
            if isinstance(step, Average):
                done = machine.average_finished(step.sync, MeasuredRound(), 0.0)
                self._to_coordinator(rank, sends(done))
                continue
            if isinstance(step, SaveCheckpoint):
                done = machine.checkpoint_finished(step.request, 1.0, None)
                self._to_coordinator(rank, sends(done))
                continue
            if isinstance(step, Finish):
                machine.leave_boundary(self.now)
                return
            assert isinstance(step, HandOut), step
            machine.leave_boundary(self.now)
            took = self._speed[rank] * self._jitter.uniform(0.8, 1.2)
            self.at(self.now + took, lambda: self._finish(rank))
            return

    def _finish(self, rank: int) -> None:
        machine = self.ranks[rank]
        self._to_coordinator(rank, sends(machine.batch_done(0.5, 0.0, self.now)))
        machine.enter_boundary(self.now)
        self._boundary(rank)


def without_fill(sim: CoSim) -> CoSim:
    """``sim`` with Cadence's idle fill off (see the last test)."""
    settings = CoordinatorConfig().machine_settings()
    cadence = attrs.evolve(settings.cadence, fill_idle_ranks=False)
    sim.coordinator = CoordinatorMachine(sim.world, attrs.evolve(settings, cadence=cadence), now=0)
    return sim


def test_a_coalescing_world_gets_the_same_decisions_from_fewer_frames() -> None:
    plain, coalesced = without_fill(CoSim(4, False)), without_fill(CoSim(4, True))
    plain.run(60.0)
    coalesced.run(60.0)
    a, b = plain.coordinator, coalesced.coordinator
    assert a.finished and b.finished and plain.now == coalesced.now
    assert a.cycle.round == b.cycle.round > 5
    assert a.elche.state() == b.elche.state()
    assert [s.batches for s in a.stats] == [s.batches for s in b.stats]
    assert a.epoch_results == b.epoch_results
    assert a.cycle.global_step == b.cycle.global_step
    assert [m.step_count for m in plain.ranks] == [m.step_count for m in coalesced.ranks]
    assert coalesced.frames * 2.5 < plain.frames


def test_with_the_idle_fill_a_coalescing_world_still_trains_every_batch_once() -> None:
    # The fill estimates the critical rank's remaining time from its latest report, which
    # now arrives up to a heartbeat late: the estimate stays consistent (step count and
    # arrival time of the same frame) but is off by up to one batch, so decisions may differ.
    plain, coalesced = CoSim(4, False), CoSim(4, True)
    plain.run(60.0)
    coalesced.run(60.0)
    for sim in (plain, coalesced):
        assert sim.coordinator.finished
        assert sum(s.batches for s in sim.coordinator.stats) == JOB.epochs * 120
    assert abs(plain.coordinator.cycle.round - coalesced.coordinator.cycle.round) <= 1


@attrs.define
class RecordingSim(CoSim):
    """A CoSim that records every message the coordinator got, with its rank and time."""

    fed: list[tuple[int, Message, float]] = attrs.Factory(list)

    def _to_coordinator(self, rank: int, messages: list[Message]) -> None:
        self.fed += [(rank, message, self.now) for message in messages]
        super()._to_coordinator(rank, messages)


def coordinator_state(machine: CoordinatorMachine) -> object:
    return (
        machine.cycle.round,
        machine.cycle.global_step,
        [machine.cycle.steps_of(rank) for rank in range(machine.world_size)],
        machine.elche.state(),
        [(s.batches, s.syncs, s.last_loss) for s in machine.stats],
        machine.epoch_results,
        machine.rounds.dispatch.plan,
        machine.finished,
    )


def test_a_batches_frame_decides_exactly_as_its_reports_one_by_one() -> None:
    # The coordinator takes quiet runs of a Batches frame in one step: replaying a coalescing
    # run's frames with every Batches split into its Batch reports (same times) must give the
    # very same effects, call by call, and the same state, idle fill, epochs and all.
    sim = RecordingSim(6, True, seed=3, job=Job(dataset_size=3000, batch_size=2, epochs=3))
    sim.run(600.0)
    assert sim.coordinator.finished and sim.coordinator.cycle.round > 20
    bulk = CoordinatorMachine(6, CoordinatorConfig().machine_settings(), now=0.0)
    single = CoordinatorMachine(6, CoordinatorConfig().machine_settings(), now=0.0)
    for rank in range(6):
        assert bulk.on_connect(rank, 0.0) == single.on_connect(rank, 0.0)
    coalesced = 0
    for rank, message, now in sim.fed:
        got = bulk.on_message(rank, message, now)
        if isinstance(message, Batches):
            coalesced += len(message.batch_ms) > 1
            want: list[Effect] = []
            for report in message.reports():
                want += single.on_message(rank, report, now)
        else:
            want = single.on_message(rank, message, now)
        assert got == want, (rank, message, now)
        # The window's tallies, fill batch and compute time apart, as ElChe will read them.
        ranks, every = range(6), [1] * 6
        tallies = bulk.rounds.dispatch.reports(ranks, every, delivered=False)
        assert tallies == single.rounds.dispatch.reports(ranks, every, delivered=False)
    assert coalesced > 50
    assert coordinator_state(bulk) == coordinator_state(single)
    assert list(bulk.timeline) == list(single.timeline)  # the rounds' records (SyncEnd) too
