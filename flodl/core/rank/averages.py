"""Which batches a rank's averages cover, and the Async policy's round in the background.

Part of the rank machine (:mod:`flodl.core.rank.machine`), pure like it. The machine decides
*when* a round starts, lands or ends; this class keeps *which batches* each covers: those
trained since the last average (a round's weight), and under the Async policy the snapshot a
background round reduces.

Parameters are read or written only at a batch boundary, so a step and an average never
overlap. Under the Async policy the boundary only starts a background round on a snapshot of
the parameters and training goes on; once the round's collective ends (it *lands*) its result
is blended in at a later boundary, or taken exactly when nothing was trained since the
snapshot (:class:`~flodl.core.rank.effects.Blend`), as in the run's last round: every rank
ends with the same parameters. At most one round runs in the background.
"""

from __future__ import annotations

import attrs

from flodl.core.rank.effects import Blend
from flodl.wire.messages import SyncNow

__all__ = ["RankAverages"]


@attrs.define
class _Background:
    """An Async round reducing a snapshot of ``batches`` batches."""

    sync: SyncNow
    batches: int
    landed: bool = False


class RankAverages:
    """See the module docstring. Methods return at once and never send anything."""

    def __init__(self) -> None:
        self.since_average = 0
        """Batches run since the last average this rank took part in."""
        self._background: _Background | None = None

    @property
    def running(self) -> bool:
        """A background round is running and has not landed yet."""
        return self._background is not None and not self._background.landed

    @property
    def landed(self) -> bool:
        """A background round landed and waits to be blended in."""
        return self._background is not None and self._background.landed

    def trained(self) -> None:
        """One more batch to average."""
        self.since_average += 1

    def averaged(self) -> None:
        """An average of every batch trained so far finished."""
        self.since_average = 0

    def start_background(self, sync: SyncNow) -> None:
        """The round for ``sync`` runs in the background on a snapshot of the batches trained
        so far (they count as averaged while it runs)."""
        self._background = _Background(sync, self.since_average)
        self.since_average = 0

    def land(self) -> bool:
        """The background round's collective ended; False when none is running."""
        if self._background is None:
            return False
        self._background.landed = True
        return True

    def blend(self) -> Blend:
        """The step that blends the landed round in (exact when nothing was trained since its
        snapshot)."""
        assert self._background is not None and self._background.landed
        return Blend(self._background.sync, exact=self.since_average == 0)

    def blended(self, averaged: bool) -> SyncNow:
        """The background round ended, blended in (``averaged``) or not: then its batches count
        as never averaged. Returns the round's SyncNow."""
        round_ = self._background
        assert round_ is not None, "no background round to end"
        self._background = None
        if not averaged:
            self.since_average += round_.batches
        return round_.sync
