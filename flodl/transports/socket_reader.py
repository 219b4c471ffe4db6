"""One task that reads many socket channels: :class:`SocketReader`.

A coordinator serving a thousand ranks over ``tcp://`` or ``unix://`` spends most of its time
not on frames but on waking up for them: with one reader task per connection, every readable
socket costs a trio wake-up (the socket re-armed in trio's epoll, a task switch, a checkpoint)
for about two messages: a rank's frames arrive 100 ms apart, so no design with a task per
socket wakes less often. Measured in ``bench/coordinator_scale.py --mode split`` at 1,024 ranks
(11 messages per rank per second), that design spent 49.6 us of CPU per message with a p99
latency of 51.5 ms; this reader brought it to 32.7 us and 18.1 ms (about 21 messages per
wake-up).

Here one task waits on a private level-triggered ``select.epoll`` in which every registered
socket sits once, from registration to :meth:`SocketReader.discard`: the epoll fd is readable
while any socket is, so one trio wake-up serves every socket that became readable since the
last, each read once without waiting. A pass reads at most :data:`PASS_SOCKETS` sockets, at
most :data:`SOCKET_BYTES` from each, and no further socket once it has handed over
:data:`PASS_MESSAGES` messages; then it lets the other tasks run. Sockets left over are read
first in the next pass, so a flooding peer can neither starve the others nor stall the event
loop. The full figures are in ``docs/benchmarks.md`` ("Coordinator scale").

Channels without a socket (``memory://``) are not for this reader: their owner keeps a read
loop per channel (:meth:`SocketReader.can_read` tells them apart).
"""

from __future__ import annotations

import select
from collections.abc import Callable

import attrs
import trio
import trio.lowlevel

from flodl.errors import ChannelClosed, FlodlError
from flodl.transports.channel import Channel
from flodl.transports.socket_stream import SocketStream
from flodl.wire.messages import Message

SOCKET_BYTES = 16 * 1024
"""Most bytes read from one socket in one pass (about 150 Batch frames)."""

PASS_MESSAGES = 256
"""A pass reads no further socket once it has handed over this many messages."""

PASS_SOCKETS = 256
"""Most sockets read in one pass."""

MessagesHandler = Callable[[list[Message], float], None]
"""``on_messages(batch, now)``: a channel's messages in order, with the time they were read."""

EndHandler = Callable[[Exception | None], None]
"""``on_end(error)``: the channel ended (None: the peer closed it cleanly at a frame boundary)."""


@attrs.define(eq=False)
class _Entry:
    channel: Channel
    fd: int
    on_messages: MessagesHandler
    on_end: EndHandler


class SocketReader:
    """Reads every added socket channel from the one task that runs :meth:`run`.

    For each channel the handlers are called from that task, never concurrently:
    ``on_messages`` with every batch of messages in the order they were sent (never empty),
    and ``on_end`` exactly once when the channel ends (clean end of stream, a wire error, a
    broken or reset socket), after the messages that came before the problem. The channel is
    discarded before ``on_end`` is called. Exceptions raised by a handler are not caught: they
    end :meth:`run` (a handler deals with its own peer's misbehaviour, for instance by calling
    :meth:`discard`).
    """

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._entries: dict[int, _Entry] = {}
        self._fd_of: dict[Channel, int] = {}
        self._backlog: list[int] = []
        """Ready sockets a capped pass did not read; read first by the next pass."""

    @staticmethod
    def can_read(channel: Channel) -> bool:
        """Whether ``channel`` runs over a socket this reader can watch."""
        return isinstance(channel.stream, SocketStream)

    @property
    def channels(self) -> int:
        """How many channels are watched."""
        return len(self._entries)

    @property
    def closed(self) -> bool:
        return self._epoll.closed

    def add(self, channel: Channel, on_messages: MessagesHandler, on_end: EndHandler) -> None:
        """Watch ``channel`` (over a socket, nothing received on it yet) until it ends or is
        discarded. Raises ValueError for a channel it cannot read or one already watched, and
        ClosedResourceError once the reader is closed."""
        stream = channel.stream
        if not isinstance(stream, SocketStream):
            raise ValueError(f"a {type(stream).__name__} has no socket to watch")
        if channel.holds_result:
            raise ValueError("the channel holds received messages; add it before reading")
        if self._epoll.closed:
            raise trio.ClosedResourceError("the socket reader is closed")
        fd = stream.socket.fileno()
        if fd in self._entries or channel in self._fd_of:
            raise ValueError(f"this channel (fd {fd}) is already watched")
        self._epoll.register(fd, select.EPOLLIN)
        self._entries[fd] = _Entry(channel, fd, on_messages, on_end)
        self._fd_of[channel] = fd

    def discard(self, channel: Channel) -> None:
        """Stop watching ``channel`` (idempotent; its handlers are not called again). Call it
        before the channel's socket is closed."""
        fd = self._fd_of.pop(channel, None)
        if fd is None:
            return
        del self._entries[fd]
        if not self._epoll.closed:
            try:
                self._epoll.unregister(fd)
            except OSError:
                pass  # the socket was closed already, which dropped it from the epoll

    def close(self) -> None:
        """Stop watching every channel and close the epoll (idempotent; a running :meth:`run`
        raises ClosedResourceError). The channels stay open: their owners close them."""
        self._entries.clear()
        self._fd_of.clear()
        self._backlog = []
        if not self._epoll.closed:
            trio.lowlevel.notify_closing(self._epoll.fileno())
            self._epoll.close()

    async def run(self, after_pass: Callable[[], None] | None = None) -> None:
        """Read the watched channels until cancelled, calling ``after_pass()`` after every
        pass. On exit (cancelled, closed, or a handler's exception) it closes the reader."""
        epoll = self._epoll
        entries = self._entries
        try:
            while True:
                if self._backlog:
                    await trio.lowlevel.checkpoint()
                    ready, self._backlog = self._backlog, []
                else:
                    await trio.lowlevel.wait_readable(epoll.fileno())
                    ready = [fd for fd, _ in epoll.poll(0, PASS_SOCKETS)]
                handed = 0
                for index, fd in enumerate(ready):
                    if handed >= PASS_MESSAGES:
                        self._backlog = ready[index:]
                        break
                    entry = entries.get(fd)
                    if entry is not None:
                        handed += self._read(entry)
                if after_pass is not None:
                    after_pass()
        finally:
            self.close()

    def _read(self, entry: _Entry) -> int:
        """Read ``entry``'s socket once and hand over what it held; the messages handed."""
        channel = entry.channel
        handed = 0
        try:
            batch = channel.receive_batch_nowait(SOCKET_BYTES)
            while batch:
                handed += len(batch)
                entry.on_messages(batch, trio.current_time())
                if not channel.holds_result or self._entries.get(entry.fd) is not entry:
                    break
                # A wire error behind good frames: its bytes are consumed, so the socket may
                # never be readable again. Raise it now.
                batch = channel.receive_batch_nowait(SOCKET_BYTES)
        except ChannelClosed:
            self._end(entry, None)
        except FlodlError as err:
            self._end(entry, err)
        return handed

    def _end(self, entry: _Entry, error: Exception | None) -> None:
        if self._entries.get(entry.fd) is entry:
            self.discard(entry.channel)
            entry.on_end(error)
