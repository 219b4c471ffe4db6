"""ElChe's phases: how much timing evidence the cadence rests on.

A phase is a pure function of the calibration count (the number of reports that left the
anchor rank with a measured time per batch). Phases are ordered, so ``phase >= Phase.STABLE``
reads as "at least Stable".
"""

from __future__ import annotations

import enum

WARMUP_AT = 1
"""Calibrations needed to leave Probe."""
STABLE_AT = 5
"""Calibrations needed to reach Stable."""
MATURE_AT = 20
"""Calibrations needed to reach Mature."""


class Phase(enum.IntEnum):
    """Probe (no timing yet) -> Warmup (1st calibration) -> Stable (>= 5) -> Mature (>= 20)."""

    PROBE = 0
    WARMUP = 1
    STABLE = 2
    MATURE = 3


def phase_for(calibration_count: int) -> Phase:
    """The phase reached after ``calibration_count`` calibrations (negative counts are Probe)."""
    if calibration_count >= MATURE_AT:
        return Phase.MATURE
    if calibration_count >= STABLE_AT:
        return Phase.STABLE
    if calibration_count >= WARMUP_AT:
        return Phase.WARMUP
    return Phase.PROBE
