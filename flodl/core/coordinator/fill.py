"""Cadence's idle fill: how many more batches a rank that ran out of work before the round gets.

ElChe sizes each window so that every rank should finish together, but measured speeds drift
(most of all on shared machines), so some ranks run out early. Rather than leave such a rank
waiting at the barrier, the coordinator hands it as many batches as fit, at its speed, in the
time the others still need, rounded to the nearest whole batch: none when that is under half
a batch (the extra batch would hold the round up for longer than the rank would have waited).

The rank that decides is the one still working whose plan was expected to take longest (the
*critical* rank); its remaining time is estimated from its own progress. Ranks are sorted
once per window and a cursor skips those that are done, so each query is amortised O(1),
which matters with a thousand ranks going idle one after another. Pure: no I/O, time is an
argument.

A critical rank that has stalled (stopped, swapping, about to be declared dead) must not be
read as "about to finish": the others would be handed batch after batch and train the rest of
the run without averaging while it waits for its heartbeat verdict (seen: six of eight epochs
run by one rank during a 2 s detection). So a critical rank overdue by more than
``STALLED_AFTER_BATCHES`` of its own batches gets no one filled in its shadow (the others
wait, as they would without the fill), and as a backstop a rank's extra batches in one window
never add up to more than ``MAX_FILL_WINDOWS`` times the window's largest count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

STALLED_AFTER_BATCHES = 4.0
"""A critical rank this many of its batch times past its expected finish counts as stalled."""

MAX_FILL_WINDOWS = 4
"""A rank's extra batches in one window add up to at most this many times the largest count."""


class IdleFill:
    """The fill decision for the current window (see the module docstring)."""

    def __init__(self) -> None:
        self._ms: Mapping[int, float] = {}
        self._by_span: list[int] = []
        self._cursor = 0
        self._started_at = 0.0
        self._plan: Sequence[int] = ()
        self._largest = 0
        """``max(plan)``, kept with the plan: asked on every query, and a scan of a
        4,096-rank plan per completion frame made each window end quadratic."""
        self._last_report: dict[int, float] = {}
        self._pace: dict[int, float] = {}
        """Uncalibrated windows: each rank's latest batch time (ms) in this window."""
        self._slowest: int | None = None
        self._unreported = 0

    @property
    def calibrated(self) -> bool:
        """The current window has ElChe timings for every planned rank."""
        return bool(self._by_span)

    def begin_window(
        self, plan: Sequence[int], ms_per_batch: Mapping[int, float], now: float
    ) -> None:
        """A window was dispatched at ``now``: ``plan[rank]`` batches at ElChe's timings.

        When a planned rank has no timing yet (the run's first windows), the window is
        *uncalibrated*: the decision then uses the batch times reported in the window itself.
        """
        self._plan = plan
        self._largest = max(plan, default=0)
        self._ms = ms_per_batch
        self._started_at = now
        self._cursor = 0
        self._last_report = {}
        self._pace = {}
        self._slowest = None
        planned = [rank for rank, count in enumerate(plan) if count > 0]
        self._unreported = len(planned)
        if any(rank not in ms_per_batch for rank in planned):
            self._by_span = []
            return
        self._by_span = sorted(planned, key=lambda rank: -plan[rank] * ms_per_batch[rank])

    def planned(self, count: int) -> None:
        """A rank's plan in the current window grew to ``count`` (a dead rank's batches were
        handed to it); the plan itself is the sequence given to :meth:`begin_window`."""
        self._largest = max(self._largest, count)

    def on_batch(self, rank: int, now: float, batch_ms: float) -> None:
        """``rank`` reported a finished batch that took ``batch_ms``. O(1)."""
        self.on_batches(rank, now, (batch_ms,))

    def on_batches(self, rank: int, now: float, batches_ms: Sequence[float]) -> None:
        """:meth:`on_batch` for each of ``batches_ms`` (at least one), in order, all at ``now``.

        The same state in one step: once ``rank`` is the slowest it stays so (its own pace is
        what it is compared with), and before that it becomes so as soon as one of its batches
        took longer than the slowest's pace.
        """
        self._last_report[rank] = now
        if self._by_span:
            return
        if rank not in self._pace and rank < len(self._plan) and self._plan[rank] > 0:
            self._unreported -= 1
        slowest = self._slowest
        if slowest is None or (slowest != rank and max(batches_ms) > self._pace[slowest]):
            self._slowest = rank
        self._pace[rank] = batches_ms[-1]

    def extra_batches(
        self,
        rank: int,
        now: float,
        steps_of: Callable[[int], int],
        working: Callable[[int], bool],
    ) -> int:
        """How many batches ``rank`` (out of work, round not triggered) should get now.

        ``steps_of(r)``: batches ``r`` ran in this window (``rank``'s own, asked when it is
        out of work, include every extra batch it was given); ``working(r)``: ``r`` is still a
        live member. 0 when every planned rank is done or the others are about to be, when
        the critical rank has stalled, or when ``rank`` has had its bound (module docstring).
        """
        if not 0 <= rank < len(self._plan):
            return 0
        given = max(steps_of(rank) - self._plan[rank], 0)
        budget = MAX_FILL_WINDOWS * self._largest - given
        if budget <= 0:
            return 0
        if self._by_span:
            ms = self._ms.get(rank)
            found = self._critical(steps_of, working)
            if found is None or ms is None:
                return 0
            critical, left = found
            remaining_ms = self._remaining_ms(critical, left, self._ms[critical], now)
        else:
            ms = self._pace.get(rank)
            if ms is None:
                return 0
            remaining_ms = self._uncalibrated_remaining_ms(now, steps_of, working)
        if ms <= 0:
            return 0
        batches = max(math.floor(remaining_ms / ms + 0.5), 0)
        if not self._by_span:
            batches = min(batches, self._plan[rank])  # guesses: at most its own count again
        return min(batches, budget)

    def _critical(
        self, steps_of: Callable[[int], int], working: Callable[[int], bool]
    ) -> tuple[int, int] | None:
        """The unfinished member with the longest planned span, and its batches left."""
        while self._cursor < len(self._by_span):
            critical = self._by_span[self._cursor]
            left = self._plan[critical] - steps_of(critical)
            if left > 0 and working(critical):
                return critical, left
            self._cursor += 1
        return None

    def _remaining_ms(self, rank: int, left: int, ms: float, now: float) -> float:
        """Time ``rank`` still needs for its ``left`` batches of ``ms`` each; 0 once it has
        stalled (overdue by more than ``STALLED_AFTER_BATCHES`` batches)."""
        started = self._last_report.get(rank, self._started_at)
        remaining_ms = left * ms - (now - started) * 1000.0
        if remaining_ms < -STALLED_AFTER_BATCHES * ms:
            return 0.0
        if remaining_ms < -ms / 2.0:
            remaining_ms = ms / 2.0  # overdue: its batch may take a while yet
        return remaining_ms

    def _uncalibrated_remaining_ms(
        self, now: float, steps_of: Callable[[int], int], working: Callable[[int], bool]
    ) -> float:
        elapsed_ms = (now - self._started_at) * 1000.0
        if self._unreported > 0:
            # A rank without a single batch yet takes longer than the whole window so far
            # per batch: at least that again for every batch after the one it is running.
            return max(self._largest - 1, 0) * elapsed_ms
        slowest = self._slowest
        if slowest is None or not working(slowest):
            return 0.0
        left = self._plan[slowest] - steps_of(slowest)
        if left <= 0:
            return 0.0  # the slowest by pace is done: the rest should be too
        return self._remaining_ms(slowest, left, self._pace[slowest], now)
