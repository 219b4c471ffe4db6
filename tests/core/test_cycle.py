"""The averaging cycle: trigger per policy, acks, settled gate, stall ceiling, global step."""

from __future__ import annotations

import pytest

from flodl.core.common.policy import Policy
from flodl.core.coordinator.cycle import Cycle, RoundState
from flodl.core.coordinator.effects import Broadcast, Send
from flodl.core.coordinator.stall import default_reduce_stall_ceiling
from flodl.errors import ConfigError, CoordinatorError
from flodl.wire.messages import (
    Batch,
    SaveReason,
    SetGlobalStep,
    ShutdownWithSave,
    SyncAck,
    SyncNow,
    Throttle,
)


def batch(rank: int, step_count: int) -> Batch:
    return Batch(rank=rank, batch_ms=1.0, data_ms=0.0, step_count=step_count, batch_loss=0.5)


def ack(rank: int, round: int, step_count: int = 0) -> SyncAck:
    return SyncAck(rank=rank, round=round, step_count=step_count)


_step_counters: dict[int, int] = {}


def run_batches(cycle: Cycle, rank: int, n: int, now: float = 0.0) -> None:
    """Feed ``n`` batches of ``rank``, its step count going up by one each."""
    for _ in range(n):
        _step_counters[rank] = _step_counters.get(rank, 0) + 1
        cycle.on_batch(now, batch(rank, _step_counters[rank]))


@pytest.fixture(autouse=True)
def _fresh_counters() -> None:
    _step_counters.clear()


def settle_all(cycle: Cycle, now: float = 0.0) -> None:
    for rank in sorted(cycle.members):
        cycle.on_sync_ack(now, ack(rank, cycle.round))
    assert cycle.settled


# --- defaults and validation --------------------------------------------------------------


def test_default_stall_ceiling_is_ten_heartbeats_but_at_least_300_s() -> None:
    assert default_reduce_stall_ceiling(10.0) == 300.0
    assert default_reduce_stall_ceiling(30.0) == 300.0
    assert default_reduce_stall_ceiling(31.0) == 310.0
    assert default_reduce_stall_ceiling(45.0) == 450.0
    assert Cycle(2, Policy.SYNC, heartbeat_timeout=40.0).reduce_stall_ceiling == 400.0
    assert Cycle(2, Policy.SYNC, reduce_stall_ceiling=12.5).reduce_stall_ceiling == 12.5


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError):
        Cycle(0, Policy.SYNC)
    with pytest.raises(ConfigError):
        Cycle(2, Policy.SYNC, reduce_stall_ceiling=0.0)
    with pytest.raises(ConfigError):
        Cycle(2, Policy.SYNC, max_batch_diff=-1)


# --- the trigger ----------------------------------------------------------------------------


def test_sync_trigger_needs_one_step_on_every_member() -> None:
    cycle = Cycle(3, Policy.SYNC)
    counts = [100, 100, 100]  # ignored under SYNC
    assert not cycle.ready(counts)
    run_batches(cycle, 0, 1)
    run_batches(cycle, 1, 3)
    assert not cycle.ready(counts)
    run_batches(cycle, 2, 1)
    assert cycle.ready(counts)


def test_sync_has_no_quiesced_exemption() -> None:
    cycle = Cycle(2, Policy.SYNC)
    run_batches(cycle, 0, 2)
    assert not cycle.ready([1, 1], quiesced=frozenset({1}))


@pytest.mark.parametrize("policy", [Policy.CADENCE, Policy.ASYNC])
def test_count_trigger_needs_each_rank_at_its_count(policy: Policy) -> None:
    cycle = Cycle(3, policy)
    counts = [4, 2, 1]
    run_batches(cycle, 0, 4)
    run_batches(cycle, 1, 2)
    assert not cycle.ready(counts)  # rank 2 at 0 of 1
    run_batches(cycle, 2, 1)
    assert cycle.ready(counts)


@pytest.mark.parametrize("policy", [Policy.CADENCE, Policy.ASYNC])
def test_count_trigger_one_short_is_not_ready(policy: Policy) -> None:
    cycle = Cycle(2, policy)
    run_batches(cycle, 0, 3)
    run_batches(cycle, 1, 7)
    assert not cycle.ready([4, 7])
    run_batches(cycle, 0, 1)
    assert cycle.ready([4, 7])


