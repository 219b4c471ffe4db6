"""reader_for: each kind of shared reader says which channels it serves; a channel over a
stream no kind serves gets None (its owner reads it with a task of its own)."""

from __future__ import annotations

import socket

import trio
import trio.testing

from flodl.transports.base import NowaitStream
from flodl.transports.channel import Channel
from flodl.transports.memory_reader import MemoryReader
from flodl.transports.memory_stream import memory_stream_pair
from flodl.transports.readers import reader_for
from flodl.transports.socket_reader import EPOLL_AVAILABLE, SocketReader
from flodl.transports.socket_stream import SocketStream
from flodl.wire.messages import TO_COORDINATOR_TAGS

KEY = b"reader-for-test-key-0123456789ab"


def channel_over(stream: trio.abc.Stream) -> Channel:
    return Channel(stream, send_key=KEY, receive_key=KEY, receive_tags=TO_COORDINATOR_TAGS)


def test_memory_channels_get_the_memory_reader() -> None:
    near, _ = memory_stream_pair()
    assert isinstance(near, NowaitStream)
    assert reader_for(channel_over(near)) is MemoryReader


def test_socket_channels_get_the_socket_reader_where_epoll_is() -> None:
    near, far = socket.socketpair()
    stream = SocketStream(near)
    try:
        assert isinstance(stream, NowaitStream)
        assert reader_for(channel_over(stream)) is (SocketReader if EPOLL_AVAILABLE else None)
    finally:
        near.close()
        far.close()


def test_other_streams_get_none() -> None:
    near, _ = trio.testing.memory_stream_pair()
    assert not isinstance(near, NowaitStream)
    assert reader_for(channel_over(near)) is None
