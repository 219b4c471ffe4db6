"""The run's timeline: what happened and when, for dashboards, summaries and tests."""

from __future__ import annotations

import enum
import itertools
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
    JOIN_FAILED = "JoinFailed"
    """A rank could not join a group generation (its rounds on that generation cannot run)."""
    STOP_REQUESTED = "StopRequested"
    """The training stops early (a rank's ``stop``, the time budget): nothing more is handed
    out, and the run ends after a last round."""
    COORDINATOR_PAUSED = "CoordinatorPaused"
    """The coordinator's process did not run for ``seconds`` (SIGSTOP, a suspended machine):
    its ranks heard nothing from it meanwhile, and give up on it past ``heartbeat_timeout``."""


@attrs.frozen
class TimelineEvent:
    """One event: ``time`` in the coordinator's clock (seconds), ``detail`` JSON-able."""

    time: float
    kind: EventKind
    detail: dict[str, Any] = attrs.field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"time": self.time, "kind": self.kind.value, **self.detail}

    @property
    def silenced_rank(self) -> int | None:
        """The rank this event declares dead for silence (paused or stuck: its supervisor is
        to kill it), or None."""
        if self.kind is EventKind.RANK_DEAD and self.detail.get("cause") == "silent":
            return int(self.detail["rank"])
        return None


LASTING_KINDS = frozenset(
    {
        EventKind.TRAINING_STARTED,
        EventKind.RANK_JOINED,
        EventKind.RANK_DEAD,
        EventKind.GROUP_REFORMED,
        EventKind.JOIN_FAILED,
        EventKind.SAVE_REQUESTED,
        EventKind.SHUTDOWN,
        EventKind.GOING_ON_WITHOUT,
        EventKind.STOP_REQUESTED,
        EventKind.COORDINATOR_PAUSED,
    }
)
"""Kinds the timeline keeps for the whole run, however many events it drops: a few per fault,
join or stop, and what a run's summary is built from (its start, its deaths and their
recoveries, its saves)."""


class Timeline:
    """An append-only list of events with a bound on how many are kept.

    Every event ever added has a sequence number, its position in the run's history
    (0, 1, ...), which stays valid after older events were dropped: :meth:`since` reads
    on from one. Past ``max_events`` the oldest events are dropped, except the events of
    :data:`LASTING_KINDS` and the first ``SyncEnd`` after each (a death's recovery): those
    stay for the whole run, so a summary of a run of days still has its start and every death.
    Iterating (and :meth:`of_kind`) gives the kept old events, then the recent ones.
    """

    def __init__(self, max_events: int = 100_000) -> None:
        self._events: list[TimelineEvent] = []
        self._lasting: list[bool] = []
        """Parallel to ``_events``: whether the event outlives the bound."""
        self._kept: list[TimelineEvent] = []
        """Lasting events that fell out of ``_events``, oldest first."""
        self._max = max_events
        self._after_lasting = False
        self.dropped = 0

    @property
    def added(self) -> int:
        """How many events were ever added (the next event's sequence number)."""
        return self.dropped + len(self._events)

    def add(self, time: float, kind: EventKind, **detail: Any) -> TimelineEvent:
        event = TimelineEvent(time, kind, detail)
        lasting = kind in LASTING_KINDS
        self._events.append(event)
        self._lasting.append(lasting or (kind is EventKind.SYNC_END and self._after_lasting))
        if lasting:
            self._after_lasting = True
        elif kind is EventKind.SYNC_END:
            self._after_lasting = False
        if len(self._events) > self._max:
            excess = len(self._events) - self._max
            old = zip(self._events[:excess], self._lasting[:excess], strict=True)
            self._kept.extend(event for event, keep in old if keep)
            del self._events[:excess]
            del self._lasting[:excess]
            self.dropped += excess
        return event

    def since(self, seq: int) -> list[tuple[int, TimelineEvent]]:
        """The events from sequence number ``seq`` on, with their numbers (dropped ones are
        skipped: the first number returned may be above ``seq``)."""
        start = max(seq - self.dropped, 0)
        return [(self.dropped + i, e) for i, e in enumerate(self._events[start:], start)]

    def __iter__(self) -> Iterator[TimelineEvent]:
        return itertools.chain(self._kept, self._events)

    def __len__(self) -> int:
        return len(self._kept) + len(self._events)

    def of_kind(self, kind: EventKind) -> list[TimelineEvent]:
        return [e for e in self if e.kind is kind]
