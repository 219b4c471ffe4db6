"""What the coordinator machine publishes about its run: :class:`RunRecord`, read-only.

The shells and everything after a run (the summary, the account of saves, the failure report,
the views) read a run through this and nothing else of the machine: the machine's parts may
change shape while what it publishes stays. A record read after the run ended is final.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from flodl.core.coordinator.ending import Outcome
    from flodl.core.coordinator.stats import RankStats
    from flodl.core.coordinator.timeline import Timeline
    from flodl.wire.messages import CheckpointResult

__all__ = ["RunRecord"]


class RunRecord(Protocol):
    """A run as the coordinator saw it (:class:`~flodl.core.coordinator.machine.CoordinatorMachine`
    is one)."""

    @property
    def timeline(self) -> Timeline:
        """Everything that happened, in order (events with their times on the run's clock)."""
        ...

    @property
    def stats(self) -> Sequence[RankStats]:
        """Per-rank counters by global rank: batches, syncs, when it joined and was lost."""
        ...

    @property
    def finished(self) -> bool: ...

    @property
    def outcome(self) -> Outcome:
        """Completed, saved or failed, and why (final once :attr:`finished`)."""
        ...

    @property
    def stop_saves(self) -> Mapping[int, CheckpointResult | None]:
        """After a save went out: each rank asked -> the bundle it reported (None: not yet)."""
        ...

    @property
    def global_step(self) -> int:
        """Batches trained by all ranks up to the last averaging round."""
        ...

    @property
    def round(self) -> int:
        """The number of the last averaging round started."""
        ...

    @property
    def anchor(self) -> int:
        """ElChe's anchor: the batches the slowest rank runs per window."""
        ...

    @property
    def epoch_results(self) -> list[dict[str, Any]]: ...

    def counts(self) -> dict[int, int]:
        """ElChe's batch count per member (global rank -> batches per window)."""
        ...

    def lost_ranks(self) -> frozenset[int]:
        """Ranks declared dead that did not join again since."""
        ...

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks in the group (at the end, once the run finished: those that saved its
        final bundles)."""
        ...

    def checkpoint_meta(self) -> dict[str, Any]:
        """The coordinator's part of a checkpoint."""
        ...
