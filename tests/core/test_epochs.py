"""EpochTallies: the epoch summary from batch reports, completion frames and the pool's ledger."""

from __future__ import annotations

import math

from flodl.core.coordinator.epochs import EpochTallies
from flodl.core.coordinator.partitions import ChunkPool
from flodl.wire.messages import Metrics


def metrics(rank: int, epoch: int, epoch_ms: float, idle_ms: float) -> Metrics:
    return Metrics(
        rank=rank,
        epoch=epoch,
        avg_loss=0.0,
        batches_processed=1,
        samples_processed=10,
        epoch_ms=epoch_ms,
        scalars=(("idle_ms", idle_ms),),
    )


def test_an_epoch_summary_from_its_reports() -> None:
    pool = ChunkPool(epoch=3, n_samples=40, batch_size=10)  # 4 batches
    pool.dispatch_window({0: 3, 1: 1})
    for rank, batches in ((0, 3), (1, 1)):
        pool.complete(rank, batches)
    tallies = EpochTallies()
    for loss in (1.0, 2.0, 3.0, math.nan):  # a NaN loss counts as 0 in the mean
        tallies.on_batch(3, loss)
    tallies.on_metrics(0, metrics(0, 3, 300.0, 10.0))
    tallies.on_metrics(1, metrics(1, 3, 100.0, 30.0))
    tallies.on_metrics(1, metrics(1, 3, 50.0, 50.0))  # a second chunk of rank 1
    result, message = tallies.aggregate(pool, members=(0, 1), world_size=2)
    assert result == {
        "epoch": 3,
        "avg_loss": 1.5,  # (1 + 2 + 3 + 0) / 4
        "samples": 40,
        "epoch_ms": 300.0,  # the slowest rank's wall time
        "idle_ms": 30.0,  # mean of the scalars
    }
    # Samples per second of each member: 30 in 0.3 s, 10 in 0.15 s.
    assert message.rank_throughput == (100.0, 10 / 0.15)
    assert message.epoch == 3 and message.scalars == (("idle_ms", 30.0),)
    # The tally is gone: a second aggregate starts from nothing.
    again, _ = tallies.aggregate(pool, members=(0, 1), world_size=2)
    assert math.isnan(again["avg_loss"]) and again["epoch_ms"] == 0.0
