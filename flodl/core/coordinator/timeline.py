"""The run's timeline: what happened and when, for dashboards, summaries and tests."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any

import attrs


class EventKind(enum.Enum):
    """Kinds of timeline events (names as in floDl where it has them)."""

    TRAINING_STARTED = "TrainingStarted"
    """The first group formed: the job (dataset size, batch size, epochs) and its members."""
    SYNC_START = "SyncStart"
    SYNC_END = "SyncEnd"
    ANCHOR_CHANGED = "AnchorChanged"
    THROTTLE = "Throttle"
    DIVERGENCE = "Divergence"
    RANK_JOINED = "RankJoined"
    RANK_DEAD = "RankDead"
    GROUP_REFORMED = "GroupReformed"
    SAVE_REQUESTED = "SaveRequested"
    CHECKPOINT_SAVED = "CheckpointSaved"
    """A rank answered a Checkpoint request (``error`` is None when it saved)."""
    EPOCH_AGGREGATED = "EpochAggregated"
    SHUTDOWN = "Shutdown"
    GOING_ON_WITHOUT = "GoingOnWithout"
    """A rank died before the world joined: the run starts with the ranks that remain."""
    STOP_REQUESTED = "StopRequested"
    """The training stops early (a rank's ``stop``, the time budget): nothing more is handed
    out, and the run ends after a last round."""


@attrs.frozen
class TimelineEvent:
    """One event: ``time`` in the coordinator's clock (seconds), ``detail`` JSON-able."""

    time: float
    kind: EventKind
    detail: dict[str, Any] = attrs.field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time, "kind": self.kind.value, **self.detail}


class Timeline:
    """An append-only list of events with a bound on how many are kept (oldest dropped).

    Every event ever added has a sequence number, its position in the run's history
    (0, 1, ...), which stays valid after older events were dropped: :meth:`since` reads
    on from one.
    """

    def __init__(self, max_events: int = 100_000) -> None:
        self._events: list[TimelineEvent] = []
        self._max = max_events
        self.dropped = 0

    @property
    def added(self) -> int:
        """How many events were ever added (the next event's sequence number)."""
        return self.dropped + len(self._events)

    def add(self, time: float, kind: EventKind, **detail: Any) -> TimelineEvent:
        event = TimelineEvent(time, kind, detail)
        self._events.append(event)
        if len(self._events) > self._max:
            excess = len(self._events) - self._max
            del self._events[:excess]
            self.dropped += excess
        return event

    def since(self, seq: int) -> list[tuple[int, TimelineEvent]]:
        """The events from sequence number ``seq`` on, with their numbers (dropped ones are
        skipped: the first number returned may be above ``seq``)."""
        start = max(seq - self.dropped, 0)
        return [(self.dropped + i, e) for i, e in enumerate(self._events[start:], start)]

    def __iter__(self) -> Iterator[TimelineEvent]:
        return iter(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def of_kind(self, kind: EventKind) -> list[TimelineEvent]:
        return [e for e in self._events if e.kind is kind]