def test_quiesced_rank_is_exempt_from_its_count() -> None:
    cycle = Cycle(3, Policy.CADENCE)
    counts = [4, 2, 3]
    run_batches(cycle, 0, 4)
    run_batches(cycle, 1, 2)
    run_batches(cycle, 2, 1)
    assert not cycle.ready(counts)
    assert cycle.ready(counts, quiesced=frozenset({2}))
    assert not cycle.ready(counts, quiesced=frozenset({1}))


def test_at_least_one_rank_must_have_moved() -> None:
    cycle = Cycle(2, Policy.CADENCE)
    assert not cycle.ready([0, 0])
    assert not cycle.ready([5, 5], quiesced=frozenset({0, 1}))
    run_batches(cycle, 1, 1)
    assert cycle.ready([5, 5], quiesced=frozenset({0, 1}))


def test_trigger_needs_a_non_empty_group() -> None:
    cycle = Cycle(1, Policy.CADENCE)
    run_batches(cycle, 0, 2)
    cycle.drop_rank(0.0, 0)
    assert not cycle.ready([1])


def test_trigger_needs_every_member_acked_for_the_previous_round() -> None:
    cycle = Cycle(2, Policy.CADENCE)
    counts = [1, 5]
    run_batches(cycle, 0, 1)
    assert cycle.ready(counts, quiesced=frozenset({1}))
    cycle.start_round(10.0, generation=0)
    cycle.on_sync_ack(10.5, ack(0, 1, step_count=2))
    run_batches(cycle, 0, 1, now=11.0)
    assert cycle.state is RoundState.IN_FLIGHT
    assert not cycle.ready(counts, quiesced=frozenset({1}))  # rank 1 has not acked round 1
    assert cycle.on_sync_ack(12.0, ack(1, 1, step_count=1))
    assert cycle.ready(counts, quiesced=frozenset({1}))
    assert cycle.last_sync_duration == pytest.approx(2.0)


def test_counts_must_cover_the_world() -> None:
    cycle = Cycle(3, Policy.CADENCE)
    with pytest.raises(CoordinatorError):
        cycle.ready([1, 1])


# --- acks ---------------------------------------------------------------------------------


def test_a_batch_never_acks_a_round_only_its_sync_ack_does() -> None:
    cycle = Cycle(2, Policy.SYNC)
    cycle.on_batch(0.0, batch(0, 7))
    cycle.on_batch(0.0, batch(1, 3))
    cycle.start_round(1.0, generation=0)
    # A rank may finish the batch it was in before it averages: its step count passes the
    # snapshot, but its collective is still ahead of it, so this is no ack.
    assert not cycle.on_batch(1.1, batch(0, 8))
    assert not cycle.on_batch(1.2, batch(1, 4))
    assert cycle.acked == frozenset() and not cycle.settled
    assert not cycle.on_sync_ack(1.3, ack(0, 1, step_count=9))
    assert cycle.acked == frozenset({0})
    assert cycle.on_sync_ack(1.5, ack(1, 1, step_count=5))
    assert cycle.settled
    assert cycle.last_sync_duration == pytest.approx(0.5)
    # The batches after SyncNow belong to the next window.
    assert cycle.steps == (1, 1)


def test_sync_ack_with_a_higher_step_count_acks_too() -> None:
    cycle = Cycle(1, Policy.SYNC)
    cycle.on_batch(0.0, batch(0, 5))
    cycle.start_round(0.0, generation=0)
    assert cycle.on_sync_ack(0.1, ack(0, 1, step_count=6))


def test_stale_or_future_round_ack_is_ignored() -> None:
    cycle = Cycle(2, Policy.SYNC)
    run_batches(cycle, 0, 1)
    run_batches(cycle, 1, 1)
    cycle.start_round(0.0, generation=0)
    settle_all(cycle)
    run_batches(cycle, 0, 1)
    run_batches(cycle, 1, 1)
    cycle.start_round(1.0, generation=0)
    assert cycle.round == 2
    # A late ack of round 1 and an early one of round 3 do not ack round 2.
    assert not cycle.on_sync_ack(1.1, ack(0, 1, step_count=99))
    assert not cycle.on_sync_ack(1.1, ack(0, 3, step_count=99))
    assert cycle.acked == frozenset()
    assert not cycle.on_sync_ack(1.2, ack(0, 2, step_count=0))
    assert cycle.acked == frozenset({0})
    assert cycle.on_sync_ack(1.3, ack(1, 2, step_count=3))
    assert cycle.settled


