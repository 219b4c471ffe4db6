"""Which shared reader serves a channel: :func:`reader_for`, over the registered kinds.

A shell that reads many channels from one task (the coordinator) asks :func:`reader_for` for
each new channel and starts one reader of that kind on first use; for a channel no kind
serves (``None``) it keeps a read loop of its own. A kind decides by itself, through
:meth:`~flodl.transports.channel_reader.ChannelReader.serves`, whether it can read a channel
here: over which stream, on which platform. Adding a kind is a subclass of
:class:`~flodl.transports.channel_reader.ChannelReader` and a :func:`register_reader`.
"""

from __future__ import annotations

from flodl.transports.channel import Channel
from flodl.transports.channel_reader import ChannelReader
from flodl.transports.memory_reader import MemoryReader
from flodl.transports.socket_reader import SocketReader

__all__ = ["register_reader", "reader_for"]

_KINDS: list[type[ChannelReader]] = []


def register_reader(kind: type[ChannelReader]) -> None:
    """Let ``kind`` serve the channels it says it serves (kinds are asked in this order)."""
    if kind not in _KINDS:
        _KINDS.append(kind)


def reader_for(channel: Channel) -> type[ChannelReader] | None:
    """The first registered kind of shared reader that serves ``channel``; None if none does."""
    for kind in _KINDS:
        if kind.serves(channel):
            return kind
    return None


register_reader(MemoryReader)
register_reader(SocketReader)
