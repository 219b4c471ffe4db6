"""Convergence guards: every rule against hand-computed verdicts."""

from __future__ import annotations

import json
import math

import pytest

from flodl.core.cadence.guards import (
    Guard,
    MsfGuard,
    NoGuard,
    NudgeDown,
    Stable,
    SuppressGrowth,
    TrendGuard,
    Verdict,
    guard_from_state,
    make_guard,
    round_divergence,
)
from flodl.errors import CheckpointError, ConfigError


def feed(guard: Guard, values: list[float], k_max: int = 100) -> list[Verdict]:
    """One round per value, each round a single rank's divergence."""
    return [guard.report([v], k_used=2 * k_max, k_max=k_max) for v in values]


def via_json(guard: Guard) -> Guard:
    return guard_from_state(json.loads(json.dumps(guard.state())))


# --- round divergence -----------------------------------------------------------------------


def test_round_divergence_is_the_largest_usable_entry() -> None:
    assert round_divergence([0.01, 0.07, 0.03]) == 0.07
    assert round_divergence([math.nan, 0.02, -1.0, math.inf]) == 0.02
    assert round_divergence([math.nan, -0.5]) is None
    assert round_divergence([]) is None


# --- NoGuard --------------------------------------------------------------------------------


def test_noguard_is_always_stable() -> None:
    guard = NoGuard()
    assert feed(guard, [0.1, 0.2, 0.4, 0.8, 1.6]) == [Stable()] * 5
    assert isinstance(via_json(guard), NoGuard)


# --- TrendGuard -----------------------------------------------------------------------------


def test_trend_three_strictly_rising_above_threshold_suppresses() -> None:
    guard = TrendGuard()
    assert guard.threshold == 0.05
    verdicts = feed(guard, [0.04, 0.05, 0.06, 0.07, 0.065])
    assert verdicts == [Stable(), Stable(), SuppressGrowth(), SuppressGrowth(), Stable()]


def test_trend_rising_but_below_or_at_threshold_is_stable() -> None:
    assert feed(TrendGuard(), [0.01, 0.02, 0.03]) == [Stable()] * 3
    # The last value must be strictly above the threshold.
    assert feed(TrendGuard(), [0.03, 0.04, 0.05]) == [Stable()] * 3


def test_trend_needs_strictly_rising_values() -> None:
    assert feed(TrendGuard(), [0.06, 0.07, 0.07]) == [Stable()] * 3
    assert feed(TrendGuard(), [0.10, 0.09, 0.20]) == [Stable()] * 3


def test_trend_uses_the_largest_divergence_of_the_round() -> None:
    guard = TrendGuard(threshold=0.01)
    assert guard.report([0.001, 0.02], 20, 10) == Stable()
    assert guard.report([0.03, 0.005], 20, 10) == Stable()
    assert guard.report([0.002, 0.04, math.nan], 20, 10) == SuppressGrowth()
    assert guard.history == [0.02, 0.03, 0.04]


def test_trend_round_without_usable_divergence_is_skipped() -> None:
    guard = TrendGuard()
    feed(guard, [0.06, 0.07])
    assert guard.report([], 0, 0) == Stable()
    assert guard.report([math.nan], 10, 5) == Stable()
    assert guard.history == [0.06, 0.07]
    assert guard.report([0.08], 10, 5) == SuppressGrowth()


