"""One task that reads many channels: :class:`ChannelReader` over a :class:`Readiness`.

A coordinator serving a thousand ranks spends most of its time not on frames but on waking
up for them: with one reader task per connection, every message costs a trio wake-up (a task
switch, a checkpoint, for sockets the fd re-armed in trio's epoll) for about two messages: a
rank's frames arrive 100 ms apart, so no design with a task per connection wakes less often.
Here one task serves every channel that became readable since its last wake-up, each read
once without waiting. What tells it which channels are readable is a :class:`Readiness`:
a private epoll for sockets (:mod:`flodl.transports.socket_reader`), a hook on the stream
for ``memory://`` (:mod:`flodl.transports.memory_reader`). Each kind of reader says which
channels it serves (:meth:`ChannelReader.serves`); :func:`flodl.transports.readers.reader_for`
picks the kind for a channel.

A pass reads at most :data:`PASS_CHANNELS` channels, at most :data:`READ_BYTES` from each,
and no further channel once it has handed over :data:`PASS_MESSAGES` messages (a frame that
carries others, a node agent's, counts as those it carries); then it lets the other tasks run.
Channels left over are read first in the next pass, so a flooding peer can neither starve the
others nor stall the event loop. The figures are in ``docs/benchmarks.md`` ("Coordinator
scale").
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import ClassVar, Protocol

import attrs
import trio
import trio.lowlevel

from flodl.errors import ChannelClosed, FlodlError
from flodl.transports.channel import Channel
from flodl.wire.messages import Message

READ_BYTES = 16 * 1024
"""Most bytes read from one channel in one pass (about 150 Batch frames)."""

PASS_MESSAGES = 256
"""A pass reads no further channel once it has handed over this many messages."""

PASS_CHANNELS = 256
"""Most channels read in one pass."""

MessagesHandler = Callable[[list[Message], float], None]
"""``on_messages(batch, now)``: a channel's messages in order, with the time they were read."""

EndHandler = Callable[[Exception | None], None]
"""``on_end(error)``: the channel ended (None: the peer closed it cleanly at a frame boundary)."""


class Readiness(Protocol):
    """Which watched channels may be read without waiting (one per :class:`ChannelReader`).

    A key names one watched channel. A key reported ready may turn out to hold nothing
    (reading it then costs a call, nothing more); a channel that holds something must be
    reported, without anyone polling.
    """

    def __init__(self) -> None: ...

    @property
    def closed(self) -> bool: ...

    @staticmethod
    def serves(channel: Channel) -> bool:
        """Whether this kind of source can watch ``channel`` (its stream, on this platform)."""
        ...

    def watch(self, channel: Channel) -> Hashable:
        """Start watching ``channel``; its key (unique while watched). ValueError if it cannot
        be watched or already is; ClosedResourceError once closed."""
        ...

    def unwatch(self, key: Hashable) -> None:
        """Stop watching (the key is watched; its channel's stream may already be closed)."""
        ...

    async def wait(self, limit: int) -> list[Hashable]:
        """Wait until some watched channel may be readable; at most ``limit`` keys. Always a
        checkpoint; ClosedResourceError once closed (also for a task waiting then)."""
        ...

    def after_read(self, key: Hashable) -> None:
        """``key``'s channel was just read once (it is still watched): report it again if
        something is left to read, now or later."""
        ...

    def close(self) -> None:
        """Forget every key and release what the source holds (idempotent)."""
        ...


@attrs.define(eq=False)
class _Entry:
    channel: Channel
    key: Hashable
    on_messages: MessagesHandler
    on_end: EndHandler


