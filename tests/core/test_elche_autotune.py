"""ElChe auto-tune: staged growth, the guard verdict seam, latch, nudge_down and relax_up."""

from __future__ import annotations

import math

import pytest

from flodl.core.cadence.elche import ElChe, Phase, RankWindow
from flodl.core.cadence.guards import NudgeDown, Stable, SuppressGrowth
from flodl.errors import ConfigError
from tests.core.elche_feed import feed, report

MS = [100.0, 50.0]  # rank 0 is the anchor rank: anchor * slow = 10 * 100 = 1000 ms


def stable_elche(**kwargs: object) -> ElChe:
    """An ElChe over MS that has just reached Stable without any overhead."""
    elche = ElChe(2, **kwargs)  # type: ignore[arg-type]
    feed(elche, MS, rounds=5)
    assert elche.phase is Phase.STABLE
    assert elche.staged_anchor is None
    return elche


# --- staging --------------------------------------------------------------------------------


def test_growth_is_staged_until_a_stable_verdict() -> None:
    elche = stable_elche()
    # ov = 100 / (10 * 100 + 100) = 0.0909 > 0.05: ceil(10 * min(1.818, 2)) = 19.
    feed(elche, MS, sync_ms=100.0)
    assert elche.overhead == pytest.approx(100 / 1100)
    assert elche.staged_anchor == 19
    assert elche.anchor == 10
    assert elche.batch_counts == [10, 20]
    elche.apply_verdict(Stable())
    assert elche.anchor == 19
    assert elche.staged_anchor is None
    assert elche.batch_counts == [19, 38]
    assert elche.anchor_wall_ms == 1900.0


def test_growth_at_most_doubles() -> None:
    elche = stable_elche()
    feed(elche, MS, sync_ms=1000.0)  # ov = 0.5: ten times the target, growth capped at 2x
    assert elche.staged_anchor == 20


def test_no_growth_at_or_below_target() -> None:
    elche = stable_elche()
    feed(elche, MS, sync_ms=52.0)  # ov = 52 / 1052 = 0.0494
    assert elche.staged_anchor is None
    feed(elche, MS, sync_ms=53.0)  # ov = 53 / 1053 = 0.0503: ceil(10 * 1.0067) = 11
    assert elche.staged_anchor == 11


def test_warmup_needs_twice_the_target_and_a_second_report() -> None:
    elche = ElChe(2)
    feed(elche, MS, sync_ms=300.0)  # ov = 300 / 1300 = 0.23, but only the 1st calibration
    assert elche.phase is Phase.WARMUP
    assert elche.staged_anchor is None
    feed(elche, MS, sync_ms=300.0)
    assert elche.staged_anchor == 20
    # ov = 0.0909 fires in Stable, but not in Warmup (below 2 * 0.05).
    elche = ElChe(2)
    for _ in range(4):
        feed(elche, MS, sync_ms=100.0)
        assert elche.staged_anchor is None
    feed(elche, MS, sync_ms=100.0)
    assert elche.phase is Phase.STABLE
    assert elche.staged_anchor == 19


def test_no_growth_without_timing() -> None:
    elche = ElChe(2)
    report(elche, [0.0, 0.0], [0, 0], 1e6)
    assert elche.overhead is None
    assert elche.staged_anchor is None


def test_a_new_report_replaces_the_staged_proposal() -> None:
    elche = stable_elche()
    feed(elche, MS, sync_ms=100.0)
    assert elche.staged_anchor == 19
    feed(elche, MS, sync_ms=0.0)
    assert elche.staged_anchor is None
    elche.apply_verdict(Stable())
    assert elche.anchor == 10


def test_proposal_is_clamped_to_max_anchor() -> None:
    elche = stable_elche(max_anchor=15)
    feed(elche, MS, sync_ms=100.0)
    assert elche.staged_anchor == 15
    elche = stable_elche(max_anchor=10)
    feed(elche, MS, sync_ms=100.0)
    assert elche.staged_anchor is None


def test_proposal_is_raised_to_min_anchor() -> None:
    elche = stable_elche()
    assert elche.nudge_down(0.5) == 5  # a direct nudge does not latch growth
    # ov = 30 / (5 * 100 + 30) = 0.0566: ceil(5 * 1.132) = 6, raised to min_anchor 10.
    feed(elche, MS, sync_ms=30.0)
    assert elche.staged_anchor == 10


def test_never_grows_under_sync_policy() -> None:
    elche = stable_elche(sync_policy=True)
    feed(elche, MS, sync_ms=1000.0)
    assert elche.overhead == pytest.approx(0.5)
    assert elche.staged_anchor is None


def test_never_grows_while_the_cap_binds() -> None:
    elche = stable_elche(max_total_batches=20)
    assert elche.cap_binding
    feed(elche, MS, sync_ms=1000.0)
    assert elche.staged_anchor is None
    elche.set_max_total_batches(None)
    feed(elche, MS, sync_ms=1000.0)
    assert elche.staged_anchor == 20


def test_window_feed_counts_only_the_average_as_overhead() -> None:
    elche = ElChe(2)
    quiet = [RankWindow(11, compute_ms=1000.0), RankWindow(21, compute_ms=1000.0)]
    for _ in range(5):
        elche.report_window(quiet, reduce_ms=0.0)
    assert elche.batch_counts == [10, 20]
    # The anchor rank's fill batch held a 5 s evaluation: not averaging cost.
    # ov = 10 / (10 * 100 + 10).
    evaluated = [
        RankWindow(11, fill_ms=5000.0, compute_ms=1000.0),
        RankWindow(21, fill_ms=50.0, compute_ms=1000.0),
    ]
    elche.report_window(evaluated, reduce_ms=10.0)
    assert elche.overhead == pytest.approx(10 / 1010)
    assert elche.staged_anchor is None
    # A slow average does count: ov = 100 / 1100 > 5% stages round up 10 * 0.0909 / 0.05.
    elche.report_window(quiet, reduce_ms=100.0)
    assert elche.overhead == pytest.approx(100 / 1100)
    assert elche.staged_anchor == 19


