"""Cadence's idle fill: a rank done with its count before the round triggers gets more batches.

Scripted ranks over the memory transport under MockClock. A rank that turns faster in mid-run
outpaces ElChe's counts for a few windows (its timings are a mean of the last five); without
the fill it waits at every barrier meanwhile, with the fill it keeps training.
"""

from __future__ import annotations

from collections import Counter

from trio.testing import MockClock

from flodl.config import CoordinatorConfig, Policy
from flodl.core.coordinator.machine import Status
from flodl.testing import RankScript, open_cluster
from flodl.wire.messages import ExtendPartition, StartEpoch


def speeding_up() -> list[RankScript]:
    """Rank 1 halves its batch time after 300 batches (another job left its machine)."""
    return [
        RankScript(ms_per_batch=10.0),
        RankScript(ms_per_batch=10.0, ms_per_batch_after=(300, 5.0)),
    ]


async def idle_share_after_the_change(config: CoordinatorConfig) -> tuple[float, int]:
    """Rank 1's idle share over the rounds after its speed change, and its batches."""
    async with open_cluster(
        speeding_up(), dataset_size=100_000, batch_size=10, epochs=1, config=config
    ) as cluster:
        machine = cluster.coordinator.machine
        fast = cluster.ranks[1].record
        await cluster.until(lambda: fast.batches >= 300)
        round_at_change = machine.cycle.round
        idle0, t0 = fast.idle_s, cluster.elapsed()
        await cluster.until(lambda: machine.cycle.round >= round_at_change + 6)
        share = (fast.idle_s - idle0) / (cluster.elapsed() - t0)
        cluster.coordinator.request_stop(save=False)
        await cluster.coordinator.wait_finished()
    return share, fast.batches


async def test_a_rank_faster_than_its_count_keeps_training_instead_of_waiting(
    autojump_clock: MockClock,
) -> None:
    filled, filled_batches = await idle_share_after_the_change(CoordinatorConfig())
    waiting, waiting_batches = await idle_share_after_the_change(
        CoordinatorConfig(fill_idle_ranks=False)
    )
    # Without the fill the sped-up rank waits for about half of each window until ElChe
    # catches up; with it, only the message round trips of the extra batches remain.
    assert waiting > 0.2, waiting
    assert filled < 0.05, filled
    assert filled_batches > waiting_batches


async def test_filled_batches_come_from_the_pool_so_every_sample_runs_once_per_epoch(
    autojump_clock: MockClock,
) -> None:
    async with open_cluster(speeding_up(), dataset_size=20_000, batch_size=10, epochs=2) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.COMPLETED
    samples = Counter(s for rank in cluster.ranks for s in rank.record.samples)
    assert len(samples) == 40_000 and set(samples.values()) == {1}
    one_batch = [
        m
        for m in cluster.ranks[1].record.received
        if isinstance(m, ExtendPartition | StartEpoch)
        and (m.size if isinstance(m, ExtendPartition) else m.partition_size) == 10
    ]
    assert one_batch, "the fast rank was never given an extra batch"


async def test_balanced_ranks_get_no_extra_batches_once_calibrated(
    autojump_clock: MockClock,
) -> None:
    # Equal, steady speeds: once ElChe has timings, the rank that finishes first would only
    # keep the other waiting with an extra batch, so it gets none.
    scripts = [RankScript(ms_per_batch=10.0), RankScript(ms_per_batch=10.0)]
    async with open_cluster(scripts, dataset_size=100_000, batch_size=10, epochs=1) as cluster:
        machine = cluster.coordinator.machine
        await cluster.until(lambda: machine.cycle.round >= 4)
        before = [len(rank.record.received) for rank in cluster.ranks]
        await cluster.until(lambda: machine.cycle.round >= 12)
        cluster.coordinator.request_stop(save=False)
        await cluster.coordinator.wait_finished()
    for rank, start in zip(cluster.ranks, before, strict=True):
        work = [
            m for m in rank.record.received[start:] if isinstance(m, ExtendPartition | StartEpoch)
        ]
        sizes = {m.size if isinstance(m, ExtendPartition) else m.partition_size for m in work}
        assert 10 not in sizes, sizes


async def test_sync_policy_and_throttling_never_fill(autojump_clock: MockClock) -> None:
    for config in (
        CoordinatorConfig(policy=Policy.SYNC),
        CoordinatorConfig(max_batch_diff=50),
    ):
        share, _ = await idle_share_after_the_change(config)
        assert share > 0.2, (config, share)


async def test_a_rank_that_dies_holding_extra_batches_loses_no_sample(
    autojump_clock: MockClock,
) -> None:
    # Rank 1 outpaces its counts (so it is fed extra batches), then crashes; whatever it held,
    # extra batches included, goes to the survivors: every sample still runs once per epoch.
    scripts = [
        RankScript(ms_per_batch=10.0),
        RankScript(ms_per_batch=10.0, ms_per_batch_after=(150, 4.0), die_after_batches=330),
        RankScript(ms_per_batch=10.0),
    ]
    async with open_cluster(scripts, dataset_size=20_000, batch_size=10, epochs=2) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.COMPLETED
    dead = cluster.ranks[1].record
    assert dead.batches == 330
    assert any(isinstance(m, ExtendPartition | StartEpoch) for m in dead.received)
    samples = Counter(s for rank in cluster.ranks for s in rank.record.samples)
    assert len(samples) == 40_000 and set(samples.values()) == {1}
