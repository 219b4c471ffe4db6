"""A stop of the training before its epochs are done (a rank's ``stop``, the time budget
``max_time``): nothing more is handed out, what was handed out is trained, a last round
averages it, and the run completes (Shutdown, not a save), so every rank ends with one model.
Real coordinator and channels, scripted ranks, MockClock."""

from __future__ import annotations

from collections import Counter

import pytest
from trio.testing import MockClock

from flodl.config import CoordinatorConfig
from flodl.core.coordinator.machine import Status
from flodl.core.coordinator.timeline import EventKind, TimelineEvent
from flodl.testing import Cluster, RankScript, open_cluster
from flodl.wire.messages import Shutdown

SPEEDS = (10.0, 10.0, 25.0)  # ms per batch: the last rank 2.5x slower


def events(cluster: Cluster, kind: EventKind) -> list[TimelineEvent]:
    return [e for e in cluster.coordinator.timeline if e.kind is kind]


def assert_ended_on_one_model(cluster: Cluster) -> None:
    """Every batch trained was averaged in a round that settled, the last round came after
    the last batch, and every rank was let go with a plain Shutdown."""
    trained = sum(rank.record.batches for rank in cluster.ranks)
    averaged = sum(sum(e.detail["steps"]) for e in events(cluster, EventKind.SYNC_START))
    assert averaged == trained
    starts, ends = events(cluster, EventKind.SYNC_START), events(cluster, EventKind.SYNC_END)
    assert len(starts) == len(ends)
    for rank in cluster.ranks:
        assert isinstance(rank.record.ended_by, Shutdown), rank.record.ended_by
    for epoch, count in Counter(s for r in cluster.ranks for s in r.record.samples).items():
        assert count == 1, f"sample {epoch} trained {count} times"


@pytest.mark.parametrize("policy", ["cadence", "async", "sync"])
async def test_the_time_budget_ends_the_run_with_a_last_round(
    autojump_clock: MockClock, policy: str
) -> None:
    config = CoordinatorConfig(policy=policy, max_time=3.0)
    scripts = [RankScript(ms_per_batch=ms) for ms in SPEEDS]
    async with open_cluster(scripts, dataset_size=50_000, epochs=5, config=config) as cluster:
        await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    machine = cluster.coordinator.machine
    assert machine.outcome.status is Status.COMPLETED
    assert machine.outcome.message == "the time budget (3 s of training) is spent"
    (started,) = events(cluster, EventKind.TRAINING_STARTED)
    (stop,) = events(cluster, EventKind.STOP_REQUESTED)
    assert stop.time == pytest.approx(started.time + 3.0, abs=0.01)
    assert stop.detail["rank"] is None
    (shutdown,) = events(cluster, EventKind.SHUTDOWN)
    assert stop.time < shutdown.time < stop.time + 2.0  # the rest of one window
    assert_ended_on_one_model(cluster)
    # Far from every epoch: the untrained batches were left, not handed out, and a resume
    # starts again at the epoch the stop cut short.
    assert sum(r.record.batches for r in cluster.ranks) < 50_000 // 10
    assert machine.checkpoint_meta()["epoch"] == 0


async def test_a_ranks_stop_ends_the_run_for_every_rank(autojump_clock: MockClock) -> None:
    scripts = [RankScript(ms_per_batch=ms) for ms in SPEEDS[:2]]
    scripts.append(RankScript(ms_per_batch=SPEEDS[2], stop_after_batches=40))
    async with open_cluster(scripts, dataset_size=50_000, epochs=3) as cluster:
        await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    machine = cluster.coordinator.machine
    assert machine.outcome.status is Status.COMPLETED
    assert machine.outcome.message == "rank 2 stopped the training: scripted stop"
    (stop,) = events(cluster, EventKind.STOP_REQUESTED)
    assert stop.detail["rank"] == 2
    assert_ended_on_one_model(cluster)
    assert cluster.ranks[2].record.batches < 60


async def test_a_second_stop_and_one_after_the_budget_change_nothing(
    autojump_clock: MockClock,
) -> None:
    config = CoordinatorConfig(max_time=1.0)
    scripts = [RankScript(ms_per_batch=10.0, stop_after_batches=n) for n in (30, 60)]
    async with open_cluster(scripts, dataset_size=50_000, config=config) as cluster:
        await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert len(events(cluster, EventKind.STOP_REQUESTED)) == 1
    assert cluster.coordinator.machine.outcome.message.startswith("rank 0 stopped the training")
    assert_ended_on_one_model(cluster)


async def test_each_round_records_the_windows_mean_loss_per_rank(
    autojump_clock: MockClock,
) -> None:
    # A scripted rank reports 1 / n as the loss of its n-th batch.
    async with open_cluster([RankScript(ms_per_batch=10.0)], dataset_size=2_000) as cluster:
        await cluster.coordinator.wait_finished()
    ends = events(cluster, EventKind.SYNC_END)
    trained = [e.detail["ranks"]["0"] for e in ends if e.detail["ranks"]["0"]["batches"]]
    assert trained and ends[0].detail["ranks"]["0"]["loss"] is None
    done = 0
    for facts in trained:
        n = facts["batches"]
        expected = sum(1.0 / k for k in range(done + 1, done + n + 1)) / n
        assert facts["loss"] == pytest.approx(expected)
        done += n