def test_reports_from_non_members_are_not_counted() -> None:
    cycle = Cycle(3, Policy.SYNC, members=[0, 1])
    cycle.on_batch(0.0, batch(2, 1))
    assert cycle.steps == (0, 0, 0)
    run_batches(cycle, 0, 1)
    run_batches(cycle, 1, 1)
    assert cycle.ready([1, 1, 1])  # rank 2 is not in the group


# --- starting rounds, global step ---------------------------------------------------------


def test_start_round_effects_and_global_step_accumulate() -> None:
    cycle = Cycle(2, Policy.CADENCE, global_step=100)
    run_batches(cycle, 0, 3)
    run_batches(cycle, 1, 5)
    started = cycle.start_round(4.0, generation=2)
    assert started.round == 1
    assert started.steps == (3, 5)
    assert started.global_step == 108
    assert not started.redo
    assert started.effects == (
        Broadcast(SyncNow(round=1, generation=2), (0, 1)),
        Broadcast(SetGlobalStep(global_step=108), (0, 1)),
    )
    assert cycle.steps == (0, 0)
    assert not cycle.may_shutdown()
    settle_all(cycle, 5.0)
    run_batches(cycle, 0, 2)
    run_batches(cycle, 1, 2)
    second = cycle.start_round(6.0, generation=2)
    assert (second.round, second.global_step) == (2, 112)
    assert cycle.global_step == 112


def test_start_round_while_unsettled_is_refused() -> None:
    cycle = Cycle(2, Policy.SYNC)
    run_batches(cycle, 0, 1)
    cycle.start_round(0.0, generation=0)
    with pytest.raises(CoordinatorError):
        cycle.start_round(1.0, generation=0)


def test_dropped_rank_steps_do_not_count_in_the_global_step() -> None:
    cycle = Cycle(3, Policy.CADENCE)
    run_batches(cycle, 0, 2)
    run_batches(cycle, 1, 4)
    run_batches(cycle, 2, 8)
    cycle.drop_rank(1.0, 2)
    started = cycle.start_round(2.0, generation=1)
    assert started.steps == (2, 4, 0)
    assert started.global_step == 6
    assert started.effects[0] == Broadcast(SyncNow(round=1, generation=1), (0, 1))


# --- settled gate -------------------------------------------------------------------------


def test_may_shutdown_only_when_settled() -> None:
    cycle = Cycle(2, Policy.SYNC)
    assert cycle.may_shutdown()
    run_batches(cycle, 0, 1)
    cycle.start_round(0.0, generation=0)
    assert not cycle.may_shutdown()
    cycle.on_sync_ack(0.5, ack(0, 1))
    assert not cycle.may_shutdown()
    cycle.on_sync_ack(0.6, ack(1, 1))
    assert cycle.may_shutdown()


def test_dropping_the_last_unacked_rank_settles_the_round() -> None:
    cycle = Cycle(3, Policy.SYNC)
    run_batches(cycle, 0, 1)
    cycle.start_round(10.0, generation=0)
    cycle.on_sync_ack(11.0, ack(0, 1))
    cycle.on_sync_ack(11.0, ack(1, 1))
    assert not cycle.may_shutdown()
    assert cycle.drop_rank(13.0, 2)
    assert cycle.may_shutdown()
    assert cycle.last_sync_duration == pytest.approx(3.0)
    assert not cycle.drop_rank(14.0, 2)  # idempotent


# --- reduce-stall ceiling -----------------------------------------------------------------


def join_all(cycle: Cycle, generation: int, now: float = 0.0) -> None:
    """Every member reports its join of ``generation`` ended."""
    for rank in sorted(cycle.members):
        cycle.on_join_result(now, rank, generation)


def test_stall_fires_once_at_the_ceiling_not_before() -> None:
    cycle = Cycle(2, Policy.SYNC, heartbeat_timeout=10.0)  # ceiling 300 s
    join_all(cycle, 0)
    run_batches(cycle, 0, 1)
    cycle.start_round(100.0, generation=0)
    cycle.on_sync_ack(101.0, ack(0, 1))
    assert cycle.next_deadline() == 400.0
    assert cycle.check_stall(399.999) == []
    assert cycle.check_stall(400.0) == [
        Broadcast(ShutdownWithSave(reason=SaveReason.REDUCE_STALL), None)
    ]
    assert cycle.stalled
    assert cycle.check_stall(400.0) == []
    assert cycle.check_stall(10_000.0) == []
    assert cycle.next_deadline() is None
    assert not cycle.may_shutdown()  # still unacked: a graceful Shutdown stays forbidden


