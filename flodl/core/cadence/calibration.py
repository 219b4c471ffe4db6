"""ElChe's calibration: each rank's time per batch, the anchor rank, how far calibration got.

A window's report (:class:`RankWindow`) becomes one sample per rank: its time over batches 2..n
divided by ``n - 1`` (the first batch is fill, not speed). A rank's time per batch is the mean
of its last 5 valid samples; 5 invalid reports in a row clear them, and a rank left with no
timing that way counts as lost. :class:`Calibration` decides which rank is the *anchor rank*
(the slowest, with hysteresis: see :func:`elect_anchor`) and counts the calibrations (reports
that left the anchor rank with a time per batch), from which the phase follows
(:mod:`flodl.core.cadence.phases`). Pure: no clocks, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from flodl.core.cadence.phases import Phase, phase_for
from flodl.errors import CheckpointError, ConfigError

__all__ = [
    "Calibration",
    "RankWindow",
    "check_per_rank",
    "elect_anchor",
    "window_samples",
]

TRUST_WINDOW = 5
"""A rank's time per batch is the mean of its last 5 valid samples."""
INVALID_CLEARS_AFTER = 5
"""This many invalid reports in a row clear a rank's samples."""
COHORT_SHARE = 0.85
"""Ranks at >= 85% of the slowest time per batch form the slow cohort."""
DOMINANCE = 1.10
"""A challenger must be >= 10% slower than the incumbent anchor rank to unseat it."""


def elect_anchor(smoothed_ms: Sequence[float | None], incumbent: int | None) -> int | None:
    """The anchor rank for these smoothed times per batch (None where a rank has no timing).

    The incumbent stays unless some rank is at least 10% slower than it (or it has no timing);
    otherwise the winner is the lowest-indexed rank of the slow cohort (ranks at >= 85% of the
    slowest time). Returns None when no rank has timing.
    """
    timed = [(rank, ms) for rank, ms in enumerate(smoothed_ms) if ms is not None]
    if not timed:
        return None
    slowest = max(ms for _, ms in timed)
    if incumbent is not None and 0 <= incumbent < len(smoothed_ms):
        incumbent_ms = smoothed_ms[incumbent]
        if incumbent_ms is not None and slowest / incumbent_ms < DOMINANCE:
            return incumbent
    return min(rank for rank, ms in timed if ms / slowest >= COHORT_SHARE)


@attrs.frozen
class RankWindow:
    """What one rank measured over one window (the feed of ``ElChe.report_window``).

    The window's first batch is *fill* (pipeline warm-up, data loader start); its time is
    ``fill_ms`` and it is not a sample of the rank's speed. Over batches 2..n the rank sums
    ``compute_ms`` (time in the training step) and, where it can, ``delivered_ms`` (step time plus
    time waiting for data: what the rank really delivers). ``batches`` counts all n batches.
    """

    batches: int
    fill_ms: float = 0.0
    compute_ms: float = 0.0
    delivered_ms: float | None = None

    @property
    def is_empty(self) -> bool:
        """True when the window holds no usable time (no batch after the fill, or all zero)."""
        return self.batches < 2 or (
            self.fill_ms == 0.0 and self.compute_ms == 0.0 and not self.delivered_ms
        )


def positive_finite(x: float) -> bool:
    return math.isfinite(x) and x > 0.0


def window_samples(windows: Sequence[RankWindow | None], use_delivered: bool) -> list[float | None]:
    """Each rank's time per batch in these windows (None: an invalid report for that rank).

    Delivered time is used only if ``use_delivered`` and every rank that moved has a delivered
    sample; otherwise every rank uses compute time, so the cohort is never mixed.
    """
    movers = [w for w in windows if w is not None and not w.is_empty]
    delivered = use_delivered and bool(movers)
    delivered = delivered and all(w.delivered_ms is not None for w in movers)
    samples: list[float | None] = []
    for window in windows:
        if window is None or window.is_empty:
            samples.append(None)
            continue
        spent = window.delivered_ms if delivered else window.compute_ms
        ms = (spent or 0.0) / (window.batches - 1)
        samples.append(ms if positive_finite(ms) else None)
    return samples


def check_per_rank(name: str, seq: Sequence[object], world_size: int) -> None:
    """A saved per-rank list must have one entry per rank."""
    if len(seq) != world_size:
        raise CheckpointError(f"ElChe state {name} has {len(seq)} entries, not {world_size}")


