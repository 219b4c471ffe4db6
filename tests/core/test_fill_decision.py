"""IdleFill: the extra-batch decision against hand-computed remaining times."""

from __future__ import annotations

from flodl.core.coordinator.fill import IdleFill


def fill_for(plan: list[int], ms: dict[int, float], start: float = 0.0) -> IdleFill:
    fill = IdleFill()
    fill.begin_window(plan, ms, start)
    return fill


def ask(
    fill: IdleFill,
    rank: int,
    now: float,
    steps: list[int],
    reports: list[float | None],
    dead: frozenset[int] = frozenset(),
) -> int:
    for r, at in enumerate(reports):
        if at is not None:
            fill.on_batch(r, at, 0.0)  # the batch time only matters when uncalibrated
    return fill.extra_batches(
        rank, now, steps_of=lambda r: steps[r], working=lambda r: r not in dead
    )


def test_uncalibrated_windows_use_the_batch_times_reported_in_the_window() -> None:
    fill = fill_for([10, 10], {0: 10.0})  # rank 1 has no timing yet: uncalibrated
    assert not fill.calibrated
    for i in range(1, 11):
        fill.on_batch(0, i * 0.010, 10.0)
    # Rank 0 is out of work, with no extra batch yet (it ran its 10).
    # Rank 1 has not finished a batch in 100 ms: it needs at least 9 x 100 ms more, so
    # rank 0 gets more batches, at most its own count again (10).
    assert fill.extra_batches(0, 0.1, steps_of=[10, 0].__getitem__, working=lambda r: True) == 10
    # Rank 1 reports batches of 40 ms; at 0.16 s it has 6 left, its last done just now:
    # 6 x 40 = 240 ms remain = 24 of rank 0's batches, capped at 10.
    fill.on_batch(1, 0.12, 40.0)
    fill.on_batch(1, 0.16, 40.0)
    assert fill.extra_batches(0, 0.16, steps_of=[10, 4].__getitem__, working=lambda r: True) == 10
    # With 1 left, begun 25 ms ago: 15 ms remain -> 2 (1.5 rounds up).
    fill.on_batch(1, 0.400, 40.0)
    assert fill.extra_batches(0, 0.425, steps_of=[10, 9].__getitem__, working=lambda r: True) == 2
    # The slowest is done: nothing.
    assert fill.extra_batches(0, 0.45, steps_of=[10, 10].__getitem__, working=lambda r: True) == 0


def test_a_stalled_critical_rank_gets_no_one_filled_in_its_shadow() -> None:
    """Overdue by up to 4 of its batches: "half a batch away" as before; beyond: stalled
    (stopped, about to be declared dead), so the idle rank waits instead of training on."""
    fill = fill_for([10, 4], {0: 10.0, 1: 30.0})
    # 1 batch of 30 ms begun at 0.0: expected at 30 ms.
    assert ask(fill, 0, 0.140, [10, 3], [0.140, 0.0]) == 2  # overdue 110 ms < 120: 15 ms
    assert ask(fill, 0, 0.160, [10, 3], [0.160, 0.0]) == 0  # overdue 130 ms: stalled
    # It reports again: no longer stalled.
    assert ask(fill, 0, 0.170, [10, 3], [0.170, 0.160]) == 2  # 20 ms left


def test_extra_batches_add_up_to_at_most_four_times_the_windows_largest_count() -> None:
    """Backstop: in an uncalibrated window a rank that never reports looks ever farther from
    done; the idle rank still gets at most 4 x 12 extra batches in all."""
    fill = fill_for([10, 12], {})
    given = 0
    for query in range(40):
        now = 0.2 + query * 0.05
        fill.on_batch(0, now, 10.0)
        batches = fill.extra_batches(
            0, now, steps_of=[10 + given, 0].__getitem__, working=lambda r: True
        )
        assert batches <= 10  # and never more than its own count at once
        given += batches
    assert given == 48
    fill.begin_window([10, 12], {}, 3.0)  # the next window starts afresh
    fill.on_batch(0, 3.1, 10.0)
    assert fill.extra_batches(0, 3.1, steps_of=[10, 0].__getitem__, working=lambda r: True) > 0


