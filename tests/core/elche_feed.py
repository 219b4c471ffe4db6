"""Feeding ElChe in tests the way the coordinator machine does: one RankWindow per rank.

A test that thinks in "rank r ran n batches in w ms" reports a window of ``n + 1`` batches
whose first (the fill, left out of the speed) cost nothing, so the rank's sample is
``w / n``, and a zero or non-finite time, or no batch, is an invalid report for that rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from flodl.core.cadence.elche import ElChe, RankWindow


def report(
    elche: ElChe, wall_ms: Sequence[float], batches: Sequence[int], sync_ms: float = 0.0
) -> list[int]:
    """Report one window in which rank r ran ``batches[r]`` batches in ``wall_ms[r]``; the
    new counts. ``sync_ms``: the last averaging's duration (auto-tune)."""
    windows = [RankWindow(n + 1, compute_ms=wall) for wall, n in zip(wall_ms, batches, strict=True)]
    return elche.report_window(windows, sync_ms, use_delivered=False)


def feed(elche: ElChe, ms: Sequence[float], rounds: int = 1, sync_ms: float = 0.0) -> list[int]:
    """Report ``rounds`` windows in which rank r ran its count at ``ms[r]`` per batch."""
    for _ in range(rounds):
        counts = elche.batch_counts
        report(elche, [c * m for c, m in zip(counts, ms, strict=True)], counts, sync_ms)
    return elche.batch_counts
