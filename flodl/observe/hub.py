"""One place the views read a running coordinator from: its event history and its live state.

:func:`open_observer` subscribes to a coordinator's timeline, writes ``run_dir/events.jsonl``
(:class:`~flodl.observe.events.EventLog`), folds the records into a
:class:`~flodl.observe.state.RunView`, and wakes whoever waits for news
(:meth:`Observer.wait_for_news`). The terminal view, the dashboard and the metrics read
:meth:`Observer.state` and :meth:`Observer.events_since`; none of them can delay a round:
the coordinator only ever calls :meth:`Observer._take`, which never waits.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from flodl.core.coordinator.timeline import TimelineEvent
from flodl.observe.events import EVENTS_NAME, EventLog, set_aside_earlier_log
from flodl.observe.state import RunView, is_notable

__all__ = ["HISTORY_LIMIT", "Observer", "open_observer"]

HISTORY_LIMIT = 200_000
"""Records kept in memory for ``/api/events`` and the live plots (older ones are dropped;
the event log on disk keeps all of them)."""


class Observer:
    """What the views read (module docstring). Obtained from :func:`open_observer`."""

    def __init__(self, coordinator: Any, log: EventLog) -> None:
        self.coordinator = coordinator
        self.log = log
        self.view = RunView(coordinator.machine.world_size)
        self.history: list[dict[str, Any]] = []
        self.history_start = 0
        """Index in the run's records of ``history[0]`` (records before it were dropped)."""
        self._news = trio.Event()
        self._listeners: list[Callable[[dict[str, Any]], None]] = []

    @property
    def clocks(self) -> tuple[float, float]:
        """(trio time, unix time) at the coordinator's start, read together."""
        return self.log.clocks

    def on_record(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call ``listener`` with each new record (it must not block: e.g. print a line)."""
        self._listeners.append(listener)

    def _take(self, seq: int, event: TimelineEvent) -> None:
        """The coordinator's event sink: never waits."""
        record = self.log.offer(seq, event)
        self.history.append(record)
        if len(self.history) > HISTORY_LIMIT:
            excess = len(self.history) - HISTORY_LIMIT
            del self.history[:excess]
            self.history_start += excess
        self.view.apply(record)
        for listener in self._listeners:
            listener(record)
        self._news.set()

    # --- reading ----------------------------------------------------------------------------

    def now_t(self) -> float:
        """Seconds since the coordinator started."""
        return trio.current_time() - self.clocks[0]

    def heartbeat_ages(self) -> dict[int, float]:
        """Seconds since each live rank was last heard from."""
        liveness = self.coordinator.machine.liveness
        now = trio.current_time()
        ages: dict[int, float] = {}
        for rank in range(self.coordinator.machine.world_size):
            seen = liveness.last_seen(rank)
            if seen is not None:
                ages[rank] = max(now - seen, 0.0)
        return ages

    def state(self) -> dict[str, Any]:
        """The run's state now (docs/observability.md, "State")."""
        state = self.view.snapshot(now_t=self.now_t(), heartbeat_age=self.heartbeat_ages())
        outcome = self.coordinator.machine.outcome
        if self.coordinator.machine.finished:
            state["status"] = outcome.status.value
        return state

    def events_since(self, index: int, limit: int = 1000) -> tuple[list[dict[str, Any]], int]:
        """Records from position ``index`` in the run's history on (at most ``limit``), and the
        position to ask from next."""
        start = max(index - self.history_start, 0)
        chunk = self.history[start : start + limit]
        return chunk, self.history_start + start + len(chunk)

    def notable(self) -> list[dict[str, Any]]:
        """The records the plain output prints a line for (deaths, regroups, saves, ...)."""
        return [r for r in self.history if is_notable(r)]

    async def wait_for_news(self) -> None:
        """Return once a record arrived after the call (cancellable at any point)."""
        if self._news.is_set():
            self._news = trio.Event()
        await self._news.wait()


@asynccontextmanager
async def open_observer(
    coordinator: Any, run_dir: Path, clocks: tuple[float, float] | None = None
) -> AsyncIterator[Observer]:
    """Observe ``coordinator`` for the block, writing ``run_dir/events.jsonl`` (an earlier
    one there is renamed first: :func:`~flodl.observe.events.set_aside_earlier_log`).

    ``clocks``: (trio time, unix time) read together when the coordinator started (default:
    now). On exit, also by cancellation, the block waits until the event log has written
    everything queued, so an interrupted run still leaves its whole history.
    """
    clocks = clocks or (trio.current_time(), time.time())
    set_aside_earlier_log(run_dir)
    log = EventLog(run_dir / EVENTS_NAME, clocks)
    observer = Observer(coordinator, log)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.run)
        coordinator.add_event_sink(observer._take)
        try:
            yield observer
        finally:
            log.close()  # the writer ends, shielded, once it wrote what is queued
