"""One task that reads many ``memory://`` channels: :class:`MemoryReader`.

A :class:`~flodl.transports.channel_reader.ChannelReader` whose readiness comes from the
memory streams themselves: each watched stream's readable hook marks it in an ordered set
owned by the reader and wakes the reader's one task if it is parked (once: later marks only
join the set). Nothing polls. Data a latency plan holds in flight is announced when sent;
the reader then learns when it is due (``receivable_at``) and waits for the earliest such
time in a cancel scope. A partitioned link reports nothing until its plan changes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable
from typing import Any

import trio

from flodl.transports.channel_reader import ChannelReader
from flodl.transports.hooked_readiness import HookedReadiness
from flodl.transports.memory_stream import MemoryStream

__all__ = ["MemoryReadiness", "MemoryReader"]


class MemoryReadiness(HookedReadiness):
    """Readiness of ``memory://`` channels, told by their streams' hooks (keys: the streams)."""

    stream_type = MemoryStream
    name = "memory stream"

    def __init__(self) -> None:
        super().__init__()
        self._due: list[tuple[float, int, MemoryStream]] = []
        """A heap of (time, tie-breaker, stream): data in flight, readable from that time."""
        self._order = itertools.count()

    def _holds_something(self, stream: Any) -> bool:
        return bool(stream.receivable_at() != math.inf)  # due or in flight

    def _next_due(self) -> float:
        return self._due[0][0] if self._due else math.inf

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

    def close(self) -> None:
        super().close()
        self._due.clear()


class MemoryReader(ChannelReader):
    """A :class:`ChannelReader` for channels over ``memory://`` streams."""

    readiness_type = MemoryReadiness
