"""Cadence's idle fill: how many more batches a rank that ran out of work before the round gets.

ElChe sizes each window so that every rank should finish together, but measured speeds drift
(most of all on shared machines), so some ranks run out early. Rather than leave such a rank
waiting at the barrier, the coordinator hands it as many batches as fit, at its speed, in the
time the others still need, rounded to the nearest whole batch: none when that is under half
a batch (the extra batch would hold the round up for longer than the rank would have waited).

The rank that decides is the one still working whose plan was expected to take longest (the
*critical* rank); its remaining time is estimated from its own progress. Ranks are sorted once
per window and a cursor skips those that are done, so each query is amortised O(1), which
matters with a thousand ranks going idle one after another. Pure: no I/O, time is an argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence


class IdleFill:
    """The fill decision for the current window (see the module docstring)."""

    def __init__(self) -> None:
        self._ms: Mapping[int, float] = {}
        self._by_span: list[int] = []
        self._cursor = 0
        self._started_at = 0.0
        self._plan: Sequence[int] = ()

    def begin_window(
        self, plan: Sequence[int], ms_per_batch: Mapping[int, float], now: float
    ) -> None:
        """A window was dispatched at ``now``: ``plan[rank]`` batches at ElChe's timings.

        Ranks with a plan but no timing make the window uncalibrated: no fill in it.
        """
        self._plan = plan
        self._ms = ms_per_batch
        self._started_at = now
        self._cursor = 0
        planned = [rank for rank, count in enumerate(plan) if count > 0]
        if any(rank not in ms_per_batch for rank in planned):
            self._by_span = []
            return
        self._by_span = sorted(planned, key=lambda rank: -plan[rank] * ms_per_batch[rank])

    def extra_batches(
        self,
        rank: int,
        now: float,
        steps_of: Callable[[int], int],
        last_report_at: Callable[[int], float | None],
        working: Callable[[int], bool],
    ) -> int:
        """How many batches ``rank`` (out of work, round not triggered) should get now.

        ``steps_of(r)``: batches ``r`` ran in this window; ``last_report_at(r)``: when its last
        batch report came (None: none yet this window); ``working(r)``: ``r`` is still a live
        member. 0 when uncalibrated or when every planned rank is done.
        """
        ms = self._ms.get(rank)
        if ms is None or ms <= 0 or not self._by_span:
            return 0
        while self._cursor < len(self._by_span):
            critical = self._by_span[self._cursor]
            left = self._plan[critical] - steps_of(critical)
            if left > 0 and working(critical):
                break
            self._cursor += 1
        else:
            return 0
        critical_ms = self._ms[critical]
        since = last_report_at(critical)
        started = self._started_at if since is None else since
        remaining_ms = left * critical_ms - (now - started) * 1000.0
        if remaining_ms < -critical_ms / 2.0:
            remaining_ms = critical_ms / 2.0  # long overdue: its batch may take a while yet
        return max(math.floor(remaining_ms / ms + 0.5), 0)
