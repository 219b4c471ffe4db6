"""One task that reads many ``memory://`` channels: :class:`MemoryReader`.

A :class:`~flodl.transports.channel_reader.ChannelReader` whose readiness comes from the
memory streams themselves: each watched stream's readable hook marks it in an ordered set
owned by the reader and wakes the reader's one task if it is parked (once: later marks only
join the set). Nothing polls. Data a latency plan holds in flight is announced when sent;
the reader then learns when it is due (``receivable_at``) and waits for the earliest such
time in a cancel scope. A partitioned link reports nothing until its plan changes.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Hashable

import trio
import trio.lowlevel

from flodl.transports.channel import Channel
from flodl.transports.channel_reader import ChannelReader
from flodl.transports.memory_stream import MemoryStream

__all__ = ["MemoryReadiness", "MemoryReader"]


class MemoryReadiness:
    """Readiness of ``memory://`` channels, told by their streams' hooks (keys: the streams)."""

    def __init__(self) -> None:
        self._watched: set[MemoryStream] = set()
        self._ready: dict[MemoryStream, None] = {}
        """Streams that may be readable, in the order they were marked (an ordered set)."""
        self._due: list[tuple[float, int, MemoryStream]] = []
        """A heap of (time, tie-breaker, stream): data in flight, readable from that time."""
        self._order = itertools.count()
        self._task: trio.lowlevel.Task | None = None
        """The task parked in :meth:`wait`, if any."""
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @staticmethod
    def serves(channel: Channel) -> bool:
        return isinstance(channel.stream, MemoryStream)

    def watch(self, channel: Channel) -> Hashable:
        stream = channel.stream
        if not isinstance(stream, MemoryStream):
            raise ValueError(f"a {type(stream).__name__} is not a memory stream")
        if self._closed:
            raise trio.ClosedResourceError("the memory reader is closed")
        if stream in self._watched:
            raise ValueError("this channel's stream is already watched")
        self._watched.add(stream)
        stream.set_readable_hook(functools.partial(self._mark, stream))
        if stream.receivable_at() != math.inf:
            self._mark(stream)  # something landed before it was watched (due or in flight)
        return stream

    def unwatch(self, key: Hashable) -> None:
        assert isinstance(key, MemoryStream)
        key.set_readable_hook(None)
        self._watched.discard(key)
        self._ready.pop(key, None)

    def _mark(self, stream: MemoryStream) -> None:
        self._ready[stream] = None
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task)

    async def wait(self, limit: int) -> list[Hashable]:
        self._collect_due()
        if self._ready:
            await trio.lowlevel.checkpoint()
        else:
            while not self._ready:
                self._check_open()
                deadline = self._due[0][0] if self._due else math.inf
                with trio.CancelScope(deadline=deadline):
                    self._task = trio.lowlevel.current_task()
                    await trio.lowlevel.wait_task_rescheduled(self._abort)
                self._collect_due()
        self._check_open()
        ready = self._ready
        if len(ready) <= limit:
            taken: list[Hashable] = list(ready)
            ready.clear()
            return taken
        first = list(itertools.islice(ready, limit))
        for stream in first:
            del ready[stream]
        return list[Hashable](first)

    def _abort(self, _raise_cancel: object) -> trio.lowlevel.Abort:
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _collect_due(self) -> None:
        due = self._due
        if not due:
            return
        now = trio.current_time()
        while due and due[0][0] <= now:
            _, _, stream = heapq.heappop(due)
            if stream in self._watched:
                self._ready[stream] = None

    def after_read(self, key: Hashable) -> None:
        assert isinstance(key, MemoryStream)
        at = key.receivable_at()
        if at == math.inf:
            return  # the hook tells when something lands
        if at == -math.inf or at <= trio.current_time():
            self._ready[key] = None
        else:
            heapq.heappush(self._due, (at, next(self._order), key))

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the memory reader is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stream in self._watched:
            stream.set_readable_hook(None)
        self._watched.clear()
        self._ready.clear()
        self._due.clear()
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task)  # it raises ClosedResourceError


class MemoryReader(ChannelReader):
    """A :class:`ChannelReader` for channels over ``memory://`` streams."""

    readiness_type = MemoryReadiness
