"""Time to quality taken apart: a run's pace and what each of its steps is worth.

A multi-rank run can reach a loss sooner than the fast rank alone (``solo``) in two ways: by
taking more of rank 0's steps in the budget (its *pace*), or by making each step worth more
(the other ranks' samples, averaged in). The two figures here tell which one a run gained or
lost on:

* ``pace_vs_solo``: rank 0's steps in the budget over solo's median steps (below 1: the
  run's rank 0 trained slower than alone, from waiting, averaging, or the machine's contention);
* ``gain_at_same_steps``: solo's loss at the run's number of rank-0 steps (read off each solo
  curve, linear between its points, then the median) less the run's loss at budget; above 0,
  each step of the run is worth more than a step alone.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["loss_at_step", "take_apart"]


def loss_at_step(curve: Sequence[dict[str, Any]], step: int) -> float | None:
    """The loss of ``curve`` at ``step`` steps, linear between the two points around it (None:
    outside the curve)."""
    for before, after in itertools.pairwise(curve):
        if before["step"] <= step <= after["step"]:
            if after["step"] == before["step"]:
                return float(after["loss"])
            share = (step - before["step"]) / (after["step"] - before["step"])
            return float(before["loss"] + share * (after["loss"] - before["loss"]))
    return None


def take_apart(
    run: dict[str, Any], solo_runs: Sequence[dict[str, Any]]
) -> tuple[float | None, float | None]:
    """``(pace_vs_solo, gain_at_same_steps)`` of ``run`` against ``solo_runs`` (each with its
    ``curve`` and ``steps``); None where there is no solo run to compare with."""
    solos = [s for s in solo_runs if "curve" in s]
    steps = run.get("steps")
    if not solos or not steps:
        return None, None
    pace = round(steps / statistics.median(s["steps"] for s in solos), 3)
    at_steps = [loss_at_step(s["curve"], steps) for s in solos]
    known = [x for x in at_steps if x is not None]
    if not known:
        return pace, None
    return pace, round(statistics.median(known) - run["loss_at_budget"], 4)
