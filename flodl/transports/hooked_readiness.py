"""Readiness told by the streams themselves: :class:`HookedReadiness`, the part of a
:class:`~flodl.transports.channel_reader.Readiness` that in-process streams share.

A stream of such a kind calls a readable hook when something lands on it (``memory://``
streams). Each watched stream's hook marks it in an ordered set owned by the readiness and
wakes the reader's one task if it is parked (once: later marks only join the set). Nothing
polls. A kind names its stream type and says whether a stream holds something to read; a kind
whose data becomes readable later (a memory link's latency) also says when
(:meth:`HookedReadiness._next_due`, :meth:`_collect_due`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, Protocol

import trio
import trio.lowlevel

from flodl.transports.channel import Channel

__all__ = ["HookedReadiness", "HookedStream"]


class HookedStream(Protocol):
    """A stream that tells when something lands on it."""

    def set_readable_hook(self, hook: Callable[[], None] | None) -> None: ...


class HookedReadiness:
    """Readiness of channels over :attr:`stream_type` streams, told by their hooks (keys: the
    streams)."""

    stream_type: ClassVar[type[Any]]
    """The kind of stream this readiness watches."""
    name: ClassVar[str] = "stream"
    """What the streams are called in errors."""

    def __init__(self) -> None:
        self._watched: set[Any] = set()
        self._ready: dict[Any, None] = {}
        """Streams that may be readable, in the order they were marked (an ordered set)."""
        self._task: trio.lowlevel.Task | None = None
        """The task parked in :meth:`wait`, if any."""
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @classmethod
    def serves(cls, channel: Channel) -> bool:
        return isinstance(channel.stream, cls.stream_type)

    def _holds_something(self, stream: Any) -> bool:
        """Whether ``stream`` holds something, now or later (it is then marked when watched)."""
        raise NotImplementedError

    def _next_due(self) -> float:
        """When data known to be in flight becomes readable (inf: none is)."""
        return math.inf

    def _collect_due(self) -> None:
        """Mark the streams whose data in flight became readable by now."""

    def watch(self, channel: Channel) -> Hashable:
        stream = channel.stream
        if not isinstance(stream, self.stream_type):
            raise ValueError(f"a {type(stream).__name__} is not a {self.name}")
        if self._closed:
            raise trio.ClosedResourceError(f"the {self.name} reader is closed")
        if stream in self._watched:
            raise ValueError("this channel's stream is already watched")
        self._watched.add(stream)
        stream.set_readable_hook(functools.partial(self._mark, stream))
        if self._holds_something(stream):
            self._mark(stream)  # something landed before it was watched
        key: Hashable = stream
        return key

    def unwatch(self, key: Hashable) -> None:
        assert isinstance(key, self.stream_type)
        key.set_readable_hook(None)
        self._watched.discard(key)
        self._ready.pop(key, None)

    def _mark(self, stream: Any) -> None:
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
                with trio.CancelScope(deadline=self._next_due()):
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

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError(f"the {self.name} reader is closed")

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
