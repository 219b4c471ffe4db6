"""The two interfaces every transport implements: :class:`Transport` and :class:`Listener`.

A transport moves raw bytes. Streams it returns are ``trio.abc.HalfCloseableStream`` where the
medium allows it, so a peer can say "no more from me" with ``send_eof`` and still read.
"""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Protocol, Self

import trio

from flodl.transports.url import ParsedURL


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
