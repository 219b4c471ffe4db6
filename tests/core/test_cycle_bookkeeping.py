"""Cycle's O(1) paths (the remembered blocker of ``ready``, the acked count) give the same
answers as a full scan, whatever changes between calls."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.core.common.policy import Policy
from flodl.core.coordinator.cycle import Cycle
from flodl.wire.messages import Batch, SyncAck


def batch(rank: int, step_count: int) -> Batch:
    return Batch(rank=rank, batch_ms=1.0, data_ms=0.0, step_count=step_count, batch_loss=0.5)


def scan_ready(cycle: Cycle, counts: list[int], quiesced: frozenset[int]) -> bool:
    """``ready`` by its definition, from public state only (the reference)."""
    if not cycle.settled or not cycle.members:
        return False
    steps = cycle.steps
    for rank in cycle.members:
        if cycle.policy is Policy.SYNC:
            if steps[rank] < 1:
                return False
        elif steps[rank] < counts[rank] and rank not in quiesced and rank not in cycle.throttled:
            return False
    return any(steps[rank] > 0 for rank in cycle.members)


def test_the_remembered_blocker_moves_on_as_ranks_reach_their_counts() -> None:
    cycle = Cycle(4, Policy.CADENCE)
    counts = [2, 2, 2, 2]
    step = [0] * 4
    for rank in (1, 2, 3, 0, 1, 2, 3):  # rank 0 ends one short
        step[rank] += 1
        cycle.on_batch(0.0, batch(rank, step[rank]))
        assert not cycle.ready(counts)
    step[0] += 1
    cycle.on_batch(0.0, batch(0, step[0]))
    assert cycle.ready(counts)


def test_counts_that_rise_between_calls_make_a_passed_rank_a_blocker_again() -> None:
    cycle = Cycle(3, Policy.CADENCE)
    for rank in range(3):
        cycle.on_batch(0.0, batch(rank, 1))
    assert not cycle.ready([1, 1, 2])  # rank 2 blocks and is remembered
    assert cycle.ready([1, 1, 1])
    assert not cycle.ready([2, 1, 1])  # rank 2 is fine now, rank 0 is not


def test_a_remembered_blocker_that_left_the_group_is_skipped() -> None:
    cycle = Cycle(3, Policy.CADENCE)
    cycle.on_batch(0.0, batch(0, 1))
    cycle.on_batch(0.0, batch(1, 1))
    assert not cycle.ready([1, 1, 1])  # rank 2 blocks
    cycle.drop_rank(0.0, 2)
    assert cycle.ready([1, 1, 1])


def test_the_round_settles_on_the_last_members_ack_after_drops_and_adds() -> None:
    cycle = Cycle(4, Policy.CADENCE, members=[0, 1, 2])
    for rank in (0, 1, 2):
        cycle.on_batch(0.0, batch(rank, 1))
    cycle.start_round(1.0, generation=0)
    assert not cycle.on_sync_ack(1.1, SyncAck(rank=0, round=1, step_count=2))
    assert not cycle.on_sync_ack(1.2, SyncAck(rank=0, round=1, step_count=2))  # twice: once
    cycle.add_rank(3)  # counts as acked for the round it was not part of
    assert not cycle.on_sync_ack(1.3, SyncAck(rank=1, round=1, step_count=2))
    assert cycle.drop_rank(1.5, 2)  # the last one missing leaves: settled on the survivors
    assert cycle.settled
    assert cycle.last_sync_duration == 0.5


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(list(Policy)))
def test_ready_matches_a_full_scan_under_random_histories(seed: int, policy: Policy) -> None:
    rng = random.Random(seed)
    world = 6
    cycle = Cycle(world, policy, max_batch_diff=rng.choice([None, 2]))
    step_count = [0] * world
    for _ in range(120):
        action = rng.random()
        rank = rng.randrange(world)
        if action < 0.6:
            step_count[rank] += 1
            cycle.on_batch(0.0, batch(rank, step_count[rank]))
            cycle.throttle()
        elif action < 0.7 and not cycle.settled:
            step_count[rank] += 1
            cycle.on_sync_ack(0.0, SyncAck(rank=rank, round=cycle.round, step_count=0))
        elif action < 0.75:
            cycle.drop_rank(0.0, rank)
        elif action < 0.8:
            cycle.add_rank(rank)
        counts = [rng.randint(0, 4) for _ in range(world)]
        quiesced = frozenset(r for r in range(world) if rng.random() < 0.15)
        expected = scan_ready(cycle, counts, quiesced)
        assert cycle.ready(counts, quiesced) == expected
        if expected and rng.random() < 0.7:
            cycle.start_round(0.0, generation=0)
        members = cycle.members
        if not cycle.settled:
            assert cycle.settled == (members <= cycle.acked)