def test_a_rank_with_no_report_of_its_own_gets_nothing_in_an_uncalibrated_window() -> None:
    fill = fill_for([10, 10], {})
    fill.on_batch(1, 0.05, 5.0)
    assert fill.extra_batches(0, 0.1, steps_of=[10, 10].__getitem__, working=lambda r: True) == 0


def test_gives_the_batches_that_fit_in_the_critical_ranks_remaining_time() -> None:
    # Spans: rank 0 10 x 10 ms = 100 ms, rank 1 4 x 30 ms = 120 ms: rank 1 is critical.
    fill = fill_for([10, 4], {0: 10.0, 1: 30.0}, start=5.0)
    # Rank 1 has 1 batch left, begun 6 ms ago: 24 ms remain = 2.4 of rank 0's batches -> 2.
    assert ask(fill, 0, 5.100, [10, 3], [5.100, 5.094]) == 2
    # 10 ms ago: 20 ms remain -> 2 (2.0); 14 ms ago: 16 ms -> 2 (1.6); 22 ms ago: 8 ms -> 1.
    assert ask(fill, 0, 5.100, [10, 3], [5.100, 5.090]) == 2
    assert ask(fill, 0, 5.100, [10, 3], [5.100, 5.086]) == 2
    assert ask(fill, 0, 5.100, [10, 3], [5.100, 5.078]) == 1
    # 28 ms ago: 2 ms remain, under half of rank 0's batch -> none.
    assert ask(fill, 0, 5.100, [10, 3], [5.100, 5.072]) == 0


def test_a_critical_rank_without_reports_counts_from_the_window_start() -> None:
    fill = fill_for([10, 4], {0: 10.0, 1: 30.0}, start=5.0)
    # 4 batches left from 5.0: 120 ms - 100 ms = 20 ms remain: 2 of rank 0's batches.
    assert ask(fill, 0, 5.100, [10, 0], [5.100, None]) == 2


def test_a_long_overdue_critical_rank_counts_as_half_a_batch_away() -> None:
    fill = fill_for([10, 4], {0: 10.0, 1: 30.0})
    # 1 batch of 30 ms begun 100 ms ago: overdue by 70 ms, so assume 15 ms remain -> 2.
    assert ask(fill, 0, 0.100, [10, 3], [0.100, 0.0]) == 2
    # Overdue by only 10 ms (< half its batch): it is about to finish, no fill.
    assert ask(fill, 0, 0.100, [10, 3], [0.100, 0.060]) == 0


def test_done_or_dead_critical_ranks_hand_over_to_the_next_longest_plan() -> None:
    # Spans 100, 120, 100 ms: order 1, then 0 and 2 (ties keep rank order).
    fill = fill_for([10, 4, 10], {0: 10.0, 1: 30.0, 2: 10.0})
    # Rank 1 is done, rank 0 is idle: rank 2 decides (1 batch left, begun 2 ms ago -> 8 ms).
    assert ask(fill, 0, 0.2, [10, 4, 9], [0.2, 0.15, 0.198]) == 1
    assert ask(fill, 0, 0.2, [10, 4, 9], [0.2, 0.15, 0.192]) == 0
    # Rank 1 dead with work left: skipped the same way.
    fill = fill_for([10, 4, 10], {0: 10.0, 1: 30.0, 2: 10.0})
    assert ask(fill, 0, 0.2, [10, 1, 9], [0.2, 0.05, 0.198], dead=frozenset({1})) == 1


def test_no_fill_once_every_planned_rank_is_done() -> None:
    fill = fill_for([10, 4], {0: 10.0, 1: 30.0})
    assert ask(fill, 0, 0.2, [10, 4], [0.2, 0.2]) == 0


def test_a_new_window_resets_the_critical_rank() -> None:
    fill = fill_for([10, 4], {0: 10.0, 1: 30.0})
    assert ask(fill, 0, 0.2, [10, 4], [0.2, 0.2]) == 0  # cursor past every rank
    fill.begin_window([10, 4], {0: 10.0, 1: 30.0}, 1.0)
    assert ask(fill, 0, 1.1, [10, 3], [1.1, 1.09]) == 2
