"""The interfaces every transport implements: :class:`Transport`, :class:`Listener`, and the
streams' :class:`NowaitStream` half.

A transport moves raw bytes. Streams it returns are ``trio.abc.HalfCloseableStream`` where the
medium allows it, so a peer can say "no more from me" with ``send_eof`` and still read, and
:class:`NowaitStream` as well, so that one task can write and read many of them in one step.
"""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

import trio

from flodl.transports.url import ParsedURL


@runtime_checkable
class NowaitStream(Protocol):
    """The calls of a stream that never wait (flodl's socket and memory streams have them).

    Neither is a checkpoint, so one task can serve many streams per wake-up (the coordinator
    writes a broadcast to every rank in one step; a shared reader reads every readable
    channel in one pass). A stream without them still works everywhere, through its waiting
    calls only: :class:`~flodl.transports.channel.Channel` then answers its own ``_nowait``
    calls with ``trio.WouldBlock``.
    """

    def send_nowait(self, data: bytes | bytearray | memoryview) -> int:
        """Write as much of ``data`` as the stream takes now; the number of bytes (0: none).

        Raises BusyResourceError while a ``send_all`` is under way, and ClosedResourceError /
        BrokenResourceError as ``send_all`` does.
        """
        ...

    def receive_nowait(self, max_bytes: int) -> bytes:
        """What has arrived, at most ``max_bytes``; b"" at the end of the stream.

        Raises ``trio.WouldBlock`` when nothing has, BusyResourceError while a
        ``receive_some`` is under way, ClosedResourceError / BrokenResourceError as
        ``receive_some`` does.
        """
        ...


class Listener(Protocol):
    """A bound address that accepts incoming connections.

    ``url`` is the address actually bound (after ``tcp://host:0`` it names the chosen port), so
    it can be handed to peers as is. Usable as ``async with await open_listener(url) as l``.
    """

    url: str

    async def accept(self) -> trio.abc.Stream:
        """Wait for the next incoming connection and return its stream.

        Cancelling it loses no connection: one not yet accepted stays queued. Raises
        ``trio.ClosedResourceError`` once the listener is closed.
        """
        ...

    async def aclose(self) -> None:
        """Stop listening and release the address. Idempotent; closes even if cancelled."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class Transport(Protocol):
    """One URL scheme: how to connect to an address and how to listen on one."""

    scheme: str

    async def connect(self, address: ParsedURL) -> trio.abc.Stream:
        """Open a connection; raise a TransportError (with the URL) if it cannot be opened."""
        ...

    async def open_listener(self, address: ParsedURL) -> Listener:
        """Bind and listen; raise AddressInUse if a live listener holds the address."""
        ...


class ListenerBase(abc.ABC):
    """Shared plumbing for listeners: the async context manager closes on exit."""

    url: str

    @abc.abstractmethod
    async def accept(self) -> trio.abc.Stream: ...

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
