"""The anchor: how many batches ElChe's anchor rank runs per window, and when that changes.

Averaging costs about the same however long the window, so a short window spends a large share
of its time in the average. After every report :meth:`AnchorTuner.stage` measures that share
(the *overhead*: the average's duration over the window; floDl adds the anchor rank's fill
batch, flodl does not) and,
past ``overhead_target``, stages a larger anchor: at most double, never below the initial anchor
nor above ``max_anchor``, only from Stable on (from the 2nd calibration of Warmup at twice the
target), never under the Sync policy or while the window cap binds. A staged anchor is only a
proposal: the convergence guard's verdict on the same round commits it (Stable), vetoes it
(SuppressGrowth) or shrinks the anchor instead (NudgeDown). A veto latches growth off until 5
Stable verdicts in a row. :meth:`AnchorTuner.relax_up` grows the anchor by one when the spread
of speeds allows. Pure: no clocks, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from flodl.core.cadence.guards import NudgeDown, Stable, SuppressGrowth, Verdict
from flodl.core.cadence.phases import Phase, phase_for
from flodl.core.cadence.rounding import ceil_exact, rust_round
from flodl.errors import CheckpointError, ConfigError

__all__ = ["AnchorTuner"]

REARM_AFTER_STABLE = 5
"""Stable verdicts in a row that re-arm latched anchor growth."""
MAX_GROWTH = 2.0
"""One auto-tune step at most doubles the anchor."""
OVERHEAD_TARGET_RANGE = (0.01, 0.5)
"""``overhead_target`` is clamped into this range."""
NUDGE_FACTOR_RANGE = (0.1, 1.0)
"""``nudge_down`` clamps its factor into this range."""


class AnchorTuner:
    """The anchor, its bounds, and the growth staged or latched off (module docstring).

    Each method that moves the anchor says whether it did, so that ElChe recomputes the counts
    after every move.

    Raises:
        ConfigError: anchor < 1, max_anchor < anchor or a NaN overhead target.
    """

    def __init__(
        self,
        anchor: int,
        max_anchor: int,
        overhead_target: float,
        *,
        sync_policy: bool,
        relax_up_on_stable: bool,
    ) -> None:
        if anchor < 1:
            raise ConfigError(f"ElChe anchor must be >= 1, got {anchor}")
        if max_anchor < anchor:
            raise ConfigError(f"ElChe max_anchor ({max_anchor}) must be >= anchor ({anchor})")
        if math.isnan(overhead_target):
            raise ConfigError("ElChe overhead_target must be a number, got NaN")
        low, high = OVERHEAD_TARGET_RANGE
        self.anchor = anchor
        self.min_anchor = anchor
        self.max_anchor = max_anchor
        self.overhead_target = min(max(overhead_target, low), high)
        self.sync_policy = sync_policy
        self.relax_up_on_stable = relax_up_on_stable
        self.staged: int | None = None
        self.overhead: float | None = None
        self.growth_latched = False
        self._stable_streak = 0

    def stage(
        self,
        slow_ms: float | None,
        reduce_ms: float,
        *,
        calibration_count: int,
        cap_binding: bool,
    ) -> None:
        """Measure the overhead of the window just reported; stage a larger anchor if it is
        too high. ``slow_ms`` is the anchor rank's time per batch."""
        self.staged = None
        self.overhead = None
        if slow_ms is None or not (math.isfinite(reduce_ms) and reduce_ms >= 0.0):
            return
        # The window's fill batch is not averaging cost (floDl counts it): it is about as long
        # as any other batch, and a script's own work after an average (an evaluation of the
        # shared model) lands in it. Counted, it alone made a 10-batch window look like 10%
        # overhead and doubled the anchor while averaging took 0.5% of the time.
        spent = reduce_ms
        self.overhead = overhead = spent / (self.anchor * slow_ms + spent)
        if self.sync_policy or cap_binding or self.growth_latched:
            return
        phase = phase_for(calibration_count)
        target = self.overhead_target
        if phase >= Phase.STABLE:
            fires = overhead > target
        elif phase == Phase.WARMUP and calibration_count >= 2:
            fires = overhead > 2.0 * target
        else:
            fires = False
        if not fires:
            return
        grown = ceil_exact(self.anchor * min(overhead / target, MAX_GROWTH))
        proposal = min(max(grown, self.min_anchor), self.max_anchor)
        if proposal > self.anchor:
            self.staged = proposal

    def judge(self, verdict: Verdict) -> bool:
        """Take the guard's verdict on the staged growth; True if the anchor grew.

        Stable commits it (and the 5th Stable in a row re-arms a latch); SuppressGrowth and
        NudgeDown discard it and latch growth off (the nudge itself is :meth:`nudge_down`).
        """
        if isinstance(verdict, Stable):
            staged, self.staged = self.staged, None
            if self.growth_latched:
                self._stable_streak += 1
                if self._stable_streak >= REARM_AFTER_STABLE:
                    self.growth_latched = False
                    self._stable_streak = 0
            if staged is not None and staged > self.anchor:
                self.anchor = staged
                return True
            return False
        if isinstance(verdict, SuppressGrowth | NudgeDown):
            self.staged = None
            self.growth_latched = True
            self._stable_streak = 0
            return False
        raise ConfigError(f"not a guard verdict: {verdict!r}")

    def nudge_down(self, factor: float) -> bool:
        """Shrink the anchor to ``max(1, min(a, ceil(a * clamp(factor, 0.1, 1))))``; True if
        it shrank. May go below ``min_anchor``; a NaN factor changes nothing; staged growth is
        dropped."""
        if math.isnan(factor):
            return False
        self.staged = None
        low, high = NUDGE_FACTOR_RANGE
        factor = min(max(factor, low), high)
        shrunk = max(1, min(self.anchor, ceil_exact(self.anchor * factor)))
        if shrunk == self.anchor:
            return False
        self.anchor = shrunk
        return True

    def carry_over(self, before_ms: float, after_ms: float) -> bool:
        """The anchor rank changed from one taking ``before_ms`` per batch to one taking
        ``after_ms``: scale the anchor so that a window lasts as long as before, within
        ``[min_anchor, max_anchor]`` (without it, an anchor grown on a fast rank would make
        windows several times longer once a slow rank took over). True if it changed."""
        if not (before_ms > 0.0 and after_ms > 0.0):
            return False
        scaled = rust_round(self.anchor * before_ms / after_ms)
        carried = min(max(scaled, self.min_anchor), self.max_anchor)
        if carried == self.anchor:
            return False
        self.anchor = carried
        self.staged = None
        return True

    def relax_up(self, smoothed_ms: Sequence[float | None], max_batch_diff: int | None) -> bool:
        """Grow the anchor by one if below ``max_anchor`` and the spread allows; True if grown.

        With ``max_batch_diff = M`` the step needs timing and
        ``round((a + 1) * max_ms / min_ms) - (a + 1) <= M``.
        """
        grown = self.anchor + 1
        if grown > self.max_anchor:
            return False
        if max_batch_diff is not None:
            timed = [ms for ms in smoothed_ms if ms is not None]
            if not timed:
                return False
            if rust_round(grown * max(timed) / min(timed)) - grown > max_batch_diff:
                return False
        self.anchor = grown
        return True

    # --- checkpoints ------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The anchor's part of ``ElChe.state()``."""
        return {
            "anchor": self.anchor,
            "min_anchor": self.min_anchor,
            "max_anchor": self.max_anchor,
            "overhead_target": self.overhead_target,
            "sync_policy": self.sync_policy,
            "relax_up_on_stable": self.relax_up_on_stable,
            "staged_anchor": self.staged,
            "overhead": self.overhead,
            "growth_latched": self.growth_latched,
            "stable_streak": self._stable_streak,
        }

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> AnchorTuner:
        """Rebuild from :meth:`state`; raises CheckpointError or ConfigError when it is bad."""
        tuner = cls(
            int(d["min_anchor"]),
            int(d["max_anchor"]),
            float(d["overhead_target"]),
            sync_policy=bool(d["sync_policy"]),
            relax_up_on_stable=bool(d["relax_up_on_stable"]),
        )
        anchor = int(d["anchor"])
        if not 1 <= anchor <= tuner.max_anchor:
            raise CheckpointError(f"ElChe state anchor {anchor} outside [1, max_anchor]")
        tuner.anchor = anchor
        staged = d["staged_anchor"]
        tuner.staged = None if staged is None else int(staged)
        overhead = d["overhead"]
        tuner.overhead = None if overhead is None else float(overhead)
        tuner.growth_latched = bool(d["growth_latched"])
        tuner._stable_streak = int(d["stable_streak"])
        return tuner