# --- verdicts -------------------------------------------------------------------------------


def test_suppress_growth_vetoes_and_latches() -> None:
    elche = stable_elche()
    feed(elche, MS, sync_ms=100.0)
    elche.apply_verdict(SuppressGrowth())
    assert elche.anchor == 10
    assert elche.staged_anchor is None
    assert elche.growth_latched
    feed(elche, MS, sync_ms=100.0)
    assert elche.staged_anchor is None


def test_five_stable_verdicts_rearm_growth() -> None:
    elche = stable_elche()
    elche.apply_verdict(SuppressGrowth())
    for _ in range(4):
        feed(elche, MS, sync_ms=100.0)
        assert elche.staged_anchor is None
        elche.apply_verdict(Stable())
        assert elche.growth_latched
    # A non-Stable verdict restarts the count.
    elche.apply_verdict(SuppressGrowth())
    for _ in range(4):
        elche.apply_verdict(Stable())
    assert elche.growth_latched
    elche.apply_verdict(Stable())
    assert not elche.growth_latched
    assert elche.anchor == 10
    feed(elche, MS, sync_ms=100.0)
    assert elche.staged_anchor == 19
    elche.apply_verdict(Stable())
    assert elche.anchor == 19


def test_nudge_down_verdict_discards_shrinks_and_latches() -> None:
    elche = stable_elche()
    feed(elche, MS, sync_ms=100.0)
    elche.apply_verdict(NudgeDown(0.5))
    assert elche.anchor == 5
    assert elche.staged_anchor is None
    assert elche.growth_latched
    assert elche.batch_counts == [5, 10]


def test_nudge_down_verdict_with_nan_only_discards_and_latches() -> None:
    elche = stable_elche()
    feed(elche, MS, sync_ms=100.0)
    elche.apply_verdict(NudgeDown(math.nan))
    assert elche.anchor == 10
    assert elche.staged_anchor is None
    assert elche.growth_latched


def test_nudge_factor_is_clamped_and_ignores_min_anchor() -> None:
    elche = stable_elche()
    elche.apply_verdict(NudgeDown(3.0))  # clamped to 1: no change
    assert elche.anchor == 10
    elche.apply_verdict(NudgeDown(0.01))  # clamped to 0.1: ceil(1.0) = 1, below min_anchor
    assert elche.anchor == 1
    assert elche.batch_counts == [1, 2]


def test_apply_verdict_rejects_other_objects() -> None:
    with pytest.raises(ConfigError):
        ElChe(2).apply_verdict("Stable")  # type: ignore[arg-type]


# --- nudge_down and relax_up ----------------------------------------------------------------


def test_nudge_down_rounds_up() -> None:
    elche = stable_elche()
    assert elche.nudge_down(0.75) == 8  # ceil(7.5)
    assert elche.nudge_down(0.5) == 4
    assert elche.nudge_down(math.nan) == 4
    elche = stable_elche()
    assert elche.nudge_down(0.3) == 3  # 10 * 0.3 is 3.0000000000000004 in floats
    assert elche.batch_counts == [3, 6]
    assert ElChe(2, anchor=1).nudge_down(0.1) == 1


def test_nudge_down_drops_a_staged_proposal() -> None:
    elche = stable_elche()
    feed(elche, MS, sync_ms=100.0)
    elche.nudge_down(0.5)
    elche.apply_verdict(Stable())
    assert elche.anchor == 5


def test_relax_up_without_max_batch_diff_grows_to_max_anchor() -> None:
    elche = stable_elche(max_anchor=11)
    assert elche.relax_up()
    assert elche.anchor == 11
    assert elche.batch_counts == [11, 22]
    assert not elche.relax_up()
    assert elche.anchor == 11


def test_relax_up_respects_the_spread_bound() -> None:
    # max/min = 2: relaxing to a + 1 needs round(2 * (a + 1)) - (a + 1) = a + 1 <= M.
    elche = stable_elche(max_batch_diff=11)
    assert elche.relax_up()
    assert elche.anchor == 11
    assert not elche.relax_up()  # 12 > 11
    assert elche.anchor == 11


def test_relax_up_with_a_bound_needs_timing() -> None:
    assert not ElChe(2, max_batch_diff=50).relax_up()
    assert ElChe(2).relax_up()


def test_stable_verdict_relaxes_up_when_enabled() -> None:
    elche = stable_elche(relax_up_on_stable=True)
    elche.apply_verdict(Stable())
    assert elche.anchor == 11
    feed(elche, MS, sync_ms=100.0)  # ov = 100 / 1200 = 0.0833: ceil(11 * 1.667) = 19
    assert elche.staged_anchor == 19
    elche.apply_verdict(Stable())
    assert elche.anchor == 20  # committed, then relaxed


def test_anchor_change_moves_counts_by_at_most_max_batch_diff() -> None:
    elche = stable_elche(max_batch_diff=3)
    feed(elche, MS, sync_ms=100.0)
    elche.apply_verdict(Stable())
    assert elche.anchor == 19
    assert elche.batch_counts == [13, 23]
    assert feed(elche, MS) == [16, 26]
