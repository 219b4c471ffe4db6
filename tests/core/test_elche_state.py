"""ElChe checkpoints (state round trip) and elastic membership (survivors, added ranks)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from flodl.core.cadence.elche import ElChe, Phase
from flodl.core.cadence.guards import NudgeDown, Stable, SuppressGrowth, Verdict
from flodl.errors import CheckpointError, ConfigError
from tests.core.elche_feed import feed


def via_json(state: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(state, allow_nan=False))
    return loaded


# --- state ----------------------------------------------------------------------------------


def test_state_is_plain_json_with_the_persisted_fields() -> None:
    elche = ElChe(2)
    feed(elche, [100.0, 50.0], rounds=5)
    state = via_json(elche.state())
    assert state["anchor"] == 10
    assert state["anchor_rank"] == 0
    assert state["smoothed_ms"] == [100.0, 50.0]
    assert state["phase"] == "STABLE"
    assert state["calibration_count"] == 5
    assert state["batch_counts"] == [10, 20]


def test_fresh_state_round_trips() -> None:
    elche = ElChe(3, anchor=4, max_anchor=40)
    restored = ElChe.from_state(via_json(elche.state()))
    assert restored.state() == elche.state()
    assert restored.batch_counts == [4, 4, 4]


def test_a_state_with_the_old_cold_start_pin_keys_still_loads() -> None:
    elche = ElChe(2)
    feed(elche, [100.0, 50.0])
    saved = {**via_json(elche.state()), "speed_pin": None, "partition_ratios": None}
    assert ElChe.from_state(saved).state() == elche.state()


def test_round_trip_mid_run_reproduces_identical_decisions() -> None:
    # A run with drifting timings (rank 2 becomes the slowest in Mature), a step clamp, a cap
    # that starts binding late, growth, a suppression, a nudge and re-arming.
    verdicts: dict[int, Verdict] = {3: SuppressGrowth(), 12: NudgeDown(0.75), 20: SuppressGrowth()}

    def report(elche: ElChe, step: int) -> None:
        ms = [100.0 + 5 * (step % 3), 60.0 - step, 30.0 + 4 * step]
        feed(elche, ms, sync_ms=80.0 + 10 * (step % 4))

    def decide(elche: ElChe, step: int) -> tuple[object, ...]:
        elche.apply_verdict(verdicts.get(step, Stable()))
        return (
            elche.batch_counts,
            elche.anchor,
            elche.anchor_rank,
            elche.phase,
            elche.growth_latched,
            elche.cap_binding,
            elche.recent_batch_share,
            elche.smoothed_ms,
        )

    original = ElChe(3, max_batch_diff=6, max_total_batches=100)
    for step in range(10):
        report(original, step)
        decide(original, step)
    report(original, 10)
    assert original.staged_anchor == 19  # round trip between a report and its verdict
    restored = ElChe.from_state(via_json(original.state()))
    assert restored.state() == original.state()
    seen = [decide(restored, 10)]
    assert seen[-1] == decide(original, 10)
    for step in range(11, 30):
        report(restored, step)
        report(original, step)
        seen.append(decide(restored, step))
        assert seen[-1] == decide(original, step)
    # The scenario reached what it is meant to cover.
    assert {s[2] for s in seen} == {0, 2}
    assert any(s[5] for s in seen)
    assert {s[1] for s in seen} >= {15, 19}


def test_staged_proposal_survives_a_round_trip() -> None:
    elche = ElChe(2)
    feed(elche, [100.0, 50.0], rounds=5)
    feed(elche, [100.0, 50.0], sync_ms=100.0)
    assert elche.staged_anchor == 19
    restored = ElChe.from_state(via_json(elche.state()))
    restored.apply_verdict(Stable())
    assert restored.anchor == 19
    assert restored.batch_counts == [19, 38]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 99}, "newer"),
        ({"batch_counts": [10]}, "batch_counts"),
        ({"batch_counts": [0, 20]}, "count"),
        ({"anchor": 5000}, "anchor"),
        ({"samples": [[100.0], [-1.0]]}, "sample"),
        ({"anchor_rank": 7}, "out of range"),
        ({"history": [[1, 2, 3]]}, "history"),
        ({"calibration_count": "many"}, "malformed"),
    ],
)
def test_bad_state_is_a_checkpoint_error(change: dict[str, Any], message: str) -> None:
    elche = ElChe(2)
    feed(elche, [100.0, 50.0])
    state = via_json(elche.state())
    state.update(change)
    with pytest.raises((CheckpointError, ConfigError), match=message):
        ElChe.from_state(state)


def test_missing_key_is_a_checkpoint_error() -> None:
    state = ElChe(2).state()
    del state["misses"]
    with pytest.raises(CheckpointError, match="misses"):
        ElChe.from_state(state)


# --- survivors ------------------------------------------------------------------------------


def four_ranks() -> ElChe:
    elche = ElChe(4)
    assert feed(elche, [100.0, 80.0, 50.0, 25.0]) == [10, 13, 20, 40]
    return elche


def test_survivors_reelect_when_the_anchor_rank_died() -> None:
    elche = four_ranks()
    survivors = elche.for_survivors([3, 1, 2])
    assert survivors.world_size == 3
    assert survivors.smoothed_ms == [80.0, 50.0, 25.0]
    assert survivors.anchor_rank == 0  # old rank 1, the slowest survivor
    assert survivors.batch_counts == [10, 16, 32]
    assert survivors.phase is Phase.WARMUP
    assert survivors.calibration_count == 1
    assert elche.world_size == 4  # the original is untouched
    assert elche.batch_counts == [10, 13, 20, 40]


def test_survivors_keep_a_living_anchor_rank_and_the_anchor() -> None:
    elche = four_ranks()
    elche.nudge_down(0.5)
    elche.apply_verdict(SuppressGrowth())
    survivors = elche.for_survivors([0, 2])
    assert survivors.anchor_rank == 0
    assert survivors.anchor == 5
    assert survivors.min_anchor == 10
    assert survivors.growth_latched
    assert survivors.batch_counts == [5, 10]
    # The timings go on where they were.
    assert feed(survivors, [100.0, 50.0]) == [5, 10]
    assert survivors.calibration_count == 2


def test_single_survivor_runs_the_anchor() -> None:
    survivors = four_ranks().for_survivors([2])
    assert survivors.world_size == 1
    assert survivors.anchor_rank == 0
    assert survivors.batch_counts == [10]


def test_survivors_before_any_timing() -> None:
    elche = ElChe(3)
    kept = elche.for_survivors([0, 2])
    assert kept.anchor_rank == 0  # the anchor rank, kept
    assert kept.batch_counts == [10, 10]
    lost = elche.for_survivors([1, 2])
    assert lost.anchor_rank == 0  # anchor rank gone, no timing: rank 0
    assert lost.batch_counts == [10, 10]


def test_survivors_remap_the_share_history() -> None:
    elche = four_ranks()
    survivors = elche.for_survivors([0, 3])
    assert survivors.recent_batch_share == pytest.approx([10 / 50, 40 / 50])


@pytest.mark.parametrize("bad", [[], [1, 1], [0, 4], [-1]])
def test_bad_survivor_lists(bad: list[int]) -> None:
    with pytest.raises(ConfigError):
        four_ranks().for_survivors(bad)


# --- added ranks ----------------------------------------------------------------------------


def test_added_rank_runs_the_anchor_until_timed() -> None:
    elche = ElChe(2)
    feed(elche, [100.0, 50.0])
    assert elche.add_rank() == 2
    assert elche.world_size == 3
    assert elche.batch_counts == [10, 20, 10]
    assert elche.smoothed_ms == [100.0, 50.0, None]
    assert elche.recent_batch_share == pytest.approx([10 / 40, 20 / 40, 10 / 40])
    assert feed(elche, [100.0, 50.0, 25.0]) == [10, 20, 40]


def test_added_rank_respects_the_cap() -> None:
    elche = ElChe(2, max_total_batches=30)
    feed(elche, [100.0, 50.0])
    assert not elche.cap_binding
    elche.add_rank()
    # [10, 20, 10] sums to 40: floor([300, 600, 300] / 40) = [7, 15, 7], +1 to the largest.
    assert elche.batch_counts == [7, 16, 7]
    assert elche.cap_binding


def test_added_rank_survives_a_state_round_trip() -> None:
    elche = ElChe(2)
    feed(elche, [50.0, 100.0], rounds=6)  # Stable: rank 1 elected
    elche.add_rank()
    restored = ElChe.from_state(via_json(elche.state()))
    assert restored.state() == elche.state()
    assert restored.anchor_rank == 1
