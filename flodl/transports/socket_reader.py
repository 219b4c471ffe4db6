"""One task that reads many socket channels: :class:`SocketReader`.

A :class:`~flodl.transports.channel_reader.ChannelReader` whose readiness is a private
level-triggered ``select.epoll`` in which every registered socket sits once, from
registration to :meth:`~flodl.transports.channel_reader.ChannelReader.discard`: the epoll fd
is readable while any socket is, so one trio wake-up serves every socket that became
readable since the last, where a reader task per socket pays a wake-up (and trio's re-arm of
the fd) for about two messages. What that saves at 1,024 ranks is in ``docs/benchmarks.md``
("Coordinator scale").

It serves channels over a socket on platforms with epoll (Linux); elsewhere, and for
channels without a socket, :meth:`SocketReader.serves` says no and the channel is read by a
task of its own. ``memory://`` channels have
:class:`~flodl.transports.memory_reader.MemoryReader`.
"""

from __future__ import annotations

import select
from collections.abc import Hashable

import trio
import trio.lowlevel

from flodl.transports.channel import Channel
from flodl.transports.channel_reader import (
    PASS_CHANNELS,
    PASS_MESSAGES,
    READ_BYTES,
    ChannelReader,
    EndHandler,
    MessagesHandler,
)
from flodl.transports.socket_stream import SocketStream

__all__ = [
    "EPOLL_AVAILABLE",
    "PASS_CHANNELS",
    "PASS_MESSAGES",
    "READ_BYTES",
    "EndHandler",
    "EpollReadiness",
    "MessagesHandler",
    "SocketReader",
]


EPOLL_AVAILABLE = hasattr(select, "epoll")
"""Whether this platform has epoll (Linux), which the socket reader needs."""


class EpollReadiness:
    """Readiness of socket channels, from a private level-triggered epoll (keys: fds)."""

    def __init__(self) -> None:
        self._epoll = select.epoll()

    @property
    def closed(self) -> bool:
        return self._epoll.closed

    @staticmethod
    def serves(channel: Channel) -> bool:
        return EPOLL_AVAILABLE and isinstance(channel.stream, SocketStream)

    def watch(self, channel: Channel) -> Hashable:
        stream = channel.stream
        if not isinstance(stream, SocketStream):
            raise ValueError(f"a {type(stream).__name__} has no socket to watch")
        if self._epoll.closed:
            raise trio.ClosedResourceError("the socket reader is closed")
        fd = stream.socket.fileno()
        try:
            self._epoll.register(fd, select.EPOLLIN)
        except FileExistsError:
            raise ValueError(f"this channel (fd {fd}) is already watched") from None
        return fd

    def unwatch(self, key: Hashable) -> None:
        assert isinstance(key, int)
        try:
            self._epoll.unregister(key)
        except OSError:
            pass  # the socket was closed already, which dropped it from the epoll

    async def wait(self, limit: int) -> list[Hashable]:
        await trio.lowlevel.wait_readable(self._epoll.fileno())
        return [fd for fd, _ in self._epoll.poll(0, limit)]

    def after_read(self, key: Hashable) -> None:
        """Nothing to do: the epoll is level-triggered."""

    def close(self) -> None:
        if not self._epoll.closed:
            trio.lowlevel.notify_closing(self._epoll.fileno())
            self._epoll.close()


class SocketReader(ChannelReader):
    """A :class:`ChannelReader` for channels over sockets (tcp://, unix://) where epoll is."""

    readiness_type = EpollReadiness