class _TrustWindow:
    """A rank's last few valid times per batch, and how many reports in a row were invalid."""

    __slots__ = ("misses", "samples")

    def __init__(self, samples: Iterable[float] = (), misses: int = 0) -> None:
        self.samples: deque[float] = deque(samples, maxlen=TRUST_WINDOW)
        self.misses = misses

    def add(self, ms: float) -> None:
        self.samples.append(ms)
        self.misses = 0

    def miss(self) -> None:
        self.misses += 1
        if self.misses >= INVALID_CLEARS_AFTER:
            self.samples.clear()

    @property
    def mean(self) -> float | None:
        if not self.samples:
            return None
        return sum(self.samples) / len(self.samples)

    @property
    def lost(self) -> bool:
        """No timing, and the rank has missed enough reports in a row to count as gone."""
        return not self.samples and self.misses >= INVALID_CLEARS_AFTER


class Calibration:
    """The timings of ``world_size`` ranks, the anchor rank among them, the calibration count."""

    def __init__(self, world_size: int) -> None:
        self._windows = [_TrustWindow() for _ in range(world_size)]
        self._anchor_rank = 0
        self._count = 0

    @property
    def world_size(self) -> int:
        return len(self._windows)

    @property
    def anchor_rank(self) -> int:
        """The slowest rank, as elected (rank 0 until timings elect one)."""
        return self._anchor_rank

    @property
    def count(self) -> int:
        """Reports after which the anchor rank had a measured time per batch."""
        return self._count

    @property
    def calibrated(self) -> bool:
        return self._count >= 1

    @property
    def phase(self) -> Phase:
        return phase_for(self._count)

    @property
    def smoothed_ms(self) -> list[float | None]:
        """Each rank's time per batch (mean of its last 5 valid samples), None if unknown."""
        return [window.mean for window in self._windows]

    @property
    def slow_ms(self) -> float | None:
        """The anchor rank's time per batch, None while it has no timing."""
        return self._windows[self._anchor_rank].mean

    def ingest(self, samples: Sequence[float | None]) -> bool:
        """Take one sample per rank (None: an invalid report); True if the anchor rank changed.

        A lost anchor rank is replaced at once, in any phase; otherwise elections wait for
        Stable. With no timed rank at all, rank 0 stands in.
        """
        before = self._anchor_rank
        for window, sample in zip(self._windows, samples, strict=True):
            if sample is None:
                window.miss()
            else:
                window.add(sample)
        lost = self._windows[self._anchor_rank].lost
        if lost or self.phase >= Phase.STABLE:
            elected = elect_anchor(self.smoothed_ms, None if lost else self._anchor_rank)
            if elected is not None:
                self._anchor_rank = elected
            elif lost:
                self._anchor_rank = 0
        if self.slow_ms is not None:
            self._count += 1
        return self._anchor_rank != before

    def elect_afresh(self) -> None:
        """The anchor rank is gone: the slowest timed rank takes over (rank 0 if none is timed)."""
        elected = elect_anchor(self.smoothed_ms, None)
        self._anchor_rank = 0 if elected is None else elected

    def add_rank(self) -> None:
        """A rank with no timing joins at the end."""
        self._windows.append(_TrustWindow())

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"ElChe rank {rank} out of range for world size {self.world_size}")

    # --- checkpoints ------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The calibration's part of ``ElChe.state()`` (``phase``, ``smoothed_ms`` derived)."""
        return {
            "anchor_rank": self._anchor_rank,
            "phase": self.phase.name,
            "calibration_count": self._count,
            "smoothed_ms": self.smoothed_ms,
            "samples": [list(window.samples) for window in self._windows],
            "misses": [window.misses for window in self._windows],
        }

    @classmethod
    def from_state(cls, d: Mapping[str, Any], world_size: int) -> Calibration:
        """Rebuild from :meth:`state`; raises CheckpointError or ConfigError when it is bad."""
        samples = [[float(ms) for ms in row] for row in d["samples"]]
        misses = [int(m) for m in d["misses"]]
        check_per_rank("samples", samples, world_size)
        check_per_rank("misses", misses, world_size)
        if any(len(row) > TRUST_WINDOW or not all(map(positive_finite, row)) for row in samples):
            raise CheckpointError("ElChe state holds an invalid timing sample")
        if any(m < 0 for m in misses):
            raise CheckpointError("ElChe state holds a negative miss count")
        calibration = cls(world_size)
        calibration._windows = [_TrustWindow(s, m) for s, m in zip(samples, misses, strict=True)]
        anchor_rank = int(d["anchor_rank"])
        calibration.check_rank(anchor_rank)
        calibration._anchor_rank = anchor_rank
        calibration._count = int(d["calibration_count"])
        return calibration
