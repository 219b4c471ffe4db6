"""ElChe counts, election, phases, trust window, dead zone, step clamp and cap."""

from __future__ import annotations

import math

import pytest

from flodl.core.cadence.elche import ElChe, Phase, RankWindow, elect_anchor, rust_round
from flodl.core.cadence.phases import phase_for
from flodl.errors import ConfigError
from tests.core.elche_feed import feed, report

# --- construction ---------------------------------------------------------------------------


def test_defaults() -> None:
    elche = ElChe(3)
    assert (elche.anchor, elche.min_anchor, elche.max_anchor) == (10, 10, 1000)
    assert elche.overhead_target == 0.05
    assert elche.max_batch_diff is None
    assert elche.batch_counts == [10, 10, 10]
    assert elche.anchor_rank == 0
    assert elche.phase is Phase.PROBE
    assert elche.calibration_count == 0
    assert elche.anchor_wall_ms == 0.0
    assert elche.smoothed_ms == [None, None, None]


def test_single_rank_runs_the_anchor() -> None:
    elche = ElChe(1, anchor=7)
    assert feed(elche, [30.0], rounds=3) == [7]
    assert elche.anchor_rank == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 2, "anchor": 0}, "anchor"),
        ({"world_size": 2, "anchor": 20, "max_anchor": 19}, "max_anchor"),
        ({"world_size": 2, "overhead_target": math.nan}, "overhead_target"),
        ({"world_size": 2, "max_batch_diff": -1}, "max_batch_diff"),
        ({"world_size": 2, "max_total_batches": 0}, "max_total_batches"),
    ],
)
def test_rejects_bad_settings(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ElChe(**kwargs)  # type: ignore[arg-type]


def test_overhead_target_is_clamped() -> None:
    assert ElChe(2, overhead_target=0.001).overhead_target == 0.01
    assert ElChe(2, overhead_target=0.9).overhead_target == 0.5
    assert ElChe(2, overhead_target=0.2).overhead_target == 0.2


def test_report_of_wrong_length_is_rejected() -> None:
    elche = ElChe(3)
    with pytest.raises(ConfigError, match="windows"):
        elche.report_window([RankWindow(2, compute_ms=100.0)] * 2, 0.0)
    assert elche.calibration_count == 0


# --- counts ---------------------------------------------------------------------------------


def test_rust_round_takes_halves_away_from_zero() -> None:
    assert [rust_round(x) for x in (0.5, 1.5, 2.5, 3.5, 2.4999, -2.5, -0.4)] == [
        1,
        2,
        3,
        4,
        2,
        -3,
        0,
    ]


def test_counts_are_proportional_to_speed() -> None:
    elche = ElChe(3)
    assert feed(elche, [100.0, 50.0, 40.0]) == [10, 20, 25]
    assert elche.anchor_wall_ms == 1000.0


def test_counts_round_halves_up() -> None:
    # 10 * 100 / 80 = 12.5 -> 13 (Python's round would say 12).
    assert feed(ElChe(2), [100.0, 80.0]) == [10, 13]
    # 2 * 100 / 80 = 2.5 -> 3 (Python's round would say 2).
    assert feed(ElChe(2, anchor=2), [100.0, 80.0]) == [2, 3]


def test_counts_cap_at_64x_the_anchor() -> None:
    assert feed(ElChe(3), [6400.0, 1.0, 200.0]) == [10, 640, 320]


def test_counts_never_drop_below_one() -> None:
    # Before Stable no election runs: rank 0 stays the anchor rank though rank 1 is 100x slower,
    # whose target round(10 * 10 / 1000) = round(0.1) = 0 is raised to 1.
    assert feed(ElChe(2), [10.0, 1000.0]) == [10, 1]


def test_samples_use_actual_batches() -> None:
    elche = ElChe(2)
    report(elche, [1000.0, 1000.0], [10, 8], 0.0)
    assert elche.smoothed_ms == [100.0, 125.0]
    assert elche.batch_counts == [10, 8]


# --- trust window and invalid reports -------------------------------------------------------


def test_trust_window_is_the_mean_of_the_last_five() -> None:
    elche = ElChe(2)
    for ms in (10.0, 20.0, 30.0, 40.0, 50.0, 60.0):
        report(elche, [100.0, ms], [1, 1], 0.0)
    assert elche.smoothed_ms == [100.0, 40.0]


@pytest.mark.parametrize(
    ("wall", "batches"),
    [(0.0, 5), (-10.0, 5), (math.nan, 5), (math.inf, 5), (100.0, 0)],
)
def test_invalid_reports_are_ignored(wall: float, batches: int) -> None:
    elche = ElChe(2)
    report(elche, [100.0, 50.0], [1, 1], 0.0)
    report(elche, [100.0, wall], [1, batches], 0.0)
    assert elche.smoothed_ms == [100.0, 50.0]
    assert elche.batch_counts == [10, 20]


def test_five_invalid_reports_in_a_row_clear_the_window() -> None:
    elche = ElChe(2)
    report(elche, [100.0, 50.0], [1, 1], 0.0)
    for _ in range(4):
        report(elche, [100.0, 0.0], [1, 0], 0.0)
    assert elche.smoothed_ms == [100.0, 50.0]
    report(elche, [100.0, 0.0], [1, 0], 0.0)
    assert elche.smoothed_ms == [100.0, None]
    # An untimed rank runs the anchor.
    assert elche.batch_counts == [10, 10]


def test_a_valid_report_resets_the_invalid_streak() -> None:
    elche = ElChe(2)
    report(elche, [100.0, 50.0], [1, 1], 0.0)
    for _ in range(4):
        report(elche, [100.0, 0.0], [1, 0], 0.0)
    report(elche, [100.0, 40.0], [1, 1], 0.0)
    for _ in range(4):
        report(elche, [100.0, 0.0], [1, 0], 0.0)
    assert elche.smoothed_ms == [100.0, 45.0]


def test_all_invalid_report_is_not_a_calibration() -> None:
    elche = ElChe(2)
    report(elche, [0.0, math.nan], [0, 3], 0.0)
    assert elche.calibration_count == 0
    assert elche.phase is Phase.PROBE
    assert elche.batch_counts == [10, 10]


def test_report_window_excludes_fill_and_prefers_delivered() -> None:
    elche = ElChe(2)
    elche.report_window(
        [
            RankWindow(batches=11, fill_ms=500.0, compute_ms=900.0, delivered_ms=1000.0),
            RankWindow(batches=21, fill_ms=500.0, compute_ms=800.0, delivered_ms=1000.0),
        ],
        reduce_ms=0.0,
    )
    assert elche.smoothed_ms == [100.0, 50.0]
    assert elche.batch_counts == [10, 20]


def test_report_window_falls_back_to_compute_for_everyone() -> None:
    # Rank 1 has no delivered sample: the whole cohort uses compute time, never a mix.
    elche = ElChe(2)
    elche.report_window(
        [
            RankWindow(batches=11, compute_ms=900.0, delivered_ms=1000.0),
            RankWindow(batches=11, compute_ms=450.0),
        ],
        reduce_ms=0.0,
    )
    assert elche.smoothed_ms == [90.0, 45.0]
    # And when the caller's mode does not use delivered time.
    elche = ElChe(2)
    both = RankWindow(batches=11, compute_ms=900.0, delivered_ms=1000.0)
    elche.report_window([both, both], reduce_ms=0.0, use_delivered=False)
    assert elche.smoothed_ms == [90.0, 90.0]


def test_report_window_skips_empty_windows() -> None:
    elche = ElChe(3)
    elche.report_window(
        [
            RankWindow(batches=11, compute_ms=1000.0),
            RankWindow(batches=1, fill_ms=80.0),  # only the fill batch
            None,
        ],
        reduce_ms=0.0,
    )
    assert elche.smoothed_ms == [100.0, None, None]
    zero = RankWindow(batches=11)
    elche.report_window([zero, zero, zero], reduce_ms=0.0)
    assert elche.smoothed_ms == [100.0, None, None]


# --- phases ---------------------------------------------------------------------------------


def test_phase_thresholds() -> None:
    assert [phase_for(n) for n in (0, 1, 4, 5, 19, 20, 500)] == [
        Phase.PROBE,
        Phase.WARMUP,
        Phase.WARMUP,
        Phase.STABLE,
        Phase.STABLE,
        Phase.MATURE,
        Phase.MATURE,
    ]


def test_phases_advance_with_calibrations() -> None:
    elche = ElChe(2)
    seen = []
    for _ in range(20):
        feed(elche, [100.0, 50.0])
        seen.append(elche.phase)
    assert seen[0] is Phase.WARMUP
    assert seen[3] is Phase.WARMUP
    assert seen[4] is Phase.STABLE
    assert seen[18] is Phase.STABLE
    assert seen[19] is Phase.MATURE
    assert elche.calibration_count == 20


# --- anchor election ------------------------------------------------------------------------


def test_election_picks_the_lowest_index_of_the_slow_cohort() -> None:
    assert elect_anchor([100.0, 90.0, 50.0], None) == 0
    assert elect_anchor([90.0, 100.0, 50.0], None) == 0  # 90 >= 0.85 * 100: in the cohort
    assert elect_anchor([85.0, 100.0], None) == 0
    assert elect_anchor([80.0, 100.0], None) == 1  # 80 < 85: out of the cohort
    assert elect_anchor([None, 100.0, 99.0], None) == 1
    assert elect_anchor([None, None], 0) is None


def test_election_keeps_the_incumbent_unless_dominated() -> None:
    assert elect_anchor([105.0, 100.0], 1) == 1  # 5% slower: sticky
    assert elect_anchor([109.9, 100.0], 1) == 1
    assert elect_anchor([110.0, 100.0], 1) == 0  # exactly 10% slower: unseated
    assert elect_anchor([100.0, 150.0, 140.0], 0) == 1  # dominated, lowest cohort index wins
    assert elect_anchor([100.0, None], 1) == 0  # an untimed incumbent is no incumbent


def test_elections_wait_for_stable() -> None:
    elche = ElChe(2)
    # Rank 1 is slower, but before Stable rank 0 stays the anchor rank.
    for _ in range(5):
        assert feed(elche, [50.0, 100.0]) == [10, 5]
        assert elche.anchor_rank == 0
    assert elche.phase is Phase.STABLE
    # The 6th report runs in Stable: rank 1 is elected and everything is re-targeted (the
    # anchor would carry the 500 ms window over as 5 batches of rank 1, but stays at its
    # initial 10).
    assert feed(elche, [50.0, 100.0]) == [20, 10]
    assert elche.anchor_rank == 1
    assert elche.anchor_wall_ms == 1000.0


def test_a_new_anchor_rank_keeps_the_windows_length() -> None:
    elche = ElChe(2, anchor=10)
    feed(elche, [100.0, 100.0], rounds=6)
    elche._tuner.anchor = 30  # grown on rank 0: 3 s windows
    while elche.anchor_rank == 0:  # rank 1 slows down until it is elected
        wall_before = elche.anchor_wall_ms
        feed(elche, [100.0, 300.0])
    # The anchor carried the window's length over to rank 1's (smoothed) batches.
    slow_ms = elche.smoothed_ms[1]
    assert slow_ms is not None
    assert elche.anchor == rust_round(30 * 100.0 / slow_ms)
    assert elche.anchor < 30
    assert elche.anchor_wall_ms == pytest.approx(wall_before, rel=0.05)


def test_sticky_anchor_survives_small_drift() -> None:
    elche = ElChe(2)
    feed(elche, [100.0, 50.0], rounds=6)
    assert elche.anchor_rank == 0
    # Rank 1 slows to 105 ms: within 10% of the incumbent, which stays.
    feed(elche, [100.0, 105.0], rounds=5)
    assert elche.anchor_rank == 0
    assert elche.batch_counts == [10, 10]  # round(10 * 100 / 105) = round(9.52) = 10
    # Rank 1 slows to 120 ms: 20% slower, and rank 0 leaves the slow cohort (100 < 0.85 * 120).
    feed(elche, [100.0, 120.0], rounds=5)
    assert elche.anchor_rank == 1
    assert elche.batch_counts == [12, 10]


def test_lost_anchor_rank_is_replaced_at_once() -> None:
    elche = ElChe(3)
    feed(elche, [100.0, 80.0, 50.0])
    assert elche.phase is Phase.WARMUP
    for _ in range(5):
        c = elche.batch_counts
        report(elche, [0.0, c[1] * 80.0, c[2] * 50.0], [0, c[1], c[2]], 0.0)
    # Rank 0 missed 5 reports: even in Warmup a new anchor rank is elected among the timed,
    # and the anchor carries the window's length over: round(10 * 100 / 80) = 13 batches of
    # rank 1; rank 2 round(13 * 80 / 50) = 21.
    assert elche.anchor_rank == 1
    assert elche.anchor == 13
    assert elche.batch_counts == [13, 13, 21]


def test_with_every_rank_lost_rank_0_stands_in() -> None:
    elche = ElChe(2)
    feed(elche, [50.0, 100.0], rounds=6)
    assert elche.anchor_rank == 1
    for _ in range(5):
        report(elche, [0.0, 0.0], [0, 0], 0.0)
    assert elche.smoothed_ms == [None, None]
    assert elche.anchor_rank == 0
    assert elche.batch_counts == [10, 10]
    # The first rank to report again is elected at once (the others count as lost).
    report(elche, [0.0, 1000.0], [0, 10], 0.0)
    assert elche.anchor_rank == 1
    assert elche.batch_counts == [10, 10]


# --- dead zone and step clamp ---------------------------------------------------------------


def test_dead_zone_ignores_changes_of_five_percent_or_less() -> None:
    elche = ElChe(2)
    report(elche, [100.0, 50.0], [1, 1], 0.0)
    assert elche.batch_counts == [10, 20]
    # Mean (50 + 47) / 2 = 48.5: target round(20.62) = 21, |21 - 20| <= 5% of 20: kept.
    report(elche, [100.0, 47.0], [1, 1], 0.0)
    assert elche.batch_counts == [10, 20]
    # Mean (50 + 47 + 40) / 3 = 45.67: target round(21.9) = 22, a change of 2 > 1: applied.
    report(elche, [100.0, 40.0], [1, 1], 0.0)
    assert elche.batch_counts == [10, 22]


def test_step_clamp_moves_at_most_max_batch_diff_once_calibrated() -> None:
    elche = ElChe(2, max_batch_diff=2)
    # The first calibration jumps straight to the target.
    report(elche, [100.0, 50.0], [1, 1], 0.0)
    assert elche.batch_counts == [10, 20]
    # Mean 30: target round(33.3) = 33, but one step moves at most 2.
    report(elche, [100.0, 10.0], [1, 1], 0.0)
    assert elche.batch_counts == [10, 22]
    # Mean 23.33: target round(42.9) = 43: again 2.
    report(elche, [100.0, 10.0], [1, 1], 0.0)
    assert elche.batch_counts == [10, 24]


def test_step_clamp_of_zero_freezes_counts_after_calibration() -> None:
    elche = ElChe(2, max_batch_diff=0)
    report(elche, [100.0, 50.0], [1, 1], 0.0)
    report(elche, [100.0, 10.0], [1, 1], 0.0)
    assert elche.batch_counts == [10, 20]


# --- window cap -----------------------------------------------------------------------------


def test_window_cap_scales_down_and_gives_the_remainder_to_the_largest() -> None:
    elche = ElChe(3, max_total_batches=35)
    # Targets [10, 20, 40] sum to 70; scaled by 35/70: [5, 10, 20], no remainder.
    assert feed(elche, [100.0, 50.0, 25.0]) == [5, 10, 20]
    assert elche.cap_binding
    # Cap 30: floor([5, 10, 20] * 30 / 35) = [4, 8, 17] = 29, remainder 1 to the largest.
    elche.set_max_total_batches(30)
    assert elche.batch_counts == [4, 8, 18]
    # Removing the cap lets the counts grow back at the next report.
    elche.set_max_total_batches(None)
    assert not elche.cap_binding
    assert feed(elche, [100.0, 50.0, 25.0]) == [10, 20, 40]
    assert not elche.cap_binding


def test_window_cap_takes_overshoot_of_the_one_batch_floor_from_the_largest() -> None:
    elche = ElChe(3, anchor=1, max_total_batches=3)
    # Targets [1, 4, 1]: floor([3, 12, 3] / 6) = [0, 2, 0] -> [1, 2, 1] = 4 > 3: take 1 back.
    assert feed(elche, [4.0, 1.0, 4.0]) == [1, 1, 1]


def test_anchor_rank_is_exempt_from_the_dead_zone() -> None:
    elche = ElChe(1, anchor=20, max_anchor=21, max_total_batches=20)
    assert elche.relax_up()
    assert elche.batch_counts == [20]  # the cap holds the anchor rank at 20
    elche.set_max_total_batches(None)
    # |21 - 20| is within 5% of 20, but the anchor rank always runs the anchor.
    assert feed(elche, [100.0]) == [21]


def test_window_cap_applies_from_the_start_and_keeps_one_batch_each() -> None:
    elche = ElChe(4, max_total_batches=20)
    assert elche.batch_counts == [5, 5, 5, 5]
    assert elche.cap_binding
    elche.set_max_total_batches(2)
    assert elche.batch_counts == [1, 1, 1, 1]
    assert ElChe(4, max_total_batches=40).cap_binding is False


# --- outputs --------------------------------------------------------------------------------


def test_recent_batch_share_averages_the_last_ten_count_vectors() -> None:
    elche = ElChe(2)
    assert elche.recent_batch_share == [0.5, 0.5]
    report(elche, [100.0, 50.0], [1, 1], 0.0)  # counts [10, 20]
    report(elche, [100.0, 10.0], [1, 1], 0.0)  # mean 30: counts [10, 33]
    # Mean vector [10, 26.5], normalised.
    assert elche.recent_batch_share == pytest.approx([10 / 36.5, 26.5 / 36.5])
    for _ in range(15):
        report(elche, [100.0, 25.0], [1, 1], 0.0)
    assert elche.recent_batch_share == pytest.approx([1 / 5, 4 / 5])
