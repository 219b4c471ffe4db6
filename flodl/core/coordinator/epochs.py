"""Per-epoch tallies of what the ranks reported, and the epoch summary built from them (pure).

Batch reports add their loss; completion frames (``Metrics``) add each rank's wall time and
scalars. When an epoch's samples are all done, :meth:`EpochTallies.aggregate` turns its tally
and its chunk pool's ledger into the ``EpochAggregated`` the coordinator broadcasts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from flodl.core.coordinator.partitions import ChunkPool
from flodl.wire.messages import EpochAggregated, Metrics


@attrs.define
class EpochTally:
    """One epoch's reports so far."""

    loss_sum: float = 0.0
    batches: int = 0
    wall_ms: dict[int, float] = attrs.field(factory=dict)
    scalars: dict[str, list[float]] = attrs.field(factory=dict)


class EpochTallies:
    """The tallies of every epoch in progress."""

    def __init__(self) -> None:
        self._tallies: dict[int, EpochTally] = {}

    def _of(self, epoch: int) -> EpochTally:
        tally = self._tallies.get(epoch)
        if tally is None:  # not setdefault: that would build a tally on every report
            tally = self._tallies[epoch] = EpochTally()
        return tally

    def on_batch(self, epoch: int, loss: float) -> None:
        """A batch of ``epoch`` finished with ``loss`` (non-finite losses count as 0)."""
        self.on_batches(epoch, (loss,))

    def on_batches(self, epoch: int, losses: Sequence[float]) -> None:
        """:meth:`on_batch` for each of ``losses``, in order."""
        tally = self._of(epoch)
        isfinite = math.isfinite
        # One running sum in report order, so the float result is that of one at a time.
        loss_sum = tally.loss_sum
        for loss in losses:
            loss_sum += loss if isfinite(loss) else 0.0
        tally.loss_sum = loss_sum
        tally.batches += len(losses)

    def on_metrics(self, rank: int, metrics: Metrics) -> None:
        """``rank``'s completion frame: its chunk's wall time and scalars."""
        tally = self._of(metrics.epoch)
        tally.wall_ms[rank] = tally.wall_ms.get(rank, 0.0) + metrics.epoch_ms
        for name, value in metrics.scalars:
            tally.scalars.setdefault(name, []).append(value)

    def aggregate(
        self, pool: ChunkPool, members: Sequence[int], world_size: int
    ) -> tuple[dict[str, Any], EpochAggregated]:
        """Close the finished epoch of ``pool``: its summary (for the timeline and results)
        and the message for ``members`` (throughput listed in their order)."""
        epoch = pool.epoch
        ledger = pool.ledger
        tally = self._tallies.pop(epoch, EpochTally())
        avg_loss = tally.loss_sum / tally.batches if tally.batches else math.nan
        epoch_ms = max(tally.wall_ms.values(), default=0.0)
        samples = sum(ledger.completed(rank) for rank in range(world_size)) * ledger.batch_size
        throughput = []
        for rank in members:
            wall = tally.wall_ms.get(rank, 0.0)
            done = ledger.completed(rank) * ledger.batch_size
            throughput.append(done / (wall / 1000.0) if wall > 0 else 0.0)
        scalars = {k: sum(v) / len(v) for k, v in tally.scalars.items() if v}
        result = {"epoch": epoch, "avg_loss": avg_loss, "samples": samples, "epoch_ms": epoch_ms}
        result.update(scalars)
        message = EpochAggregated(
            epoch=epoch,
            avg_loss=avg_loss,
            samples=samples,
            epoch_ms=epoch_ms,
            rank_throughput=tuple(throughput),
            scalars=tuple(sorted(scalars.items())),
        )
        return result, message
