"""Workload: windows that continue into the next epoch, credited oldest epoch first."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.core.coordinator.workload import Workload, span_batches
from flodl.errors import ConfigError
from flodl.wire.messages import ExtendPartition, StartEpoch


def test_a_window_crosses_into_the_next_epoch_instead_of_stopping_short() -> None:
    work = Workload(dataset_size=100, batch_size=10, epochs=2)  # 10 batches per epoch
    first = work.dispatch_window({0: 4, 1: 4})
    assert [(r, span_batches(m, 10)) for r, m in first] == [(0, 4), (1, 4)]
    second = work.dispatch_window({0: 4, 1: 4})
    # Epoch 0 has 2 batches left: shared 1/1, the rest comes from epoch 1 (a StartEpoch).
    assert second == [
        (0, ExtendPartition(epoch=0, offset=80, size=10)),
        (1, ExtendPartition(epoch=0, offset=90, size=10)),
        (0, StartEpoch(epoch=1, partition_offset=0, partition_size=30)),
        (1, StartEpoch(epoch=1, partition_offset=30, partition_size=30)),
    ]
    assert work.current_epoch == 0 and not work.exhausted


def test_only_the_last_window_is_short_and_then_ranks_are_quiesced() -> None:
    work = Workload(dataset_size=50, batch_size=10, epochs=1)
    sends = work.dispatch_window({0: 4, 1: 4})
    assert sum(span_batches(m, 10) for _, m in sends) == 5
    assert work.exhausted and not work.done
    assert work.quiesced([0, 1]) == frozenset()
    for _ in range(work.in_flight(0)):
        work.complete(0)
    assert work.quiesced([0, 1]) == frozenset({0})


def test_completions_credit_the_oldest_epoch_and_finished_epochs_pop_in_order() -> None:
    work = Workload(dataset_size=40, batch_size=10, epochs=3)
    work.dispatch_window({0: 6})  # 4 of epoch 0, 2 of epoch 1
    assert [work.complete(0) for _ in range(6)] == [(0, 5), (0, 4), (0, 3), (0, 2), (1, 1), (1, 0)]
    assert work.complete(0) == (None, 0)
    finished = work.pop_finished()
    assert [pool.epoch for pool in finished] == [0]
    assert work.current_epoch == 1


def test_a_dead_ranks_remainder_of_every_epoch_goes_to_survivors() -> None:
    work = Workload(dataset_size=40, batch_size=10, epochs=2)
    work.dispatch_window({0: 3, 1: 3})  # epoch 0: 2 + 2; epoch 1: 1 + 1
    work.complete(1)
    sends = work.reassign(1, [0])
    assert [(r, m.epoch, span_batches(m, 10)) for r, m in sends] == [(0, 0, 1), (0, 1, 1)]
    assert work.in_flight(0) == 5


def test_bad_jobs_are_refused() -> None:
    with pytest.raises(ConfigError):
        Workload(dataset_size=5, batch_size=10, epochs=1)
    with pytest.raises(ConfigError):
        Workload(dataset_size=50, batch_size=10, epochs=1, first_epoch=2)


@settings(max_examples=60, deadline=None)
@given(
    epochs=st.integers(1, 4),
    batches=st.integers(1, 12),
    plans=st.lists(
        st.dictionaries(st.integers(0, 3), st.integers(1, 7), min_size=1), min_size=1, max_size=12
    ),
)
def test_every_sample_of_every_epoch_is_handed_out_exactly_once(
    epochs: int, batches: int, plans: list[dict[int, int]]
) -> None:
    work = Workload(dataset_size=batches * 3, batch_size=3, epochs=epochs)
    handed: Counter[tuple[int, int]] = Counter()
    for plan in [*plans, *([{0: 1000}] * (epochs * batches))]:
        if work.exhausted:
            break
        for _, message in work.dispatch_window(plan):
            if isinstance(message, StartEpoch):
                start, size = message.partition_offset, message.partition_size
            else:
                start, size = message.offset, message.size
            handed.update((message.epoch, p) for p in range(start, start + size))
    assert work.exhausted
    assert set(handed.values()) == {1}
    assert len(handed) == epochs * batches * 3


def test_a_stopped_workload_hands_out_nothing_more_and_is_done_once_trained() -> None:
    work = Workload(dataset_size=100, batch_size=10, epochs=3)
    sent = work.dispatch_window({0: 4, 1: 2})
    assert sum(span_batches(m, 10) for _, m in sent) == 6
    work.stop()
    assert work.exhausted and not work.done  # what was handed out is still to be trained
    assert work.dispatch_window({0: 4, 1: 2}) == []
    for rank, count in ((0, 4), (1, 2)):
        work.complete_many(rank, count)
    assert work.done
    (pool,) = work.pop_finished()
    assert pool.epoch == 0 and work.current_epoch == 0  # the epoch it cut short
