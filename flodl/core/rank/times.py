"""Where a rank's wall time goes: training, idling at a boundary, averaging, starting up.

Part of the rank machine (:mod:`flodl.core.rank.machine`), pure: times are passed in. A *boundary*
is the training loop's wait for its next batch (:meth:`RankTimes.enter` to
:meth:`RankTimes.leave`); the time averaging within it is counted apart.
"""

from __future__ import annotations

import attrs

__all__ = ["RankTimes"]


@attrs.define
class RankTimes:
    idle_s: float = 0.0
    """Seconds lost at batch boundaries while training: waiting for work or for a round to
    start, throttled. Averaging is not idling: it is counted in ``averaging_s``."""
    averaging_s: float = 0.0
    """Seconds spent averaging (SyncNow to SyncAck; Async: blending a landed round in)."""
    startup_s: float = 0.0
    """Boundary time before the first batch (group formation, waiting for peers)."""
    _entered_at: float | None = None
    _averaging_at_entry: float = 0.0
    _trained: bool = False

    @property
    def in_boundary(self) -> bool:
        return self._entered_at is not None

    def enter(self, now: float) -> None:
        self._entered_at = now
        self._averaging_at_entry = self.averaging_s

    def leave(self, now: float, handed_out: bool) -> tuple[float, float] | None:
        """End the boundary entered earlier; ``handed_out``: it ended with a batch to train.
        Returns ``(idle seconds, entered at)`` when the wait counts as idle time (after the
        first batch), else None. Idempotent: a second call returns None."""
        entered, self._entered_at = self._entered_at, None
        if entered is None:
            return None
        waited = now - entered - (self.averaging_s - self._averaging_at_entry)
        idle = None
        if self._trained:
            self.idle_s += waited
            idle = (waited, entered)
        else:
            self.startup_s += waited
        self._trained = self._trained or handed_out
        return idle
