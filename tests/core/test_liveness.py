"""Liveness: silence deaths at the deadline, refresh, disconnects, Exiting, reasons to stop."""

from __future__ import annotations

import pytest

from flodl.core.coordinator.liveness import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    Liveness,
    LossCause,
    MaxFailure,
    RankLost,
    unrecoverable_reason,
)
from flodl.core.coordinator.timeline import EventKind, TimelineEvent
from flodl.errors import ConfigError, CoordinatorError
from flodl.wire.messages import SaveReason


def test_default_timeout_is_ten_seconds_and_thirty_is_allowed() -> None:
    assert DEFAULT_HEARTBEAT_TIMEOUT == 10.0
    assert Liveness(2).heartbeat_timeout == 10.0
    assert Liveness(2, heartbeat_timeout=30.0).heartbeat_timeout == 30.0
    with pytest.raises(ConfigError):
        Liveness(2, heartbeat_timeout=0.0)


def test_silent_rank_dies_exactly_at_the_timeout() -> None:
    live = Liveness(2, initial=[0, 1], now=100.0)
    assert live.check(109.999) == []
    assert live.check(110.0) == [
        RankLost(0, LossCause.SILENT, 110.0),
        RankLost(1, LossCause.SILENT, 110.0),
    ]
    assert live.alive == frozenset()
    assert live.failures == 2


def test_any_frame_refreshes_last_seen() -> None:
    live = Liveness(2, initial=[0, 1], now=0.0)
    assert live.on_frame(0, 6.0)
    assert live.check(10.0) == [RankLost(1, LossCause.SILENT, 10.0)]
    assert live.alive == frozenset({0})
    assert live.check(15.999) == []
    assert live.check(16.0) == [RankLost(0, LossCause.SILENT, 16.0)]


def test_last_seen_never_moves_backwards() -> None:
    live = Liveness(1, initial=[0], now=5.0)
    live.on_frame(0, 3.0)
    assert live.last_seen(0) == 5.0


def test_next_deadline_is_the_earliest_possible_silence_death() -> None:
    live = Liveness(3, heartbeat_timeout=30.0)
    assert live.next_deadline() is None
    live.admit(0, 1.0)
    live.admit(1, 2.0)
    live.admit(2, 3.0)
    assert live.next_deadline() == 31.0
    live.on_frame(0, 20.0)
    assert live.next_deadline() == 32.0
    # Sleeping until the deadline and checking then declares exactly the due rank.
    assert live.check(32.0) == [RankLost(1, LossCause.SILENT, 32.0)]
    assert live.next_deadline() == 33.0


def test_disconnect_is_death_at_once_and_counted_once() -> None:
    live = Liveness(3, initial=[0, 1, 2], now=0.0)
    assert live.on_disconnect(1, 0.5) == RankLost(1, LossCause.DISCONNECTED, 0.5)
    assert live.alive == frozenset({0, 2})
    assert live.on_disconnect(1, 0.6) is None
    assert not live.on_frame(1, 0.7)
    assert [loss.rank for loss in live.check(10.0)] == [0, 2]  # rank 1 not again
    assert live.failures == 3
    assert [loss.rank for loss in live.losses] == [1, 0, 2]


def test_exiting_then_close_is_an_exit_not_a_failure() -> None:
    live = Liveness(2, initial=[0, 1], now=0.0)
    assert live.on_exiting(1, 2.0)
    assert live.is_exiting(1)
    assert live.is_alive(1)  # alive until the connection closes
    lost = live.on_disconnect(1, 3.0)
    assert lost == RankLost(1, LossCause.EXITED, 3.0)
    assert lost is not None and not lost.is_failure
    assert live.failures == 0
    assert live.alive == frozenset({0})
    assert live.on_disconnect(1, 3.5) is None  # no double counting


def test_exiting_then_silence_is_an_exit() -> None:
    live = Liveness(1, initial=[0], now=0.0)
    live.on_exiting(0, 1.0)  # Exiting is also a frame
    assert live.check(10.999) == []
    assert live.check(11.0) == [RankLost(0, LossCause.EXITED, 11.0)]
    assert live.failures == 0


def test_exiting_from_a_lost_rank_is_ignored() -> None:
    live = Liveness(1, initial=[0], now=0.0)
    live.on_disconnect(0, 1.0)
    assert not live.on_exiting(0, 2.0)


