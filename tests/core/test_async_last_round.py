"""Async: a landed round with nothing trained since its snapshot is taken exactly, not blended.

That is what makes an Async run end with one model: the run's last round starts only once
every batch is reported, so on every member it lands on parameters equal to its snapshot,
and each member takes the same average as it is (as under Sync and Cadence).
"""

from __future__ import annotations

from flodl.core.common.policy import Policy
from flodl.core.common.work import BatchSlice
from flodl.core.rank.effects import Average, Blend, HandOut, Wait, Wake
from flodl.core.rank.state import RankState
from flodl.wire.messages import Metrics, SyncAck, SyncNow
from tests.core.test_rank_machine import (
    FIGURES,
    drive_boundary,
    epoch_work,
    new_machine,
    next_batch,
    sent_of,
    state_of,
    train,
)


def test_a_round_landing_after_the_last_batch_is_taken_exactly() -> None:
    machine = new_machine(Policy.ASYNC, rank=1)
    machine.receive(epoch_work(0, 0, 8))
    train(machine, 0.0)
    train(machine, 2.0)  # every batch this rank was given
    last = SyncNow(round=3, generation=0)
    machine.receive(last)
    machine.enter_boundary(4.0)
    started = drive_boundary(machine, 4.0)
    assert started.steps == [Average(last, background=True), Wait()]
    assert sent_of(started.effects, Metrics)  # out of work: its completion frame
    assert machine.since_average == 0
    assert machine.background_landed() == [Wake()]
    assert machine.boundary(4.5) == [Blend(last, exact=True)]
    (ack,) = sent_of(machine.blend_finished(FIGURES, 0.1), SyncAck)
    assert ack.round == 3
    assert machine.boundary(4.6) == [Wait()]
    machine.leave_boundary(4.6)
    assert state_of(machine) is RankState.TRAINING


def test_a_round_landing_after_a_batch_trained_since_its_snapshot_is_blended() -> None:
    machine = new_machine(Policy.ASYNC)
    machine.receive(epoch_work(0, 0, 12))
    train(machine, 0.0)
    sync = SyncNow(round=2, generation=0)
    machine.receive(sync)
    first = next_batch(machine, 1.0)
    assert first.steps == [Average(sync, background=True), HandOut(BatchSlice(0, 4, 8))]
    machine.batch_done(0.3, 0.0, 2.0)  # local progress the blend must keep
    machine.background_landed()
    machine.enter_boundary(2.0)
    assert machine.boundary(2.0) == [Blend(sync, exact=False)]


def test_a_round_that_lands_before_any_batch_after_its_snapshot_is_taken_exactly() -> None:
    machine = new_machine(Policy.ASYNC)
    machine.receive(epoch_work(0, 0, 12))
    train(machine, 0.0)
    sync = SyncNow(round=2, generation=0)
    machine.receive(sync)
    machine.enter_boundary(1.0)
    assert machine.boundary(1.0) == [Average(sync, background=True)]
    machine.background_started(sync)
    machine.background_landed()  # landed before the next batch was handed out
    assert machine.boundary(1.0) == [Blend(sync, exact=True)]