class ChannelReader:
    """Reads every added channel from the one task that runs :meth:`run`.

    A kind of reader is a subclass naming its :class:`Readiness` (``readiness_type``).

    For each channel the handlers are called from that task, never concurrently:
    ``on_messages`` with every batch of messages in the order they were sent (never empty),
    and ``on_end`` exactly once when the channel ends (clean end of stream, a wire error, a
    broken or reset stream), after the messages that came before the problem. The channel is
    discarded before ``on_end`` is called. Exceptions raised by a handler are not caught: they
    end :meth:`run` (a handler deals with its own peer's misbehaviour, for instance by calling
    :meth:`discard`).
    """

    readiness_type: ClassVar[type[Readiness]]
    """The kind of readiness source this reader watches its channels with."""

    def __init__(self) -> None:
        self._readiness = self.readiness_type()
        self._entries: dict[Hashable, _Entry] = {}
        self._key_of: dict[Channel, Hashable] = {}
        self._backlog: list[Hashable] = []
        """Ready channels a capped pass did not read; read first by the next pass."""

    @classmethod
    def serves(cls, channel: Channel) -> bool:
        """Whether this kind of reader can read ``channel`` (its stream, on this platform)."""
        return cls.readiness_type.serves(channel)

    @property
    def channels(self) -> int:
        """How many channels are watched."""
        return len(self._entries)

    @property
    def closed(self) -> bool:
        return self._readiness.closed

    def add(self, channel: Channel, on_messages: MessagesHandler, on_end: EndHandler) -> None:
        """Watch ``channel`` (nothing received on it yet) until it ends or is discarded.
        Raises ValueError for a channel it cannot read or one already watched, and
        ClosedResourceError once the reader is closed."""
        if channel.holds_result:
            raise ValueError("the channel holds received messages; add it before reading")
        if channel in self._key_of:
            raise ValueError("this channel is already watched")
        key = self._readiness.watch(channel)
        self._entries[key] = _Entry(channel, key, on_messages, on_end)
        self._key_of[channel] = key

    def discard(self, channel: Channel) -> None:
        """Stop watching ``channel`` (idempotent; its handlers are not called again). Call it
        before the channel's stream is closed."""
        key = self._key_of.pop(channel, None)
        if key is None:
            return
        del self._entries[key]
        if not self._readiness.closed:
            self._readiness.unwatch(key)

    def close(self) -> None:
        """Stop watching every channel and release the readiness source (idempotent; a running
        :meth:`run` raises ClosedResourceError). The channels stay open: their owners close
        them."""
        self._entries.clear()
        self._key_of.clear()
        self._backlog = []
        self._readiness.close()

    async def run(self, after_pass: Callable[[], None] | None = None) -> None:
        """Read the watched channels until cancelled, calling ``after_pass()`` after every
        pass. On exit (cancelled, closed, or a handler's exception) it closes the reader."""
        readiness = self._readiness
        entries = self._entries
        try:
            while True:
                if self._backlog:
                    await trio.lowlevel.checkpoint()
                    ready, self._backlog = self._backlog, []
                else:
                    ready = await readiness.wait(PASS_CHANNELS)
                handed = 0
                for index, key in enumerate(ready):
                    if handed >= PASS_MESSAGES:
                        self._backlog = ready[index:]
                        break
                    entry = entries.get(key)
                    if entry is not None:
                        handed += self._read(entry)
                        if entries.get(key) is entry:
                            readiness.after_read(key)
                if after_pass is not None:
                    after_pass()
        finally:
            self.close()

    def _read(self, entry: _Entry) -> int:
        """Read ``entry``'s stream once and hand over what it held; the messages handed (those
        a frame carries counted, :attr:`Message.carried`)."""
        channel = entry.channel
        handed = 0
        try:
            batch = channel.receive_batch_nowait(READ_BYTES)
            while batch:
                # A node agent's frame counts as the ranks' messages in it: they are what the
                # handler works through before the other tasks (the timers) run again.
                handed += sum(message.carried for message in batch)
                entry.on_messages(batch, trio.current_time())
                if not channel.holds_result or self._entries.get(entry.key) is not entry:
                    break
                # A wire error behind good frames: its bytes are consumed, so the stream may
                # never be reported readable again. Raise it now.
                batch = channel.receive_batch_nowait(READ_BYTES)
        except ChannelClosed:
            self._end(entry, None)
        except FlodlError as err:
            self._end(entry, err)
        return handed

    def _end(self, entry: _Entry, error: Exception | None) -> None:
        if self._entries.get(entry.key) is entry:
            self.discard(entry.channel)
            entry.on_end(error)