def test_stall_never_fires_when_everyone_acked() -> None:
    cycle = Cycle(2, Policy.SYNC, reduce_stall_ceiling=5.0)
    join_all(cycle, 0)
    run_batches(cycle, 0, 1)
    cycle.start_round(0.0, generation=0)
    settle_all(cycle, 4.0)
    assert cycle.next_deadline() is None
    assert cycle.check_stall(5.0) == []
    assert cycle.check_stall(1e9) == []
    assert not cycle.stalled


def test_stall_clock_restarts_with_each_round() -> None:
    cycle = Cycle(1, Policy.SYNC, reduce_stall_ceiling=5.0)
    join_all(cycle, 0)
    run_batches(cycle, 0, 1)
    cycle.start_round(0.0, generation=0)
    settle_all(cycle, 1.0)
    run_batches(cycle, 0, 1)
    cycle.start_round(20.0, generation=0)
    assert cycle.check_stall(24.0) == []
    assert len(cycle.check_stall(25.0)) == 1


def test_stall_clock_starts_once_every_member_joined_the_rounds_generation() -> None:
    # Forming a group (gloo's rendezvous, NCCL's init) is no stalled collective: the first
    # round goes out at once, but its ceiling counts from the last member's join.
    cycle = Cycle(2, Policy.SYNC, reduce_stall_ceiling=5.0)
    run_batches(cycle, 0, 1)
    cycle.start_round(0.0, generation=0)
    assert cycle.next_deadline() is None
    assert cycle.check_stall(1e3) == []
    cycle.on_join_result(1e3, 0, 0)
    assert cycle.next_deadline() is None  # rank 1 is still joining
    cycle.on_join_result(2e3, 1, 0)  # joined, or failed to: its join holds nothing back now
    assert cycle.next_deadline() == 2005.0
    assert cycle.check_stall(2004.999) == []
    assert len(cycle.check_stall(2005.0)) == 1
    cycle.on_join_result(3e3, 1, 1)  # a later join does not re-arm a fired ceiling
    assert cycle.next_deadline() is None


def test_a_redone_round_waits_for_the_joins_of_its_new_generation() -> None:
    cycle = Cycle(3, Policy.SYNC, reduce_stall_ceiling=5.0)
    join_all(cycle, 0)
    run_batches(cycle, 0, 1)
    cycle.start_round(0.0, generation=0)
    assert cycle.next_deadline() == 5.0
    cycle.drop_rank(1.0, 2)
    assert cycle.abandon_round()
    cycle.redo_round(2.0, generation=1)
    assert cycle.next_deadline() is None  # generation 0's joins do not count for 1
    cycle.on_join_result(3.0, 0, 1)
    cycle.on_join_result(4.0, 1, 0)  # a late result of an older generation changes nothing
    assert cycle.next_deadline() is None
    cycle.on_join_result(6.0, 1, 1)
    assert cycle.next_deadline() == 11.0


def test_a_member_dropped_while_joining_no_longer_holds_the_stall_clock() -> None:
    cycle = Cycle(3, Policy.SYNC, reduce_stall_ceiling=5.0)
    run_batches(cycle, 0, 1)
    cycle.on_join_result(0.0, 0, 0)
    cycle.on_join_result(0.0, 1, 0)
    cycle.start_round(1.0, generation=0)
    assert cycle.next_deadline() is None
    cycle.drop_rank(7.0, 2)  # died before it joined: the survivors' round may stall now
    assert cycle.next_deadline() == 12.0


# --- throttle -------------------------------------------------------------------------------


def test_throttle_once_per_round_for_ranks_too_far_ahead() -> None:
    cycle = Cycle(3, Policy.SYNC, max_batch_diff=2)
    run_batches(cycle, 0, 5)
    run_batches(cycle, 1, 2)
    run_batches(cycle, 2, 4)
    # min 2, limit 4: rank 0 (5) is ahead; rank 2 (4) is not (strictly greater needed).
    assert cycle.throttle() == [Send(0, Throttle())]
    assert cycle.throttle() == []
    run_batches(cycle, 0, 3)
    run_batches(cycle, 2, 1)
    assert cycle.throttle() == [Send(2, Throttle())]
    assert cycle.throttled == frozenset({0, 2})
    cycle.start_round(1.0, generation=0)
    assert cycle.throttled == frozenset()
    settle_all(cycle)
    run_batches(cycle, 0, 3)
    assert cycle.throttle() == [Send(0, Throttle())]