def test_rejoin_revives_a_rank_and_keeps_the_failure_history() -> None:
    live = Liveness(2, initial=[0, 1], now=0.0)
    live.on_disconnect(1, 1.0)
    live.admit(1, 5.0)
    assert live.alive == frozenset({0, 1})
    assert live.failures == 1
    assert live.check(14.999) == [RankLost(0, LossCause.SILENT, 14.999)]
    assert live.check(15.0) == [RankLost(1, LossCause.SILENT, 15.0)]
    assert live.failures == 3


def test_admit_refuses_duplicates_and_out_of_range() -> None:
    live = Liveness(2, initial=[0], now=0.0)
    with pytest.raises(CoordinatorError):
        live.admit(0, 1.0)
    with pytest.raises(CoordinatorError):
        live.admit(2, 1.0)


# --- unrecoverable reasons ----------------------------------------------------------------


def test_max_failure_limits() -> None:
    assert MaxFailure.absolute(2).limit(100) == 2
    assert MaxFailure.percent(0.25).limit(10) == 3  # ceil(2.5)
    assert MaxFailure.percent(0.5).limit(4) == 2
    assert MaxFailure.percent(1.0).limit(3) == 3
    assert MaxFailure.percent(0.01).limit(3) == 1
    with pytest.raises(ConfigError):
        MaxFailure.absolute(0)
    with pytest.raises(ConfigError):
        MaxFailure.percent(0.0)
    with pytest.raises(ConfigError):
        MaxFailure.percent(1.5)
    with pytest.raises(ConfigError):
        MaxFailure()


def test_max_failure_is_reached_at_the_limit() -> None:
    rule = MaxFailure.percent(0.5)  # limit 2 of 4

    def reason(alive: int, failures: int) -> SaveReason | None:
        return unrecoverable_reason(
            world_size=4, alive=alive, failures=failures, max_failure=rule, collective=True
        )

    assert reason(alive=3, failures=1) is None
    assert reason(alive=2, failures=2) is SaveReason.MAX_FAILURE


def test_single_survivor_for_a_collective_backend() -> None:
    assert (
        unrecoverable_reason(world_size=4, alive=1, failures=3, max_failure=None, collective=True)
        is SaveReason.SINGLE_SURVIVOR
    )
    assert (
        unrecoverable_reason(world_size=4, alive=2, failures=2, max_failure=None, collective=True)
        is None
    )
    assert (
        unrecoverable_reason(world_size=4, alive=1, failures=3, max_failure=None, collective=False)
        is None
    )


def test_all_ranks_lost_without_a_collective() -> None:
    assert (
        unrecoverable_reason(world_size=3, alive=0, failures=3, max_failure=None, collective=False)
        is SaveReason.ALL_RANKS_LOST
    )


def test_reasons_are_checked_in_spec_order() -> None:
    # Max failure wins over single survivor and all-lost.
    assert (
        unrecoverable_reason(
            world_size=4,
            alive=0,
            failures=4,
            max_failure=MaxFailure.absolute(1),
            collective=True,
        )
        is SaveReason.MAX_FAILURE
    )
    # With a collective backend, nobody alive reads as single survivor (checked before).
    assert (
        unrecoverable_reason(world_size=4, alive=0, failures=4, max_failure=None, collective=True)
        is SaveReason.SINGLE_SURVIVOR
    )
    # Below the failure limit, the next rule decides.
    assert (
        unrecoverable_reason(
            world_size=4,
            alive=1,
            failures=3,
            max_failure=MaxFailure.absolute(4),
            collective=True,
        )
        is SaveReason.SINGLE_SURVIVOR
    )


def test_reasons_from_a_live_ledger() -> None:
    live = Liveness(3, initial=[0, 1, 2], now=0.0)
    live.on_exiting(2, 1.0)
    live.on_disconnect(2, 1.0)
    live.on_disconnect(1, 2.0)
    assert live.failures == 1  # the exit does not count
    assert (
        unrecoverable_reason(
            world_size=3,
            alive=len(live.alive),
            failures=live.failures,
            max_failure=MaxFailure.absolute(2),
            collective=False,
        )
        is None
    )


def test_only_a_death_for_silence_names_a_rank_for_its_supervisor_to_kill() -> None:
    def dead(cause: LossCause) -> TimelineEvent:
        return TimelineEvent(1.0, EventKind.RANK_DEAD, {"rank": 3, "cause": cause.value})

    assert dead(LossCause.SILENT).silenced_rank == 3
    assert [dead(c).silenced_rank for c in LossCause if c is not LossCause.SILENT] == [None] * (
        len(LossCause) - 1
    )
    joined = TimelineEvent(1.0, EventKind.RANK_JOINED, {"rank": 3, "cause": "silent"})
    assert joined.silenced_rank is None
