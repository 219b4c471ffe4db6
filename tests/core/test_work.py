"""A rank's work spans to batches: order, span boundaries, indices from the shared epoch order."""

from __future__ import annotations

import pytest

from flodl.core.common.order import epoch_order
from flodl.core.common.work import BatchSlice, EpochOrders, WorkQueue
from flodl.errors import ConfigError, ProtocolError
from flodl.wire.messages import ExtendPartition, StartEpoch


def drain(queue: WorkQueue) -> list[BatchSlice]:
    out = []
    while (batch := queue.next_batch()) is not None:
        out.append(batch)
    return out


def test_spans_are_cut_into_batches_in_arrival_order_and_never_merged() -> None:
    queue = WorkQueue(batch_size=8, dataset_size=100)
    queue.add(StartEpoch(epoch=0, partition_offset=10, partition_size=25))
    queue.add(ExtendPartition(epoch=0, offset=40, size=8))
    queue.add(ExtendPartition(epoch=0, offset=2, size=3))
    assert queue.queued_samples == 36
    assert drain(queue) == [
        BatchSlice(0, 10, 18),
        BatchSlice(0, 18, 26),
        BatchSlice(0, 26, 34),
        BatchSlice(0, 34, 35),  # the span's short tail: not topped up from the next span
        BatchSlice(0, 40, 48),
        BatchSlice(0, 2, 5),
    ]
    assert queue.empty and queue.queued_samples == 0


def test_a_span_added_mid_way_is_worked_after_the_current_one() -> None:
    queue = WorkQueue(batch_size=4, dataset_size=50)
    queue.add(ExtendPartition(epoch=1, offset=0, size=6))
    assert queue.next_batch() == BatchSlice(1, 0, 4)
    queue.add(ExtendPartition(epoch=1, offset=30, size=4))
    assert drain(queue) == [BatchSlice(1, 4, 6), BatchSlice(1, 30, 34)]


def test_empty_spans_are_ignored_and_spans_past_the_dataset_refused() -> None:
    queue = WorkQueue(batch_size=4, dataset_size=50)
    queue.add(ExtendPartition(epoch=0, offset=10, size=0))
    assert queue.empty and queue.next_batch() is None
    with pytest.raises(ProtocolError, match="past the dataset"):
        queue.add(ExtendPartition(epoch=0, offset=48, size=3))
    with pytest.raises(ConfigError):
        WorkQueue(batch_size=0, dataset_size=50)


def test_indices_are_the_epoch_order_at_the_batch_positions() -> None:
    orders = EpochOrders(seed=7, dataset_size=30)
    order0 = epoch_order(7, 0, 30)
    order1 = epoch_order(7, 1, 30)
    assert order0 != order1
    assert orders.indices(BatchSlice(0, 5, 9)) == order0[5:9]
    assert orders.indices(BatchSlice(1, 28, 30)) == order1[28:30]
    # Only the two latest epochs stay cached; an older one is recomputed identically.
    orders.order(2)
    assert orders.indices(BatchSlice(0, 0, 3)) == order0[0:3]


def test_one_epoch_split_over_spans_covers_every_sample_once() -> None:
    queue = WorkQueue(batch_size=5, dataset_size=23)
    orders = EpochOrders(seed=0, dataset_size=23)
    for offset, size in [(0, 7), (7, 9), (16, 7)]:
        queue.add(ExtendPartition(epoch=3, offset=offset, size=size))
    seen = [i for batch in drain(queue) for i in orders.indices(batch)]
    assert sorted(seen) == list(range(23))