def test_throttle_is_off_without_max_batch_diff() -> None:
    cycle = Cycle(2, Policy.SYNC)
    run_batches(cycle, 0, 50)
    assert cycle.throttle() == []


def test_throttle_min_ignores_dropped_ranks() -> None:
    cycle = Cycle(3, Policy.SYNC, max_batch_diff=0)
    run_batches(cycle, 0, 1)
    run_batches(cycle, 1, 1)
    cycle.drop_rank(0.0, 2)  # would pin the minimum at 0 forever
    assert cycle.throttle() == []


def test_throttled_rank_does_not_block_the_cadence_trigger() -> None:
    cycle = Cycle(2, Policy.CADENCE, max_batch_diff=2)
    counts = [10, 2]
    run_batches(cycle, 0, 3)
    assert cycle.throttle() == [Send(0, Throttle())]  # 3 > 0 + 2
    assert not cycle.ready(counts)
    run_batches(cycle, 1, 2)
    assert cycle.ready(counts)  # rank 0 is parked until the round


# --- abandoned rounds, membership ---------------------------------------------------------


def test_abandoned_round_is_redone_on_the_new_group() -> None:
    cycle = Cycle(3, Policy.CADENCE)
    run_batches(cycle, 0, 2)
    run_batches(cycle, 1, 2)
    run_batches(cycle, 2, 2)
    first = cycle.start_round(0.0, generation=0)
    assert first.global_step == 6
    cycle.on_sync_ack(0.5, ack(0, 1))
    cycle.drop_rank(1.0, 2)  # rank 2 died inside the collective
    assert not cycle.settled
    assert cycle.abandon_round()
    assert cycle.state is RoundState.REDO_PENDING
    assert not cycle.may_shutdown()
    assert cycle.next_deadline() is None
    assert cycle.check_stall(1e6) == []
    assert not cycle.ready([0, 0, 0], quiesced=frozenset({0, 1}))
    # A late ack of the abandoned round does not count.
    assert not cycle.on_sync_ack(2.0, ack(1, 1))
    with pytest.raises(CoordinatorError):
        cycle.start_round(2.0, generation=1)
    redo = cycle.redo_round(3.0, generation=1)
    assert redo.redo
    assert (redo.round, redo.generation, redo.global_step) == (2, 1, 6)
    assert redo.steps == (0, 0, 0)
    assert redo.effects == (Broadcast(SyncNow(round=2, generation=1), (0, 1)),)
    assert not cycle.on_sync_ack(3.5, ack(0, 1))  # round 1 is stale now
    cycle.on_sync_ack(4.0, ack(0, 2))
    assert cycle.on_sync_ack(4.0, ack(1, 2))
    assert cycle.settled
    assert cycle.global_step == 6


def test_abandon_without_a_round_in_flight_is_a_no_op() -> None:
    cycle = Cycle(2, Policy.SYNC)
    assert not cycle.abandon_round()
    with pytest.raises(CoordinatorError):
        cycle.redo_round(0.0, generation=1)


def test_added_rank_counts_as_acked_and_joins_the_next_round() -> None:
    cycle = Cycle(3, Policy.SYNC, members=[0, 1])
    run_batches(cycle, 0, 1)
    run_batches(cycle, 1, 1)
    cycle.start_round(0.0, generation=0)
    cycle.add_rank(2)
    cycle.on_sync_ack(1.0, ack(0, 1))
    assert cycle.on_sync_ack(1.0, ack(1, 1))  # rank 2 was not in that collective
    run_batches(cycle, 0, 1)
    run_batches(cycle, 1, 1)
    assert not cycle.ready([1, 1, 1])  # rank 2 now needs its step
    run_batches(cycle, 2, 1)
    started = cycle.start_round(2.0, generation=1)
    assert started.effects[0] == Broadcast(SyncNow(round=2, generation=1), (0, 1, 2))


def test_out_of_range_rank_is_refused() -> None:
    cycle = Cycle(2, Policy.SYNC)
    with pytest.raises(CoordinatorError):
        cycle.on_batch(0.0, batch(2, 1))
    with pytest.raises(CoordinatorError):
        cycle.drop_rank(0.0, 5)
