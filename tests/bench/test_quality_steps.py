"""The quality bench's take-apart figures: a run's pace against the fast rank alone and what
each of its steps is worth, read off the solo runs' curves."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from quality_steps import loss_at_step, take_apart


def curve(*points: tuple[int, float]) -> list[dict[str, Any]]:
    return [{"t": float(step), "step": step, "loss": loss} for step, loss in points]


SOLO = curve((0, 5.0), (100, 3.0), (200, 2.0))


def test_loss_at_a_step_is_read_linearly_between_the_points_around_it() -> None:
    assert loss_at_step(SOLO, 100) == 3.0
    assert loss_at_step(SOLO, 150) == 2.5
    assert loss_at_step(SOLO, 50) == 4.0
    assert loss_at_step(SOLO, 201) is None  # past the curve: unknown, not extrapolated


def test_a_run_taken_apart_into_its_pace_and_its_gain_per_step() -> None:
    solos = [{"curve": SOLO, "steps": 200}, {"curve": curve((0, 5.0), (200, 2.2)), "steps": 200}]
    # Half the pace of the solo runs, and at 100 steps a loss the solo runs reach later.
    run = {"curve": curve((0, 5.0), (100, 2.9)), "steps": 100, "loss_at_budget": 2.9}
    pace, gain = take_apart(run, solos)
    assert pace == 0.5
    # Solo at 100 steps: 3.0 and 3.6, median 3.3; the run is 0.4 below it.
    assert gain == 0.4
    slower_per_step = {"curve": curve((0, 5.0), (100, 3.5)), "steps": 100, "loss_at_budget": 3.5}
    assert take_apart(slower_per_step, solos) == (0.5, -0.2)


def test_without_solo_runs_there_is_nothing_to_compare_with() -> None:
    run = {"curve": SOLO, "steps": 200, "loss_at_budget": 2.0}
    assert take_apart(run, []) == (None, None)
    past = {"curve": SOLO, "steps": 500, "loss_at_budget": 1.0}  # more steps than any solo
    assert take_apart(past, [{"curve": SOLO, "steps": 200}]) == (2.5, None)
