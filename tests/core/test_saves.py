"""The checkpoint schedule: asked-for, every N rounds, every N epochs, and the final save."""

from __future__ import annotations

from flodl.core.common.job import Job
from flodl.core.common.policy import Policy
from flodl.core.coordinator.effects import Send
from flodl.core.coordinator.saves import SaveSchedule
from flodl.core.rank.effects import Send as RankSend
from flodl.core.rank.machine import RankMachine
from flodl.wire.messages import Checkpoint, CheckpointResult, Intent, IntentKind, Shutdown


def schedule(
    rounds: int | None = None, epochs: int | None = None, deadline: float = 30.0
) -> SaveSchedule:
    return SaveSchedule(every_rounds=rounds, every_epochs=epochs, deadline=deadline)


def targets(sends: list[Send]) -> list[int]:
    return [s.rank for s in sends]


def test_nothing_is_saved_without_a_schedule_or_a_request() -> None:
    saves = schedule()
    for step in range(1, 6):
        assert saves.settled([0, 1], epoch=step, global_step=step * 10, last=False) == []


def test_every_n_rounds_the_lowest_live_member_saves() -> None:
    saves = schedule(rounds=2)
    got = [
        targets(saves.settled([1, 2, 3], epoch=0, global_step=10 * r, last=False))
        for r in range(1, 7)
    ]
    assert got == [[], [1], [], [1], [], [1]]


def test_versions_grow_and_each_request_names_its_rank() -> None:
    saves = schedule(rounds=1)
    first = saves.settled([0, 1], epoch=0, global_step=5, last=False)
    saves.ask(1)
    second = saves.settled([0, 1], epoch=0, global_step=9, last=False)
    assert first == [Send(0, Checkpoint(version=1, target_rank=0))]
    assert second == [
        Send(0, Checkpoint(version=2, target_rank=0)),
        Send(1, Checkpoint(version=3, target_rank=1)),
    ]


def test_a_round_with_no_training_since_the_last_save_saves_nothing() -> None:
    # The first round of a run (or of a resumed one) averages before any batch.
    saves = SaveSchedule(every_rounds=1, every_epochs=None, deadline=1.0, first_step=40)
    assert saves.settled([0, 1], epoch=2, global_step=40, last=False) == []
    assert targets(saves.settled([0, 1], epoch=2, global_step=48, last=False)) == [0]
    assert saves.settled([0, 1], epoch=2, global_step=48, last=False) == []


def test_every_n_epochs_saves_once_that_many_more_epochs_are_done() -> None:
    saves = SaveSchedule(every_rounds=None, every_epochs=2, deadline=1.0, first_epoch=1)
    epochs = [1, 1, 2, 3, 3, 4, 5]
    got = [
        targets(saves.settled([0, 1], epoch=e, global_step=10 * (i + 1), last=False))
        for i, e in enumerate(epochs)
    ]
    assert got == [[], [], [], [0], [], [], [0]]


def test_a_request_is_served_at_the_next_settled_round_only_for_a_live_member() -> None:
    saves = schedule()
    saves.ask(2)
    saves.ask(5)  # gone by the time the round settles
    assert targets(saves.settled([0, 2], epoch=0, global_step=3, last=False)) == [2]
    assert saves.settled([0, 2], epoch=0, global_step=4, last=False) == []


def test_the_last_round_leaves_every_save_to_the_final_one() -> None:
    saves = schedule(rounds=1)
    saves.ask(1)
    assert saves.settled([0, 1], epoch=3, global_step=90, last=True) == []


def test_the_final_save_asks_every_live_member_and_waits_for_each_answer() -> None:
    saves = schedule(rounds=1, deadline=30.0)
    requests = saves.final([0, 2], now=100.0)
    assert requests == [
        Send(0, Checkpoint(version=1, target_rank=0)),
        Send(2, Checkpoint(version=2, target_rank=2)),
    ]
    assert saves.final_until == 130.0
    assert saves.final([0, 2], now=101.0) == []
    assert not saves.on_result(CheckpointResult(rank=2, version=7, elapsed_ms=1.0))
    assert saves.on_result(CheckpointResult(rank=2, version=2, elapsed_ms=1.0))
    assert saves.final([0, 2], now=102.0) == []
    assert saves.on_result(CheckpointResult(rank=0, version=1, elapsed_ms=1.0, error="disk"))
    assert saves.final([0, 2], now=103.0) is None
    assert saves.final_until is None


def test_the_final_save_does_not_wait_for_a_rank_that_is_gone_nor_past_its_deadline() -> None:
    saves = schedule(deadline=30.0)
    saves.final([0, 1], now=0.0)
    assert saves.on_result(CheckpointResult(rank=0, version=1, elapsed_ms=1.0))
    assert saves.final([0], now=1.0) is None  # rank 1 died before it answered

    stuck = schedule(deadline=30.0)
    stuck.final([0, 1], now=0.0)
    assert stuck.final([0, 1], now=29.9) == []
    assert stuck.final([0, 1], now=30.0) is None


def test_a_rank_asks_for_its_checkpoint_with_an_intent_until_the_run_ends() -> None:
    machine = RankMachine(1, 2, Policy.CADENCE)
    machine.announce(Job(48, 4, 2))
    assert machine.request_checkpoint() == [
        RankSend(Intent(rank=1, kind=IntentKind.CHECKPOINT_NOW))
    ]
    machine.receive(Shutdown())
    assert machine.request_checkpoint() == []
