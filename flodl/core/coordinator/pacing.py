"""The group's pace: ElChe's batch counts by global rank, and what each closed window does to them.

ElChe numbers its ranks 0..n-1 in the order of the group it was built for; the group's members
are global ranks, and survivors keep their order when a rank dies while ranks that (re)join
are appended. :class:`Pacing` keeps that mapping, builds ElChe for the first group (from a
resumed run's saved state where there is one), carries it over to each later group, caps a
window at the epoch's batches, and closes each window: ElChe takes the window's timings and
the last average's duration, the convergence guard judges the round's divergences, and ElChe
acts on the verdict. Under the Sync policy every member runs one batch per window and ElChe
is never fed. Pure: no clocks, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flodl.core.cadence.elche import ElChe, RankWindow, elche_for_world
from flodl.core.cadence.guards import Guard, make_guard
from flodl.core.common.policy import Policy
from flodl.core.coordinator.settings import MachineSettings
from flodl.core.coordinator.timeline import EventKind, Timeline

__all__ = ["Pacing"]


class Pacing:
    """ElChe and the guard of a run, seen by global rank.

    ``saved``: the ElChe state of the checkpoint a run resumes from, fitted to the first group.
    """

    def __init__(
        self,
        settings: MachineSettings,
        timeline: Timeline,
        world_size: int,
        *,
        saved: Mapping[str, Any] | None = None,
    ) -> None:
        self._settings = settings
        self._timeline = timeline
        self._saved = saved
        self.feeds = settings.policy is not Policy.SYNC
        """ElChe decides the counts (every policy but Sync)."""
        self.guard: Guard = make_guard(settings.guard, settings.trend_threshold)
        self.elche = self._new_elche(world_size)
        self._ranks: list[int] = []
        """Global rank of each ElChe index."""
        self._divergences: list[float] = []

    def _new_elche(self, size: int) -> ElChe:
        c = self._settings.cadence
        return ElChe(
            max(size, 1),
            anchor=c.anchor,
            max_anchor=c.max_anchor,
            overhead_target=c.overhead_target,
            max_batch_diff=c.max_batch_diff,
            sync_policy=not self.feeds,
            relax_up_on_stable=c.relax_up,
        )

    # --- groups -----------------------------------------------------------------------------

    def form(self, members: Sequence[int]) -> None:
        """The first group formed: ElChe over its members (the saved one when resuming)."""
        self._ranks = list(members)
        if self._saved is not None:
            self.elche = elche_for_world(self._saved, len(members))
        else:
            self.elche = self._new_elche(len(members))

    def carry_over(self, members: Sequence[int]) -> list[int]:
        """A later group formed: survivors keep their timings, new ranks are appended.

        Returns the members that are new to ElChe, in ``members`` order.
        """
        old_index = {rank: i for i, rank in enumerate(self._ranks)}
        kept = [rank for rank in self._ranks if rank in members]
        self.elche = self.elche.for_survivors([old_index[r] for r in kept])
        self._ranks = kept
        added = [rank for rank in members if rank not in old_index]
        for rank in added:
            self.elche.add_rank()
            self._ranks.append(rank)
        return added

    # --- counts -----------------------------------------------------------------------------

    def counts(self, members: Sequence[int]) -> dict[int, int]:
        """Batches per window of each member (global rank -> count)."""
        if not self.feeds:
            return dict.fromkeys(members, 1)
        counts = self.elche.batch_counts
        return {rank: counts[i] for i, rank in enumerate(self._ranks)}

    def window_counts(self, members: Sequence[int], epoch_batches: int) -> dict[int, int]:
        """:meth:`counts` for the next window, which holds at most the configured share of an
        epoch's batches (floDl's window cap: one epoch by default)."""
        cap_epochs = self._settings.cadence.window_cap_epochs
        if self.feeds and cap_epochs is not None:
            self.elche.set_max_total_batches(max(int(epoch_batches * cap_epochs), 1))
        counts = self.counts(members)
        cap_s = self._settings.cadence.window_cap_s
        if self.feeds and cap_s is not None:
            # Each rank's window takes at most cap_s at its measured speed (ranks not timed
            # yet keep ElChe's count); the counts stay in ElChe's proportions.
            ms = self.ms_per_batch()
            counts = {
                rank: min(count, max(int(cap_s * 1000.0 / ms[rank]), 1)) if rank in ms else count
                for rank, count in counts.items()
            }
        return counts

    def ms_per_batch(self) -> dict[int, float]:
        """ElChe's time per batch of each timed member (global rank -> ms)."""
        smoothed = self.elche.smoothed_ms
        return {rank: ms for rank, ms in zip(self._ranks, smoothed, strict=True) if ms is not None}

    # --- closing a window -------------------------------------------------------------------

    def on_divergence(self, divergence: float) -> None:
        """A rank's divergence for the round in flight (the guard judges them all at once)."""
        self._divergences.append(divergence)

    def close_window(
        self,
        windows: Sequence[RankWindow | None],
        steps: Sequence[int],
        reduce_ms: float,
        *,
        delivered: bool,
        now: float,
    ) -> str:
        """Feed one closed window (a report per ElChe rank) and the guard's verdict to ElChe.

        ``steps``: batches per global rank in the window; ``reduce_ms``: the last average's
        duration; ``delivered``: ElChe may time the ranks by their delivered wall time.
        """
        elche = self.elche
        anchor_before = elche.anchor
        elche.report_window(windows, reduce_ms, use_delivered=delivered)
        verdict = self.guard.report(
            self._divergences, k_used=sum(steps), k_max=max(steps, default=0)
        )
        self._divergences = []
        elche.apply_verdict(verdict)
        if elche.anchor != anchor_before:
            self._timeline.add(
                now, EventKind.ANCHOR_CHANGED, before=anchor_before, after=elche.anchor
            )
        return type(verdict).__name__
