"""Partitions: the shared epoch order, sizing rules, chunk dispatch, dead-rank remainders."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.core.common.order import Span, SplitMix64, epoch_order
from flodl.core.common.policy import Policy
from flodl.core.coordinator.partitions import (
    ChunkPool,
    EpochLedger,
    equal_sizes,
    largest_remainder_sizes,
    partition_sizes,
    plan_epoch,
    ratio_sizes,
    throughput_sizes,
)
from flodl.errors import ConfigError, CoordinatorError
from flodl.wire.messages import ExtendPartition, StartEpoch

# --- the epoch order ----------------------------------------------------------------------


def test_splitmix64_matches_the_published_reference_vector() -> None:
    rng = SplitMix64(1234567)
    assert [rng.next_u64() for _ in range(5)] == [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]


EXPECTED_42_0 = [1, 10, 5, 14, 13, 11, 2, 12, 7, 16, 0, 6, 15, 18, 19, 9, 4, 17, 8, 3]


def test_epoch_order_is_fixed_for_a_seed() -> None:
    assert epoch_order(42, 0, 20) == EXPECTED_42_0
    assert epoch_order(42, 1, 10) == [7, 3, 8, 6, 1, 2, 0, 9, 5, 4]
    assert epoch_order(42, 0, 0) == []
    assert epoch_order(42, 0, 1) == [0]


def test_epoch_order_is_a_permutation_that_changes_per_epoch() -> None:
    orders = [epoch_order(7, epoch, 1000) for epoch in range(3)]
    for order in orders:
        assert sorted(order) == list(range(1000))
    assert orders[0] != orders[1] != orders[2]
    assert epoch_order(8, 0, 1000) != orders[0]


def test_epoch_order_is_the_same_in_another_process() -> None:
    code = "from flodl.core.common.order import epoch_order; print(epoch_order(42, 0, 20))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(EXPECTED_42_0)


# --- sizing rules -------------------------------------------------------------------------


def test_equal_sizes_give_the_remainder_to_the_first_ranks() -> None:
    assert equal_sizes(10, 3) == [4, 3, 3]
    assert equal_sizes(2, 3) == [1, 1, 0]
    assert equal_sizes(9, 3) == [3, 3, 3]


def test_throughput_sizes_are_inverse_to_ms_with_remainder_to_the_fastest() -> None:
    # weights 1/10 : 1/20 : 1/40 = 4 : 2 : 1 -> floors 57, 28, 14 (99), +1 to rank 0.
    assert throughput_sizes(100, [10.0, 20.0, 40.0]) == [58, 28, 14]
    # The fastest need not come first.
    assert throughput_sizes(100, [40.0, 20.0, 10.0]) == [14, 28, 58]
    # 0 ms counts as 0.001 ms: weights 1000 : 1 -> floors 9, 0, then +1 to rank 0.
    assert throughput_sizes(10, [0.0, 1.0]) == [10, 0]
    # Equally fast: the lower position takes the remainder.
    assert throughput_sizes(7, [5.0, 5.0]) == [4, 3]
    with pytest.raises(ConfigError):
        throughput_sizes(10, [float("nan"), 1.0])


def test_ratio_sizes_floor_then_remainder_to_the_largest() -> None:
    assert ratio_sizes(10, [1.0, 1.0, 2.0]) == [2, 2, 6]  # 2.5, 2.5, 5 -> 2, 2, 5 (+1)
    assert ratio_sizes(3, [1.0, 1.0]) == [2, 1]
    assert ratio_sizes(10, [0.3, 0.7]) == [3, 7]
    with pytest.raises(ConfigError):
        ratio_sizes(10, [0.0, 0.0])
    with pytest.raises(ConfigError):
        ratio_sizes(10, [-1.0, 2.0])


def test_largest_remainder_split() -> None:
    assert largest_remainder_sizes(7, [4, 2, 1]) == [4, 2, 1]
    # 20/7 = 2 r6, 10/7 = 1 r3, 5/7 = 0 r5 -> floors 3, two more to positions 0 and 2.
    assert largest_remainder_sizes(5, [4, 2, 1]) == [3, 1, 1]
    assert largest_remainder_sizes(1, [4, 2, 1]) == [1, 0, 0]
    # Equal remainders: the lower position first.
    assert largest_remainder_sizes(1, [1, 1]) == [1, 0]


def test_partition_sizes_picks_the_rule() -> None:
    ms = [10.0, 20.0, 40.0]
    assert partition_sizes(Policy.SYNC, 10, 3, ms_per_batch=ms) == [4, 3, 3]
    assert partition_sizes(Policy.CADENCE, 100, 3, ms_per_batch=ms) == [58, 28, 14]
    assert partition_sizes(Policy.ASYNC, 100, 3, ms_per_batch=ms) == [58, 28, 14]
    assert partition_sizes(Policy.CADENCE, 10, 3) == [4, 3, 3]  # not calibrated
    assert partition_sizes(Policy.SYNC, 10, 3, ms_per_batch=ms, ratios=[1, 1, 2]) == [2, 2, 6]
    with pytest.raises(ConfigError):
        partition_sizes(Policy.CADENCE, 10, 3, ms_per_batch=[1.0])


sizing = st.one_of(
    st.tuples(st.just("equal"), st.integers(1, 8)).map(lambda t: ("equal", [1.0] * t[1])),
    st.tuples(
        st.just("throughput"),
        st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=1, max_size=8),
    ),
    st.tuples(
        st.just("ratios"),
        st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=1, max_size=8).filter(
            lambda rs: any(r > 0 for r in rs)
        ),
    ),
)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 5000), rule=sizing, batch_size=st.integers(1, 64))
def test_static_plans_are_disjoint_consecutive_and_cover_everything(
    total: int, rule: tuple[str, list[float]], batch_size: int
) -> None:
    kind, values = rule
    if kind == "equal":
        sizes = equal_sizes(total, len(values))
    elif kind == "throughput":
        sizes = throughput_sizes(total, values)
    else:
        sizes = ratio_sizes(total, values)
    assert sum(sizes) == total and min(sizes) >= 0
    ranks = list(range(len(sizes)))
    ledger, starts = plan_epoch(3, ranks, sizes, batch_size)
    covered: list[int] = []
    for rank, start in starts:
        assert start.epoch == 3
        assert start.partition_size == sizes[rank]
        assert start.partition_offset == sum(sizes[:rank])
        covered.extend(range(start.partition_offset, start.partition_offset + start.partition_size))
    assert covered == list(range(total))
    assert {rank for rank, _ in starts} == {r for r in ranks if sizes[r] > 0}
    assert all(ledger.dispatched(r) == -(-sizes[r] // batch_size) for r in ranks)


# --- progressive chunk dispatch -----------------------------------------------------------


def test_pool_ends_with_a_short_batch_and_dispatches_exact_counts() -> None:
    pool = ChunkPool(epoch=2, n_samples=103, batch_size=10)
    assert pool.total_batches == 11  # the last one of 3 samples: no sample is dropped
    assert pool.dispatch_window({0: 4, 1: 2, 2: 1}) == [
        (0, StartEpoch(epoch=2, partition_offset=0, partition_size=40)),
        (1, StartEpoch(epoch=2, partition_offset=40, partition_size=20)),
        (2, StartEpoch(epoch=2, partition_offset=60, partition_size=10)),
    ]
    assert pool.remaining_batches == 4
    # Last window: 4 batches for counts 4:2:1 by largest remainder -> 2 r2, 1 r1, 0 r4 -> 2, 1, 1.
    assert pool.dispatch_window({0: 4, 1: 2, 2: 1}) == [
        (0, ExtendPartition(epoch=2, offset=70, size=20)),
        (1, ExtendPartition(epoch=2, offset=90, size=10)),
        (2, ExtendPartition(epoch=2, offset=100, size=3)),
    ]
    assert pool.drained
    assert pool.dispatch_window({0: 4}) == []
    assert pool.dispatch(1, 5) is None
    assert (pool.ledger.dispatched(0), pool.ledger.dispatched(1), pool.ledger.dispatched(2)) == (
        6,
        3,
        2,
    )


def test_single_dispatch_takes_what_is_left() -> None:
    pool = ChunkPool(epoch=0, n_samples=50, batch_size=10)
    assert pool.dispatch(1, 3) == StartEpoch(epoch=0, partition_offset=0, partition_size=30)
    assert pool.dispatch(1, 3) == ExtendPartition(epoch=0, offset=30, size=20)
    assert pool.dispatch(0, 0) is None


def test_quiesced_and_done() -> None:
    pool = ChunkPool(epoch=0, n_samples=40, batch_size=10)
    pool.dispatch_window({0: 3, 1: 1})
    assert pool.drained
    assert not pool.is_quiesced(1)
    assert pool.complete(1) == 0
    assert pool.is_quiesced(1)
    assert not pool.done()
    assert pool.complete(0, 2) == 0
    assert not pool.is_quiesced(0)
    assert pool.complete(0, 3) == 2  # one fits, two overflow
    assert pool.is_quiesced(0)
    assert pool.done()


def test_not_quiesced_while_the_pool_still_has_work() -> None:
    pool = ChunkPool(epoch=0, n_samples=100, batch_size=10)
    pool.dispatch_window({0: 2, 1: 2})
    pool.complete(0, 2)
    assert not pool.is_quiesced(0)
    assert not pool.done()


# --- dead-rank remainders -----------------------------------------------------------------


def test_dead_ranks_chunk_remainder_goes_to_survivors_in_whole_batches() -> None:
    pool = ChunkPool(epoch=2, n_samples=103, batch_size=10)
    pool.dispatch_window({0: 4, 1: 2, 2: 1})
    pool.dispatch_window({0: 4, 1: 2, 2: 1})  # rank 1 now holds [40, 60) and [90, 100)
    pool.complete(1, 1)  # finished [40, 50)
    assert pool.ledger.remainder(1) == [Span(50, 10), Span(90, 10)]
    assert pool.reassign(1, [0, 2]) == [
        (0, ExtendPartition(epoch=2, offset=50, size=10)),
        (2, ExtendPartition(epoch=2, offset=90, size=10)),
    ]
    assert pool.ledger.ranks == (0, 2)
    assert pool.complete(1, 1) == 1  # a dead rank's late report does not count
    assert pool.reassign(1, [0, 2]) == []  # once only
    pool.complete(0, 7)
    pool.complete(2, 2)
    assert not pool.done()  # rank 2 still holds the short last batch, [100, 103)
    pool.complete(2, 1)
    assert pool.done()


def test_static_remainder_is_offset_plus_done_batches() -> None:
    ledger, _ = plan_epoch(0, [0, 1, 2], [25, 25, 25], batch_size=10)
    ledger.complete(0, 1)  # [0, 10) done; [10, 25) left: batches of 10 and 5
    assert ledger.remainder(0) == [Span(10, 15)]
    assert ledger.reassign(0, [1, 2]) == [
        (1, ExtendPartition(epoch=0, offset=10, size=10)),
        (2, ExtendPartition(epoch=0, offset=20, size=5)),
    ]
    assert ledger.dispatched(1) == 3 + 1
    assert ledger.dispatched(2) == 3 + 1


def test_remainder_to_a_single_survivor_is_merged() -> None:
    ledger, _ = plan_epoch(0, [0, 1], [25, 25], batch_size=10)
    assert ledger.reassign(0, [1]) == [(1, ExtendPartition(epoch=0, offset=0, size=25))]
    assert ledger.dispatched(1) == 6


def test_equal_split_gives_extra_batches_to_the_first_survivors() -> None:
    pool = ChunkPool(epoch=0, n_samples=100, batch_size=10)
    pool.dispatch(3, 5)
    sends = pool.reassign(3, [2, 0, 1])
    assert sends == [
        (0, ExtendPartition(epoch=0, offset=0, size=20)),
        (1, ExtendPartition(epoch=0, offset=20, size=20)),
        (2, ExtendPartition(epoch=0, offset=40, size=10)),
    ]


def test_ledger_refuses_work_for_a_removed_rank() -> None:
    ledger = EpochLedger(0, batch_size=4)
    ledger.assign(0, Span(0, 8))
    ledger.reassign(0, [])
    with pytest.raises(CoordinatorError):
        ledger.assign(0, Span(8, 4))


def trained_samples(ledger: EpochLedger, rank: int) -> list[int]:
    """The positions ``rank`` trained, as a worker following the documented contract would."""
    left = ledger.completed(rank)
    done: list[int] = []
    for span in ledger.spans(rank):
        for start in range(span.offset, span.end, ledger.batch_size):
            if left == 0:
                return done
            done.extend(range(start, min(start + ledger.batch_size, span.end)))
            left -= 1
    return done


events = st.lists(
    st.tuples(st.sampled_from(["work", "die"]), st.integers(0, 7), st.integers(0, 6)),
    max_size=25,
)


@settings(max_examples=200, deadline=None)
@given(
    world=st.integers(2, 6),
    batch_size=st.integers(1, 7),
    n_samples=st.integers(0, 300),
    counts=st.lists(st.integers(0, 6), min_size=6, max_size=6),
    script=events,
)
def test_progressive_epoch_with_deaths_trains_every_sample_once(
    world: int,
    batch_size: int,
    n_samples: int,
    counts: list[int],
    script: list[tuple[str, int, int]],
) -> None:
    pool = ChunkPool(epoch=1, n_samples=n_samples, batch_size=batch_size)
    alive = list(range(world))
    pool.dispatch_window({r: counts[r] for r in alive})
    for kind, who, amount in script:
        rank = alive[who % len(alive)]
        if kind == "work":
            pool.complete(rank, amount)
            if pool.ledger.in_flight(rank) == 0:
                pool.dispatch(rank, counts[rank] or 1)
        elif len(alive) > 1:
            alive.remove(rank)
            pool.reassign(rank, alive)
    # The survivors drain the pool and finish.
    while not pool.done():
        for rank in alive:
            pool.complete(rank, pool.ledger.in_flight(rank))
            pool.dispatch(rank, counts[rank] or 1)
    seen: list[int] = []
    for rank in range(world):
        seen.extend(trained_samples(pool.ledger, rank))
    assert sorted(seen) == list(range(n_samples))  # the last batch may be short: none dropped


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 60), min_size=2, max_size=6),
    batch_size=st.integers(1, 9),
    progress=st.lists(st.integers(0, 10), min_size=6, max_size=6),
    deaths=st.lists(st.integers(0, 5), max_size=5, unique=True),
)
def test_static_epoch_with_deaths_trains_every_sample_once(
    sizes: list[int], batch_size: int, progress: list[int], deaths: list[int]
) -> None:
    ranks = list(range(len(sizes)))
    ledger, _ = plan_epoch(0, ranks, sizes, batch_size)
    alive = list(ranks)
    for dead in deaths:
        if dead not in alive or len(alive) == 1:
            continue
        ledger.complete(dead, progress[dead])
        alive.remove(dead)
        ledger.reassign(dead, alive)
    for rank in alive:
        ledger.complete(rank, ledger.in_flight(rank))
    assert ledger.all_completed()
    seen: list[int] = []
    for rank in ranks:
        seen.extend(trained_samples(ledger, rank))
    assert sorted(seen) == list(range(sum(sizes)))


def test_readmitted_rank_starts_over_with_a_first_span() -> None:
    pool = ChunkPool(epoch=3, n_samples=100, batch_size=10)
    pool.dispatch(0, 2)
    pool.dispatch(1, 2)
    pool.complete(1)
    sends = pool.reassign(1, [0])
    assert [(rank, m.offset, m.size) for rank, m in sends] == [(0, 30, 10)]
    pool.readmit(1)
    message = pool.dispatch(1, 3)
    assert message == StartEpoch(epoch=3, partition_offset=40, partition_size=30)
    assert pool.ledger.in_flight(1) == 3 and pool.ledger.completed(1) == 0
    assert 1 in pool.ledger.ranks


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["assign", "complete", "reassign", "readmit"]), st.integers(0, 3)
        ),
        max_size=40,
    )
)
def test_all_completed_agrees_with_every_live_ranks_count(ops: list[tuple[str, int]]) -> None:
    """The ledger keeps the live ranks' unfinished batches as one sum (asked after every
    report); through any mix of handing out, finishing, deaths and rejoins it says what
    asking every live rank would."""
    ledger = EpochLedger(0, batch_size=4)
    offset = 0
    for op, rank in ops:
        if op == "assign":
            with contextlib.suppress(CoordinatorError):  # a rank that left: refused
                ledger.assign(rank, Span(offset, 6))
            offset += 6
        elif op == "complete":
            ledger.complete(rank, 1)
        elif op == "reassign":
            ledger.reassign(rank, [r for r in range(4) if r != rank])
        elif op == "readmit":
            ledger.readmit(rank)
        expected = all(ledger.in_flight(r) == 0 for r in ledger.ranks)
        assert ledger.all_completed() == expected, (op, rank)
