"""One task that reads every rank channel carried through node agents: :class:`TunnelReader`.

A :class:`~flodl.transports.channel_reader.ChannelReader` whose readiness comes from the tunnel
streams themselves (:class:`~flodl.transports.tunnel_stream.TunnelStream`): when the agent's
connection delivers bytes for a rank, the stream's readable hook marks it in an ordered set
owned by the reader and wakes the reader's one task if it is parked (once: later marks only
join the set). So a frame of an agent carrying the bytes of many ranks costs one wake-up, not
one per rank. Nothing polls.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Hashable

import trio
import trio.lowlevel

from flodl.transports.channel import Channel
from flodl.transports.channel_reader import ChannelReader
from flodl.transports.tunnel_stream import TunnelStream

__all__ = ["TunnelReadiness", "TunnelReader"]


class TunnelReadiness:
    """Readiness of tunnelled channels, told by their streams' hooks (keys: the streams)."""

    def __init__(self) -> None:
        self._watched: set[TunnelStream] = set()
        self._ready: dict[TunnelStream, None] = {}
        """Streams that may be readable, in the order they were marked (an ordered set)."""
        self._task: trio.lowlevel.Task | None = None
        """The task parked in :meth:`wait`, if any."""
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @staticmethod
    def serves(channel: Channel) -> bool:
        return isinstance(channel.stream, TunnelStream)

    def watch(self, channel: Channel) -> Hashable:
        stream = channel.stream
        if not isinstance(stream, TunnelStream):
            raise ValueError(f"a {type(stream).__name__} is not a tunnel stream")
        if self._closed:
            raise trio.ClosedResourceError("the tunnel reader is closed")
        if stream in self._watched:
            raise ValueError("this channel's stream is already watched")
        self._watched.add(stream)
        stream.set_readable_hook(functools.partial(self._mark, stream))
        if stream.readable:
            self._mark(stream)  # something arrived before it was watched
        return stream

    def unwatch(self, key: Hashable) -> None:
        assert isinstance(key, TunnelStream)
        key.set_readable_hook(None)
        self._watched.discard(key)
        self._ready.pop(key, None)

    def _mark(self, stream: TunnelStream) -> None:
        self._ready[stream] = None
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task)

    async def wait(self, limit: int) -> list[Hashable]:
        if self._ready:
            await trio.lowlevel.checkpoint()
        else:
            while not self._ready:
                self._check_open()
                self._task = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._abort)
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

    def after_read(self, key: Hashable) -> None:
        assert isinstance(key, TunnelStream)
        if key.readable:
            self._ready[key] = None  # a read takes at most so many bytes: the rest next pass

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the tunnel reader is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stream in self._watched:
            stream.set_readable_hook(None)
        self._watched.clear()
        self._ready.clear()
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task)  # it raises ClosedResourceError


class TunnelReader(ChannelReader):
    """A :class:`ChannelReader` for channels over tunnel streams."""

    readiness_type = TunnelReadiness
