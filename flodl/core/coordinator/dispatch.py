"""The work in hand: what each member is handed per window, what it reports, which epochs close.

Each window hands every member its count of batches as spans of the run's
:class:`~flodl.core.coordinator.workload.Workload` (the *plan*), and tallies what the member
reports: the window's first batch is fill, the others compute time, and each completion frame
(``Metrics``) adds the delivered wall time of the chunk it closes. A member that runs out of work
owes a completion frame; under Cadence it may also be handed extra batches while the others still
work (the idle fill, :mod:`flodl.core.coordinator.fill`), and those are awaited too.
:class:`Dispatch` decides those hand-outs, moves a dead member's unfinished batches to the
survivors, turns a window's tallies into ElChe's reports, and closes an epoch once all its batches
are done and reported. Pure: no clocks, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from flodl.core.cadence.elche import RankWindow
from flodl.core.common.job import Job
from flodl.core.coordinator.effects import Broadcast, Effect, Send
from flodl.core.coordinator.epochs import EpochTallies
from flodl.core.coordinator.fill import IdleFill
from flodl.core.coordinator.timeline import EventKind, Timeline
from flodl.core.coordinator.workload import Workload, span_batches
from flodl.wire.messages import Batch, Metrics

__all__ = ["Dispatch"]


@attrs.define
class _Tally:
    """What one rank did in the current window."""

    batches: int = 0
    fill_ms: float = 0.0
    compute_ms: float = 0.0
    delivered_ms: float = 0.0
    chunk_reports: int = 0

    def reset(self) -> None:
        """Back to an empty window (in place: no allocation per rank per round)."""
        self.batches = self.chunk_reports = 0
        self.fill_ms = self.compute_ms = self.delivered_ms = 0.0


class Dispatch:
    """The run's work and the window of it in progress (module docstring).

    ``fills``: the run hands out idle-fill batches at all (Cadence, without throttling).
    """

    def __init__(self, world_size: int, timeline: Timeline, *, fills: bool) -> None:
        self._world_size = world_size
        self._timeline = timeline
        self._fills = fills
        self.work: Workload | None = None
        self.plan = [0] * world_size
        """Batches each rank was handed in the current window."""
        self.epoch_results: list[dict[str, Any]] = []
        """The summary of every epoch closed so far."""
        self._tallies = [_Tally() for _ in range(world_size)]
        self._awaiting_completion: set[int] = set()
        self._filling: set[int] = set()
        """Ranks running an extra batch of the idle fill: the round waits for it."""
        self._idle_fill = IdleFill()
        self._epochs = EpochTallies()

    def open(self, job: Job, first_epoch: int) -> None:
        """Training starts: the job's epochs from ``first_epoch`` on are the work."""
        self.work = Workload(job.dataset_size, job.batch_size, job.epochs, first_epoch=first_epoch)

    # --- windows ----------------------------------------------------------------------------

    def new_window(self) -> None:
        """A round started: the tallies start again and nothing is awaited."""
        for tally in self._tallies:
            tally.reset()
        self._awaiting_completion.clear()
        self._filling.clear()

    def hand_out(
        self, counts: Mapping[int, int], ms_per_batch: Mapping[int, float], now: float
    ) -> list[Effect]:
        """The next window's work: ``counts[rank]`` batches each (ElChe's timings alongside)."""
        assert self.work is not None
        self.plan = [0] * self._world_size
        effects: list[Effect] = []
        for rank, message in self.work.dispatch_window(counts):
            self.plan[rank] += span_batches(message, self.work.batch_size)
            effects.append(Send(rank, message))
        self._idle_fill.begin_window(self.plan, ms_per_batch, now)
        return effects

    def on_batch(self, rank: int, batch: Batch, now: float) -> bool:
        """A member finished a batch; True if that was the last of the work it was handed."""
        assert self.work is not None
        tally = self._tallies[rank]
        wall = batch.batch_ms + batch.data_ms
        if tally.batches == 0:
            tally.fill_ms = wall
        else:
            tally.compute_ms += batch.batch_ms
        tally.batches += 1
        self._idle_fill.on_batch(rank, now, wall)
        epoch, left = self.work.complete(rank)
        if epoch is None:
            return False
        self._epochs.on_batch(epoch, batch.batch_loss)
        if left != 0:
            return False
        self._awaiting_completion.add(rank)
        self._filling.discard(rank)
        return True

    def on_batches(
        self,
        rank: int,
        batches_ms: Sequence[float],
        walls: Sequence[float],
        losses: Sequence[float],
        now: float,
    ) -> None:
        """:meth:`on_batch` for several finished batches of ``rank`` (oldest first; ``walls``:
        each one's batch plus data time), none of them its last: the caller checked that the
        rank holds more than ``len(batches_ms)`` (:meth:`in_flight`)."""
        assert self.work is not None
        tally = self._tallies[rank]
        compute_ms = tally.compute_ms
        first = 0
        if tally.batches == 0:
            tally.fill_ms = walls[0]
            first = 1
        for batch_ms in batches_ms[first:]:  # in order: the same float sum as one at a time
            compute_ms += batch_ms
        tally.compute_ms = compute_ms
        tally.batches += len(walls)
        self._idle_fill.on_batches(rank, now, walls)
        taken = 0
        for epoch, count in self.work.complete_many(rank, len(walls)):
            self._epochs.on_batches(epoch, losses[taken : taken + count])
            taken += count

    def in_flight(self, rank: int) -> int:
        """Batches ``rank`` was handed and has not reported, over every epoch."""
        return 0 if self.work is None else self.work.in_flight(rank)

    def on_completion(self, rank: int, metrics: Metrics) -> None:
        """A member's completion frame for the chunk it just finished."""
        tally = self._tallies[rank]
        tally.delivered_ms += metrics.epoch_ms
        tally.chunk_reports += 1
        self._awaiting_completion.discard(rank)
        self._epochs.on_metrics(rank, metrics)

    def awaits(self, working: Callable[[int], bool]) -> bool:
        """A rank still ``working`` owes a completion frame or runs an idle-fill batch."""
        if not self._awaiting_completion and not self._filling:
            return False  # the usual case, asked on every report
        # Each set on its own, stopping at the first working rank: no union is built (while
        # thousands of ranks run fill batches, building one per completion frame made each
        # window end quadratic).
        return any(working(rank) for rank in self._awaiting_completion) or any(
            working(rank) for rank in self._filling
        )

    def fill(
        self,
        rank: int,
        now: float,
        *,
        steps_of: Callable[[int], int],
        working: Callable[[int], bool],
    ) -> list[Effect]:
        """The extra batches for ``rank``, out of work before the round triggered (the idle
        fill's decision; ``steps_of(r)``: batches ``r`` ran in this window)."""
        if not self._fills or self.work is None or self.work.exhausted:
            return []
        batches = self._idle_fill.extra_batches(rank, now, steps_of=steps_of, working=working)
        if batches <= 0:
            return []
        sends: list[Effect] = [
            Send(r, message) for r, message in self.work.dispatch_window({rank: batches})
        ]
        if sends:
            self._filling.add(rank)  # a round triggered meanwhile waits for this batch
        return sends

    def reassign(self, dead: int, survivors: Sequence[int]) -> list[Effect]:
        """``dead`` is gone: its unfinished batches go to ``survivors``; nothing more is awaited."""
        effects: list[Effect] = []
        if self.work is not None and survivors:
            for target, extension in self.work.reassign(dead, survivors):
                self.plan[target] += span_batches(extension, self.work.batch_size)
                self._idle_fill.planned(self.plan[target])
                effects.append(Send(target, extension))
        self._awaiting_completion.discard(dead)
        self._filling.discard(dead)
        return effects

    def readmit(self, rank: int) -> None:
        """``rank`` joined the group: it may be handed work again. Its new process holds none of
        the window in progress (what its last one held went to the survivors), so nothing of
        this window is planned for it: the window's round does not wait for it."""
        self.plan[rank] = 0
        if self.work is not None:
            self.work.readmit(rank)

    def reports(
        self, members: Sequence[int], steps: Sequence[int], delivered: bool
    ) -> list[RankWindow | None]:
        """ElChe's report of each member on the window just closed (None: it ran nothing).

        ``delivered``: the completion frames' wall time (less the fill) is the member's
        delivered time, where it reported one.
        """
        windows: list[RankWindow | None] = []
        for rank in members:
            t = self._tallies[rank]
            if steps[rank] == 0:
                windows.append(None)
                continue
            delivered_ms = t.delivered_ms - t.fill_ms if t.chunk_reports and delivered else None
            if delivered_ms is not None and delivered_ms <= 0:
                delivered_ms = None
            windows.append(RankWindow(t.batches, t.fill_ms, t.compute_ms, delivered_ms))
        return windows

    # --- epochs -----------------------------------------------------------------------------

    def close_epochs(self, members: tuple[int, ...], now: float) -> list[Effect]:
        """EpochAggregated (to ``members``) for every epoch whose batches are all done."""
        if self.work is None:
            return []
        effects: list[Effect] = []
        for pool in self.work.pop_finished():
            result, message = self._epochs.aggregate(pool, members, self._world_size)
            self.epoch_results.append(result)
            self._timeline.add(now, EventKind.EPOCH_AGGREGATED, **result)
            effects.append(Broadcast(message, members))
        return effects
