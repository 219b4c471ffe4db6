"""The run's event log: ``run_dir/events.jsonl``, one JSON object a line, as things happen.

Each line is a timeline event of the coordinator (see docs/observability.md, key by key)::

    {"v": 1, "seq": 17, "t": 3.52, "unix": 1764640000.12, "kind": "SyncEnd", ...detail}

``v`` is the schema version, ``seq`` the event's sequence number in the run (gaps mean events
were dropped), ``t`` seconds since the coordinator started, ``unix`` the wall-clock time.
:class:`EventLog` is fed from inside the coordinator's effect loop, so :meth:`EventLog.offer`
never waits: it converts the event and puts it on a bounded queue, and a writer task writes
whatever is queued in a worker thread. When the queue is full (the disk is slower than the
run), events are dropped and counted, and the log's last line says how many.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from flodl.core.coordinator.timeline import TimelineEvent
from flodl.host.appender import Appender
from flodl.host.rundir import set_aside

__all__ = [
    "EVENTS_NAME",
    "SCHEMA_VERSION",
    "EventLog",
    "event_record",
    "read_events",
    "set_aside_earlier_log",
]

EVENTS_NAME = "events.jsonl"
SCHEMA_VERSION = 1
QUEUE_LIMIT = 10_000
"""Events waiting to be written before new ones are dropped (a few MB at most)."""


def set_aside_earlier_log(run_dir: Path) -> Path | None:
    """Rename an earlier run's ``events.jsonl`` in ``run_dir`` (a resumed run, a coordinator
    folder used again) to ``events.<N>.jsonl``, N the next free number, so each log holds one
    run's history. Returns the new name, or None when there was none."""
    return set_aside(run_dir / EVENTS_NAME)


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def event_record(seq: int, event: TimelineEvent, clocks: tuple[float, float]) -> dict[str, Any]:
    """The log line of ``event``; ``clocks`` is (trio time, unix time) read together at the
    coordinator's start."""
    trio_start, unix_start = clocks
    since = event.time - trio_start
    head = {
        "v": SCHEMA_VERSION,
        "seq": seq,
        "t": round(since, 6),
        "unix": round(unix_start + since, 6),
        "kind": event.kind.value,
    }
    return {**head, **_clean(event.detail)}


class EventLog:
    """Writes events to ``path`` from a writer task (:meth:`run`); :meth:`offer` never waits."""

    def __init__(self, path: Path, clocks: tuple[float, float]) -> None:
        self.path = path
        self.clocks = clocks
        self._send, self._receive = trio.open_memory_channel[dict[str, Any]](QUEUE_LIMIT)
        self.dropped = 0
        """Events not written because the queue was full."""
        self.written = 0
        self.finished = trio.Event()
        """Set once :meth:`run` returned (everything queued is written, or writing failed)."""

    def offer(self, seq: int, event: TimelineEvent) -> dict[str, Any]:
        """Queue ``event`` (a coordinator event sink) and return its record. Never blocks;
        an event that finds the queue full is dropped and counted."""
        record = event_record(seq, event, self.clocks)
        try:
            self._send.send_nowait(record)
        except (trio.WouldBlock, trio.ClosedResourceError):
            self.dropped += 1
        return record

    def close(self) -> None:
        """No more events: :meth:`run` writes what is queued and returns."""
        self._send.close()

    async def run(self) -> None:
        """Write queued events until :meth:`close`; each batch is flushed (a reader sees whole
        lines).

        Shielded from cancellation: a cancelled run still gets its whole history written,
        as long as :meth:`close` is called. There is no time limit on that: the writes go to
        the run folder, where ``summary.json`` is written next, so a disk too slow for one
        would hold up the other anyway.

        A write the disk refuses (it is full) drops its batch, counted as dropped: it is said
        once, the log is cut back to its last whole line, and later batches try again. The run
        goes on either way.
        """
        sink = Appender(self.path, str(self.path), "; its events are dropped")
        try:
            with trio.CancelScope(shield=True):
                async with self._receive:
                    async for first in self._receive:
                        batch = [first]
                        while True:
                            try:
                                batch.append(self._receive.receive_nowait())
                            except (trio.WouldBlock, trio.EndOfChannel):
                                break
                        if await trio.to_thread.run_sync(sink.append, _lines(batch)):
                            self.written += len(batch)
                        else:
                            self.dropped += len(batch)
                if self.dropped:
                    tail = {"v": SCHEMA_VERSION, "kind": "EventsDropped", "count": self.dropped}
                    sink.append(_lines([tail]))
        finally:
            sink.close()
            self.finished.set()


def _lines(records: list[dict[str, Any]]) -> bytes:
    """``records`` as the log's lines, one JSON object each."""
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every event in the log at ``path``, in order. A last line cut short (a run killed
    while writing) is skipped; any other line that is not a JSON object raises ValueError
    naming the line."""
    return list(_iter_events(path))


def _iter_events(path: Path) -> Iterator[dict[str, Any]]:
    lines = path.read_text(encoding="utf-8").split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):  # no newline after it: cut short
                return
            raise ValueError(f"{path}:{number}: not a JSON line: {err}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: not a JSON object")
        yield record
