"""What a training loop is handed: one batch, as positions of the epoch order and indices."""

from __future__ import annotations

import attrs

from flodl.core.common.work import BatchSlice, EpochOrders

__all__ = ["Assignment"]


@attrs.frozen
class Assignment:
    """One batch to train: positions ``[start, stop)`` of ``epoch``'s order and their indices."""

    epoch: int
    start: int
    stop: int
    indices: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.stop - self.start

    @staticmethod
    def of(batch: BatchSlice, orders: EpochOrders) -> Assignment:
        """``batch`` with the dataset indices of its samples."""
        indices = tuple(orders.indices(batch))
        return Assignment(batch.epoch, batch.start, batch.stop, indices)
