"""ElChe driven like a real run: 8 ranks of unequal speed, and invariants under random drive."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.core.cadence.elche import ElChe, rust_round
from flodl.core.cadence.guards import NudgeDown, Stable, SuppressGrowth, Verdict
from tests.core.elche_feed import report

BASE_MS = 100.0
SPEEDS = [1.0 + 1.5 * i / 7 for i in range(8)]  # 1.0, 1.21, ..., 2.5
MS = [BASE_MS / s for s in SPEEDS]


def run_window(elche: ElChe, ms: Sequence[float], sync_ms: float) -> list[float]:
    """Every rank runs its count at its speed; returns each rank's wall time."""
    counts = elche.batch_counts
    walls = [c * m for c, m in zip(counts, ms, strict=True)]
    report(elche, walls, counts, sync_ms)
    return walls


def idle_shares(walls: Sequence[float]) -> list[float]:
    longest = max(walls)
    return [1.0 - w / longest for w in walls]


def assert_balanced(elche: ElChe) -> None:
    """Counts follow the speed ratios (within 5% or one batch) and nobody idles 5%."""
    anchor = elche.anchor
    for count, speed in zip(elche.batch_counts, SPEEDS, strict=True):
        ideal = anchor * speed
        assert abs(count - ideal) <= max(0.05 * ideal, 1.0), (count, ideal)
    walls = [c * m for c, m in zip(elche.batch_counts, MS, strict=True)]
    assert max(idle_shares(walls)) < 0.05, idle_shares(walls)


def test_eight_unequal_ranks_balance_after_calibration() -> None:
    elche = ElChe(8)
    walls = run_window(elche, MS, sync_ms=10.0)  # uncalibrated: all run 10
    assert max(idle_shares(walls)) > 0.5  # the 2.5x rank idles 60% before calibration
    for _ in range(30):
        assert_balanced(elche)
        walls = run_window(elche, MS, sync_ms=10.0)
        elche.apply_verdict(Stable())
        assert max(idle_shares(walls)) < 0.05
    assert elche.anchor_rank == 0
    assert elche.anchor == 10  # ov = 10 / 1010 < 0.05: no growth
    assert elche.batch_counts == [10, 12, 14, 16, 19, 21, 23, 25]


def test_auto_tune_grows_the_anchor_until_the_overhead_meets_the_target() -> None:
    # sync 300 ms against anchor * 100 ms of work. Warmup grows at ov > 0.1 from the 2nd
    # report: 10 -> 20 (ov 0.23) -> 40 (ov 0.13); at 40, ov = 0.0698 waits for Stable (5th
    # report): ceil(40 * 1.395) = 56; then ov = 300 / 5900 = 0.0508: ceil(56 * 1.017) = 57;
    # at 57, ov = 300 / 6000 = 0.05 is on target and growth stops.
    elche = ElChe(8)
    anchors = []
    for _ in range(12):
        run_window(elche, MS, sync_ms=300.0)
        elche.apply_verdict(Stable())
        anchors.append(elche.anchor)
    assert anchors == [10, 20, 40, 40, 56, 57, 57, 57, 57, 57, 57, 57]
    assert elche.overhead is not None and elche.overhead <= elche.overhead_target
    assert_balanced(elche)
    walls = run_window(elche, MS, sync_ms=300.0)
    assert max(idle_shares(walls)) < 0.02


def test_balance_survives_the_loss_of_the_anchor_rank() -> None:
    elche = ElChe(8)
    for _ in range(6):
        run_window(elche, MS, sync_ms=10.0)
    survivors = elche.for_survivors(list(range(1, 8)))
    # The slowest survivor (old rank 1) becomes the anchor rank; counts are re-targeted at once.
    assert survivors.anchor_rank == 0
    assert survivors.batch_counts == [rust_round(10 * s / SPEEDS[1]) for s in SPEEDS[1:]]
    walls = run_window(survivors, MS[1:], sync_ms=10.0)
    # Whole batches at anchor 10 leave up to ~0.5/10 of rounding slack.
    assert max(idle_shares(walls)) < 0.06


# --- invariants under random drive ----------------------------------------------------------

ACTIONS = st.one_of(
    st.tuples(st.just("report"), st.floats(0.0, 5000.0), st.integers(0, 255)),
    st.tuples(st.just("verdict"), st.sampled_from(["stable", "suppress", "nudge"])),
    st.tuples(st.just("nudge"), st.floats(0.0, 2.0)),
    st.tuples(st.just("relax")),
)


def target_counts(elche: ElChe) -> list[int]:
    slow = elche.slow_ms
    assert slow is not None
    return [
        elche.anchor
        if ms is None or rank == elche.anchor_rank
        else max(1, rust_round(elche.anchor * min(slow / ms, 64.0)))
        for rank, ms in enumerate(elche.smoothed_ms)
    ]


@settings(max_examples=150, deadline=None)
@given(
    ms=st.lists(st.floats(1.0, 1000.0), min_size=1, max_size=6),
    anchor=st.integers(1, 30),
    headroom=st.integers(0, 200),
    max_batch_diff=st.none() | st.integers(0, 10),
    cap=st.none() | st.integers(1, 400),
    actions=st.lists(ACTIONS, max_size=40),
)
def test_invariants_under_random_drive(
    ms: list[float],
    anchor: int,
    headroom: int,
    max_batch_diff: int | None,
    cap: int | None,
    actions: list[tuple[object, ...]],
) -> None:
    world = len(ms)
    elche = ElChe(
        world,
        anchor=anchor,
        max_anchor=anchor + headroom,
        max_batch_diff=max_batch_diff,
        max_total_batches=cap,
    )
    verdicts: dict[object, Verdict] = {
        "stable": Stable(),
        "suppress": SuppressGrowth(),
        "nudge": NudgeDown(0.5),
    }
    for action in actions:
        match action:
            case ("report", float(sync), int(mask)):
                counts = elche.batch_counts
                # Bit r of the mask makes rank r's report invalid.
                walls = [
                    0.0 if mask >> r & 1 else c * m
                    for r, (c, m) in enumerate(zip(counts, ms, strict=True))
                ]
                report(elche, walls, counts, sync)
            case ("verdict", kind):
                elche.apply_verdict(verdicts[kind])
            case ("nudge", float(factor)):
                elche.nudge_down(factor)
            case ("relax",):
                elche.relax_up()

        counts = elche.batch_counts
        assert len(counts) == world
        assert all(c >= 1 for c in counts)
        assert 1 <= elche.anchor <= elche.max_anchor
        assert elche.anchor_rank is not None and 0 <= elche.anchor_rank < world
        if cap is not None and cap >= world:
            assert sum(counts) <= cap
        state = json.loads(json.dumps(elche.state(), allow_nan=False))
        assert ElChe.from_state(state).state() == elche.state()

    # Then steady timings: the anchor rank runs the anchor, the slowest rank never more, and
    # every count is within the dead zone of its target.
    elche.set_max_total_batches(None)
    for _ in range(12):
        counts = elche.batch_counts
        report(elche, [c * m for c, m in zip(counts, ms, strict=True)], counts, 0.0)
    if max_batch_diff is None:
        counts = elche.batch_counts
        assert elche.anchor_rank is not None
        assert counts[elche.anchor_rank] == elche.anchor
        slowest = max(range(world), key=lambda r: ms[r])
        assert counts[slowest] <= elche.anchor
        for count, target in zip(counts, target_counts(elche), strict=True):
            assert abs(count - target) <= math.floor(0.05 * count)