def test_trend_ring_keeps_five() -> None:
    guard = TrendGuard()
    feed(guard, [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    assert guard.history == [0.7, 0.6, 0.5, 0.4, 0.3]


def test_trend_never_nudges() -> None:
    verdicts = feed(TrendGuard(), [0.1 * 2**i for i in range(20)])
    assert all(isinstance(v, Stable | SuppressGrowth) for v in verdicts)


def test_trend_state_round_trip_continues_identically() -> None:
    guard = TrendGuard(threshold=0.02)
    feed(guard, [0.01, 0.03])
    restored = via_json(guard)
    assert isinstance(restored, TrendGuard)
    assert restored.threshold == 0.02
    assert feed(restored, [0.04]) == feed(guard, [0.04]) == [SuppressGrowth()]


def test_trend_rejects_bad_threshold_and_bad_state() -> None:
    with pytest.raises(ConfigError):
        TrendGuard(threshold=-0.1)
    with pytest.raises(ConfigError):
        TrendGuard(threshold=math.nan)
    with pytest.raises(CheckpointError):
        TrendGuard.from_state({"kind": "trend", "threshold": 0.05})
    with pytest.raises(CheckpointError):
        TrendGuard.from_state({"kind": "trend", "threshold": 0.05, "ring": [0.1] * 6})
    with pytest.raises(CheckpointError):
        TrendGuard.from_state({"kind": "msf"})


# --- MsfGuard -------------------------------------------------------------------------------


def geometric(rate_per_batch: float, rounds: int, k_max: int = 100) -> list[float]:
    """Divergences that grow by exp(rate * k_max) per round, so lambda == rate."""
    return [1e-3 * math.exp(rate_per_batch * k_max * t) for t in range(rounds)]


def test_msf_first_round_only_records() -> None:
    guard = MsfGuard()
    assert guard.report([0.01], 100, 50) == Stable()
    assert guard.rate is None


def test_msf_rate_above_1e3_three_times_suppresses() -> None:
    guard = MsfGuard()
    # lambda = 0.2 / 100 = 2e-3 per round; the bias-corrected EMA of a constant is that constant.
    verdicts = feed(guard, geometric(2e-3, 6))
    assert verdicts == [
        Stable(),
        Stable(),
        Stable(),
        SuppressGrowth(),
        SuppressGrowth(),
        SuppressGrowth(),
    ]
    assert guard.rate == pytest.approx(2e-3)


def test_msf_rate_above_1e2_three_times_nudges_and_nudge_wins() -> None:
    guard = MsfGuard()
    verdicts = feed(guard, geometric(2e-2, 8))
    # Rounds 2-4 build both streaks to 3: the nudge wins. Its streak restarts, the suppress
    # streak does not: rounds 5-6 suppress, round 7 nudges again.
    assert verdicts == [
        Stable(),
        Stable(),
        Stable(),
        NudgeDown(0.5),
        SuppressGrowth(),
        SuppressGrowth(),
        NudgeDown(0.5),
        SuppressGrowth(),
    ]


def test_msf_bias_corrected_ema() -> None:
    guard = MsfGuard()
    d0 = 1e-3
    d1 = d0 * math.exp(0.2)  # lambda_1 = 0.2 / 100 = 2e-3
    feed(guard, [d0, d1, d1])  # lambda_2 = 0
    # ema = 0.9 * (0.1 * 2e-3) + 0.1 * 0 = 1.8e-4; corrected by 1 - 0.9**2 = 0.19.
    assert guard.rate == pytest.approx(1.8e-4 / 0.19)


def test_msf_streak_must_be_consecutive() -> None:
    guard = MsfGuard()
    d = geometric(2e-3, 3)
    # Two rounds above 1e-3, then a fall that drags the smoothed rate below it.
    verdicts = feed(guard, [*d, d[-1] * math.exp(-1.0), d[-1]])
    assert SuppressGrowth() not in verdicts


def test_msf_divergence_below_floor_resets() -> None:
    guard = MsfGuard()
    feed(guard, geometric(2e-3, 3))  # suppress streak at 2
    assert guard.report([1e-9], 200, 100) == Stable()
    assert guard.rate is None
    # After the reset the next round only records, and the streak starts again from zero.
    assert feed(guard, geometric(2e-3, 3)) == [Stable()] * 3


def test_msf_round_without_k_max_records_without_rate() -> None:
    guard = MsfGuard()
    guard.report([0.01], 0, 0)
    guard.report([0.5], 0, 0)
    assert guard.rate is None
    assert guard.report([0.5 * math.exp(0.2)], 200, 100) == Stable()
    assert guard.rate == pytest.approx(2e-3)


def test_msf_state_round_trip_continues_identically() -> None:
    guard = MsfGuard()
    values = geometric(2e-2, 8)
    feed(guard, values[:3])
    restored = via_json(guard)
    assert isinstance(restored, MsfGuard)
    assert feed(restored, values[3:]) == feed(guard, values[3:])


def test_msf_rejects_bad_settings_and_state() -> None:
    with pytest.raises(ConfigError):
        MsfGuard(nudge_factor=0.0)
    with pytest.raises(ConfigError):
        MsfGuard(suppress_above=math.inf)
    state = MsfGuard().state()
    state["samples"] = -1
    with pytest.raises(CheckpointError):
        MsfGuard.from_state(state)
    del state["ema"]
    with pytest.raises(CheckpointError):
        MsfGuard.from_state(state)


def test_guard_from_state_dispatches_on_kind() -> None:
    assert isinstance(guard_from_state({"kind": "none"}), NoGuard)
    assert isinstance(guard_from_state(TrendGuard().state()), TrendGuard)
    assert isinstance(guard_from_state(MsfGuard().state()), MsfGuard)
    with pytest.raises(CheckpointError):
        guard_from_state({"kind": "oracle"})


def test_make_guard_by_name() -> None:
    trend = make_guard("trend", threshold=0.3)
    assert isinstance(trend, TrendGuard)
    assert trend.threshold == 0.3
    assert isinstance(make_guard("none"), NoGuard)
    assert isinstance(make_guard("msf"), MsfGuard)
    with pytest.raises(ConfigError):
        make_guard("oracle")
