"""A rank's work: the coordinator's spans of the epoch order, handed out as batches (pure).

``StartEpoch`` and ``ExtendPartition`` hand a rank spans ``[offset, offset + size)`` of
*positions* in the epoch order ``epoch_order(seed, epoch, dataset_size)``. A rank works
through its spans in the order received, in batches of ``batch_size`` positions; only the
last batch of a span may be shorter, and no batch spans two spans. The samples of a batch
are the dataset indices ``order[p]`` for its positions (:class:`EpochOrders`).
"""

from __future__ import annotations

from collections import deque

import attrs

from flodl.core.common.order import Span, epoch_order
from flodl.errors import ConfigError, ProtocolError
from flodl.wire.messages import ExtendPartition, StartEpoch

__all__ = ["BatchSlice", "EpochOrders", "WorkMessage", "WorkQueue", "work_span"]

WorkMessage = StartEpoch | ExtendPartition
"""A message that hands a rank a span of an epoch's order."""


def work_span(message: WorkMessage) -> tuple[int, Span]:
    """The epoch and the span of its order that a work message hands out.

    The one place that knows the two messages name their span's fields differently.
    """
    if isinstance(message, StartEpoch):
        return message.epoch, Span(message.partition_offset, message.partition_size)
    return message.epoch, Span(message.offset, message.size)


@attrs.frozen
class BatchSlice:
    """One batch: positions ``[start, stop)`` of epoch ``epoch``'s order."""

    epoch: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class WorkQueue:
    """Spans in arrival order, handed out as batches (see the module docstring)."""

    def __init__(self, batch_size: int, dataset_size: int) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.dataset_size = dataset_size
        self._spans: deque[tuple[int, Span]] = deque()
        self._cursor = 0  # positions of the head span already handed out

    def add(self, message: WorkMessage) -> None:
        """Queue the message's span after the others; ProtocolError if it leaves the epoch
        order (nothing is queued then)."""
        epoch, span = work_span(message)
        if span.offset < 0 or span.size < 0 or span.end > self.dataset_size:
            raise ProtocolError(
                f"work span {span} of epoch {epoch} goes past the dataset "
                f"({self.dataset_size} samples)"
            )
        if span.size > 0:
            self._spans.append((epoch, span))

    @property
    def empty(self) -> bool:
        return not self._spans

    @property
    def head_epoch(self) -> int | None:
        """The epoch of the next batch, or None when nothing is queued."""
        return self._spans[0][0] if self._spans else None

    @property
    def queued_samples(self) -> int:
        """Positions queued and not yet handed out."""
        return sum(span.size for _, span in self._spans) - self._cursor

    def next_batch(self) -> BatchSlice | None:
        """The next batch, or None when nothing is queued."""
        if not self._spans:
            return None
        epoch, span = self._spans[0]
        start = span.offset + self._cursor
        stop = min(start + self.batch_size, span.end)
        self._cursor += stop - start
        if self._cursor >= span.size:
            self._spans.popleft()
            self._cursor = 0
        return BatchSlice(epoch, start, stop)


class EpochOrders:
    """``epoch_order`` for each epoch, computed once (the two latest are kept)."""

    def __init__(self, seed: int, dataset_size: int) -> None:
        self.seed = seed
        self.dataset_size = dataset_size
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = epoch_order(self.seed, epoch, self.dataset_size)
            self._orders[epoch] = order
            for old in sorted(self._orders)[:-2]:
                del self._orders[old]
        return order

    def indices(self, batch: BatchSlice) -> list[int]:
        """The dataset indices of ``batch``'s samples."""
        return self.order(batch.epoch)[batch.start : batch.stop]
