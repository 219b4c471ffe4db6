"""The run's timeline: what happened and when, for dashboards, summaries and tests."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any

import attrs


class EventKind(enum.Enum):
    """Kinds of timeline events (names as in floDl where it has them)."""

    SYNC_START = "SyncStart"
    SYNC_END = "SyncEnd"
    ANCHOR_CHANGED = "AnchorChanged"
    THROTTLE = "Throttle"
    DIVERGENCE = "Divergence"
    RANK_JOINED = "RankJoined"
    RANK_DEAD = "RankDead"
    GROUP_REFORMED = "GroupReformed"
    SAVE_REQUESTED = "SaveRequested"
    EPOCH_AGGREGATED = "EpochAggregated"
    SHUTDOWN = "Shutdown"
    GOING_ON_WITHOUT = "GoingOnWithout"
    """A rank died before the world joined: the run starts with the ranks that remain."""


@attrs.frozen
class TimelineEvent:
    """One event: ``time`` in the coordinator's clock (seconds), ``detail`` JSON-able."""

    time: float
    kind: EventKind
    detail: dict[str, Any] = attrs.field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time, "kind": self.kind.value, **self.detail}


class Timeline:
    """An append-only list of events with a bound on how many are kept (oldest dropped)."""

    def __init__(self, max_events: int = 100_000) -> None:
        self._events: list[TimelineEvent] = []
        self._max = max_events
        self.dropped = 0

    def add(self, time: float, kind: EventKind, **detail: Any) -> TimelineEvent:
        event = TimelineEvent(time, kind, detail)
        self._events.append(event)
        if len(self._events) > self._max:
            excess = len(self._events) - self._max
            del self._events[:excess]
            self.dropped += excess
        return event

    def __iter__(self) -> Iterator[TimelineEvent]:
        return iter(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def of_kind(self, kind: EventKind) -> list[TimelineEvent]:
        return [e for e in self._events if e.kind is kind]
