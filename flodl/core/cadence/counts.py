"""ElChe's counts: how many batches each rank should run per window, and how the counts get there.

A rank's *target* is the anchor scaled by how much faster it is than the anchor rank (at most
64x); a rank with no timing, and every rank while the anchor rank has none, targets the anchor
itself. :class:`Counts` moves the counts toward their targets: jitter under 5% of a count leaves
it where it is (unless the caller retargets: a first calibration, a new anchor or anchor rank),
a move can be bounded by ``max_batch_diff``, and counts that add up to more than the window cap
are scaled down to it. The last 10 count vectors give each rank's recent share of the batches.
Pure: no clocks, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from flodl.core.cadence.calibration import check_per_rank
from flodl.core.cadence.rounding import rust_round
from flodl.errors import CheckpointError, ConfigError

__all__ = ["Counts", "speed_targets"]

MAX_SPEEDUP = 64.0
"""No rank runs more than 64x the anchor's batches."""
DEAD_ZONE = 0.05
"""Timing jitter below 5% of a rank's count does not change it."""
SHARE_HISTORY = 10
"""``Counts.recent_share`` averages the last 10 count vectors."""


def speed_targets(anchor: int, smoothed_ms: Sequence[float | None], anchor_rank: int) -> list[int]:
    """Ideal counts: proportional to speed once timed, the anchor for everyone before."""
    slow = smoothed_ms[anchor_rank]
    if slow is None:
        return [anchor] * len(smoothed_ms)
    targets = []
    for rank, ms in enumerate(smoothed_ms):
        if ms is None or rank == anchor_rank or math.isclose(ms, slow):
            targets.append(anchor)
        else:
            targets.append(max(1, rust_round(anchor * min(slow / ms, MAX_SPEEDUP))))
    return targets


class Counts:
    """The per-rank counts of the next window, under a step bound and the window cap.

    Raises:
        ConfigError: max_batch_diff < 0 or max_total < 1.
    """

    def __init__(
        self, world_size: int, anchor: int, *, max_batch_diff: int | None, max_total: int | None
    ) -> None:
        if max_batch_diff is not None and max_batch_diff < 0:
            raise ConfigError(f"ElChe max_batch_diff must be >= 0, got {max_batch_diff}")
        _check_cap(max_total)
        self.max_batch_diff = max_batch_diff
        self._max_total = max_total
        self._values = [anchor] * world_size
        self._cap_binding = False
        self._history: deque[list[int]] = deque(maxlen=SHARE_HISTORY)
        self._apply_cap()

    @property
    def values(self) -> list[int]:
        """A copy of the counts (every entry >= 1)."""
        return list(self._values)

    @property
    def max_total(self) -> int | None:
        """The window cap (None: no cap)."""
        return self._max_total

    @property
    def cap_binding(self) -> bool:
        """True while the window cap scaled the counts down."""
        return self._cap_binding

    @property
    def recent_share(self) -> list[float]:
        """Each rank's share of the batches over the last 10 recorded count vectors."""
        rows = list(self._history) or [self._values]
        means = [sum(column) / len(rows) for column in zip(*rows, strict=True)]
        total = sum(means)
        return [m / total for m in means]

    def move_toward(
        self, targets: Sequence[int], *, retarget: bool, step_clamp: bool, anchor_rank: int
    ) -> None:
        """Move each count toward its target, then apply the cap.

        The dead zone only filters timing jitter, so it is skipped with ``retarget`` and for
        the anchor rank, whose target is the anchor itself. ``step_clamp`` bounds each move by
        max_batch_diff.
        """
        new_values = []
        for rank, (target, current) in enumerate(zip(targets, self._values, strict=True)):
            count = target
            jitter = abs(target - current) <= DEAD_ZONE * current
            if jitter and not retarget and rank != anchor_rank:
                count = current
            if step_clamp and self.max_batch_diff is not None:
                step = self.max_batch_diff
                count = current + max(-step, min(step, count - current))
            new_values.append(count)
        self._values = new_values
        self._apply_cap()

    def _apply_cap(self) -> None:
        cap = self._max_total
        if cap is None or sum(self._values) <= cap:
            self._cap_binding = False
            return
        scaled = _scale_down(self._values, cap)
        largest = self._values.index(max(self._values))
        scaled[largest] += max(0, cap - sum(scaled))
        self._values = scaled
        self._cap_binding = True

    def set_cap(self, max_total: int | None) -> None:
        """Cap the sum of the counts (None removes the cap); a lower cap applies at once."""
        _check_cap(max_total)
        self._max_total = max_total
        self._apply_cap()

    def record(self) -> None:
        """Remember the counts of a report for :attr:`recent_share`."""
        self._history.append(list(self._values))

    def add(self, count: int) -> None:
        """A rank joins at the end with ``count`` (in the history too); the cap is re-applied."""
        self._values.append(count)
        for row in self._history:
            row.append(count)
        self._apply_cap()

    # --- checkpoints ------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The counts' part of ``ElChe.state()``."""
        return {
            "max_batch_diff": self.max_batch_diff,
            "max_total_batches": self._max_total,
            "batch_counts": list(self._values),
            "cap_binding": self._cap_binding,
            "history": [list(row) for row in self._history],
        }

    @classmethod
    def from_state(cls, d: Mapping[str, Any], world_size: int) -> Counts:
        """Rebuild from :meth:`state`; raises CheckpointError or ConfigError when it is bad."""
        values = [int(c) for c in d["batch_counts"]]
        history = [[int(c) for c in row] for row in d["history"]]
        check_per_rank("batch_counts", values, world_size)
        if any(c < 1 for c in values):
            raise CheckpointError("ElChe state holds a count < 1")
        if len(history) > SHARE_HISTORY or any(len(row) != world_size for row in history):
            raise CheckpointError("ElChe state history does not match the world size")
        counts = cls(
            world_size,
            1,
            max_batch_diff=_opt_int(d["max_batch_diff"]),
            max_total=_opt_int(d["max_total_batches"]),
        )
        counts._values = values
        counts._history = deque(history, maxlen=SHARE_HISTORY)
        counts._cap_binding = bool(d["cap_binding"])
        return counts


def _check_cap(max_total: int | None) -> None:
    if max_total is not None and max_total < 1:
        raise ConfigError(f"ElChe max_total_batches must be >= 1, got {max_total}")


def _scale_down(counts: Sequence[int], limit: int) -> list[int]:
    """Counts scaled by ``limit / sum(counts)``, floored, each at least 1 (exact integers).

    Where raising a count to 1 overshoots ``limit``, the overshoot is taken from the largest
    counts, so the sum is at most ``max(limit, len(counts))``.
    """
    total = sum(counts)
    scaled = [max(1, c * limit // total) for c in counts]
    for _ in range(sum(scaled) - limit):
        largest = scaled.index(max(scaled))
        if scaled[largest] == 1:
            break
        scaled[largest] -= 1
    return scaled


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
