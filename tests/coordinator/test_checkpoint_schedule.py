"""Checkpoints a run asks for, over the memory transport with scripted ranks, under MockClock."""

from __future__ import annotations

from trio.testing import MockClock

from flodl.config import CoordinatorConfig
from flodl.core.coordinator.machine import Status
from flodl.testing import RankScript, open_cluster
from flodl.wire.messages import Checkpoint, Shutdown


async def test_periodic_saves_go_to_the_lowest_rank_and_every_rank_saves_before_shutdown(
    autojump_clock: MockClock,
) -> None:
    config = CoordinatorConfig(checkpoint_every=2, anchor=5)
    scripts = [RankScript(ms_per_batch=10) for _ in range(3)]
    async with open_cluster(
        scripts, dataset_size=600, batch_size=10, epochs=2, config=config
    ) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.COMPLETED
    rounds = cluster.coordinator.machine.cycle.round
    asked = [[m for m in r.record.received if isinstance(m, Checkpoint)] for r in cluster.ranks]
    # Rank 0: one save per two rounds that trained (the first round trains nothing, the last
    # leaves its save to the final one), then the final save; ranks 1 and 2: the final only.
    assert len(asked[0]) >= 2 and len(asked[0]) <= rounds // 2 + 1
    assert [len(a) for a in asked[1:]] == [1, 1]
    for rank in cluster.ranks:
        received = rank.record.received
        final = max(i for i, m in enumerate(received) if isinstance(m, Checkpoint))
        assert isinstance(rank.record.ended_by, Shutdown)
        assert received.index(rank.record.ended_by) > final
    versions = sorted(m.version for a in asked for m in a)
    assert versions == list(range(1, len(versions) + 1))
    # A completed run's meta counts every epoch as done: a resume starts with the next one.
    assert cluster.coordinator.machine.checkpoint_meta()["epoch"] == 2


async def test_a_run_without_a_schedule_still_saves_once_at_the_end(
    autojump_clock: MockClock,
) -> None:
    scripts = [RankScript(ms_per_batch=10) for _ in range(2)]
    async with open_cluster(scripts, dataset_size=200, batch_size=10, epochs=1) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.COMPLETED
    asked = [[m for m in r.record.received if isinstance(m, Checkpoint)] for r in cluster.ranks]
    assert asked == [
        [Checkpoint(version=1, target_rank=0)],
        [Checkpoint(version=2, target_rank=1)],
    ]
