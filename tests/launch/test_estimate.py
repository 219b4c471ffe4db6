"""The closing summary's estimate of lock-step DDP's time for the same batches."""

from __future__ import annotations

import io
from typing import Any

import pytest

from flodl.launch.estimate import describe, step_s, versus_ddp
from flodl.launch.summary import print_summary


def rank(
    batches: int, wall_s: float, idle_s: float = 0.0, averaging_s: float = 0.0
) -> dict[str, Any]:
    return {
        "batches": batches,
        "wall_s": wall_s + 1.0,
        "startup_s": 1.0,
        "idle_s": idle_s,
        "averaging_s": averaging_s,
    }


def test_a_rank_s_step_time_leaves_out_idle_and_averaging() -> None:
    assert step_s(rank(100, 10.0, idle_s=1.0, averaging_s=1.0)) == pytest.approx(0.08)


def test_ddp_trains_the_same_batches_at_the_slowest_rank_s_pace() -> None:
    # A fast rank (0.1 s a batch) and a 2.5x slower one (0.25 s), 10 s of training each.
    estimate = versus_ddp([rank(100, 10.0), rank(40, 10.0)])
    assert estimate is not None
    # 140 batches = 70 lock-step steps of 0.25 s.
    assert estimate["batches"] == 140
    assert estimate["ddp_estimated_s"] == pytest.approx(17.5)
    assert estimate["speedup_vs_ddp"] == pytest.approx(1.75)
    assert estimate["method"].startswith("estimated")


def test_equal_ranks_gain_nothing_over_ddp() -> None:
    estimate = versus_ddp([rank(100, 10.0), rank(100, 10.0)])
    assert estimate is not None
    assert estimate["speedup_vs_ddp"] == pytest.approx(1.0)


def test_time_spent_averaging_counts_against_flodl() -> None:
    waiting = versus_ddp([rank(80, 10.0, averaging_s=2.0), rank(32, 10.0, averaging_s=2.0)])
    assert waiting is not None
    # 112 batches / 2 at 0.25 s: 14 s against the run's 10 s.
    assert waiting["speedup_vs_ddp"] == pytest.approx(1.4)


@pytest.mark.parametrize(
    "ranks",
    [
        [rank(100, 10.0)],  # one rank: there is no DDP to compare with
        [rank(100, 10.0), {"batches": 40}],  # a rank without timings
        [rank(100, 10.0), rank(0, 10.0)],  # a rank that trained nothing
        [rank(100, 10.0), rank(40, 10.0, idle_s=10.0)],  # no busy time to measure
    ],
)
def test_no_estimate_from_part_of_the_run(ranks: list[dict[str, Any]]) -> None:
    assert versus_ddp(ranks) is None


def test_the_summary_says_the_figure_is_an_estimate() -> None:
    estimate = versus_ddp([rank(100, 10.0), rank(40, 10.0)])
    assert estimate is not None
    summary = {
        "status": "completed",
        "message": "all epochs done",
        "ranks": [],
        "deaths": [],
        "versus_ddp": estimate,
    }
    out = io.StringIO()
    print_summary(summary, out)
    assert describe(estimate) in out.getvalue()
    assert "vs lock-step DDP (estimated): 1.75x" in out.getvalue()
