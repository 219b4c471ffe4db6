"""The ``flodl: ...`` line a run prints for each event that matters, with saves summarised.

Lines are printed for a death, a recovery (the group re-formed), a start without ranks that
died joining, a rejoin, a redone round, a save request, the save results, the shutdown, and a
pause of the coordinator's own process;
never one per round. The ranks' ``CheckpointSaved`` records of one save arrive within
moments of each other, so :class:`EventLines` holds successful ones back for up to
:data:`SAVE_GROUP_S` and prints one line for all of them (``ranks 0, 1, 2 saved in 71-80 ms``);
a failed save gets a line of its own at once. Pure: the caller passes the time and prints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flodl.observe.state import describe

__all__ = ["PREFIX", "SAVE_GROUP_S", "EventLines", "prints_line"]

PREFIX = "flodl: "

SAVE_GROUP_S = 0.5
"""How long after the first rank's save result the others of the same save are awaited."""

_KINDS = frozenset(
    {
        "RankDead",
        "GroupReformed",
        "GoingOnWithout",
        "JoinFailed",
        "SaveRequested",
        "StopRequested",
        "CheckpointSaved",
        "Shutdown",
        "CoordinatorPaused",
    }
)


def prints_line(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` gets a line. Unlike :func:`flodl.observe.state.is_notable`, an anchor
    change does not: ElChe may move the anchor after any round."""
    kind = record.get("kind")
    if kind in _KINDS:
        return True
    return (kind == "RankJoined" and bool(record.get("rejoin"))) or (
        kind == "SyncStart" and bool(record.get("redo"))
    )


class EventLines:
    """Turns event records into lines (module docstring); not thread-safe, not async."""

    def __init__(self) -> None:
        self._saved: list[Mapping[str, Any]] = []
        self._saved_since: float | None = None

    @property
    def due(self) -> float | None:
        """When the held-back save results must be printed (:meth:`flush`), or None."""
        return None if self._saved_since is None else self._saved_since + SAVE_GROUP_S

    def take(self, record: Mapping[str, Any], now: float) -> list[str]:
        """The lines to print now that ``record`` arrived at ``now`` (any clock, as :attr:`due`),
        held-back save results first so the lines stay in the order of the events."""
        if not prints_line(record):
            return []
        if record.get("kind") == "CheckpointSaved" and not record.get("error"):
            if self._saved_since is None:
                self._saved_since = now
            self._saved.append(record)
            return []
        return [*self.flush(), PREFIX + describe(record)]

    def flush(self) -> list[str]:
        """The held-back save results as one line (none when nothing is held back)."""
        saved, self._saved, self._saved_since = self._saved, [], None
        if not saved:
            return []
        if len(saved) == 1:
            return [PREFIX + describe(saved[0])]
        ranks = ", ".join(str(r.get("rank")) for r in sorted(saved, key=_rank_key))
        times = sorted(float(r.get("elapsed_ms") or 0.0) for r in saved)
        low, high = f"{times[0]:.0f}", f"{times[-1]:.0f}"
        took = f"{low} ms" if low == high else f"{low}-{high} ms"
        return [f"{PREFIX}{float(saved[0].get('t', 0.0)):.1f}s ranks {ranks} saved in {took}"]


def _rank_key(record: Mapping[str, Any]) -> int:
    rank = record.get("rank")
    return rank if isinstance(rank, int) else -1
