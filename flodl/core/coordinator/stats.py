"""Per-rank counters the coordinator keeps for summaries: :class:`RankStats`.

The machine's parts write them as the run goes (reports, joins, losses); the shells and
everything after a run read them through :class:`~flodl.core.coordinator.record.RunRecord`.
"""

from __future__ import annotations

import math

import attrs

__all__ = ["RankStats"]


@attrs.define
class RankStats:
    """Per-rank counters kept for summaries."""

    batches: int = 0
    syncs: int = 0
    last_loss: float = math.nan
    lr: float | None = None
    joined_at: float | None = None
    lost_at: float | None = None
    loss_cause: str | None = None
