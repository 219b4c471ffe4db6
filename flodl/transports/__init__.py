"""Raw byte streams, chosen by URL: ``tcp://host:port``, ``unix:///path``, ``memory://name``.

>>> async with await open_listener("tcp://127.0.0.1:0") as listener:  # doctest: +SKIP
...     stream = await connect(listener.url)

Adding a scheme is adding a module with a :class:`Transport` and calling
:func:`register_transport`.
"""

from __future__ import annotations

import trio

from flodl.errors import UnsupportedURL
from flodl.transports.base import Listener, Transport
from flodl.transports.memory import MemoryTransport
from flodl.transports.tcp import TcpTransport
from flodl.transports.unix import UnixTransport
from flodl.transports.url import ParsedURL, parse_url

__all__ = [
    "Listener",
    "ParsedURL",
    "Transport",
    "connect",
    "open_listener",
    "parse_url",
    "register_transport",
    "transport_for",
]

_TRANSPORTS: dict[str, Transport] = {}


def register_transport(transport: Transport) -> None:
    """Make ``transport`` serve its scheme (replacing the previous one for that scheme)."""
    _TRANSPORTS[transport.scheme] = transport


def transport_for(address: ParsedURL) -> Transport:
    """The registered transport of ``address.scheme``; UnsupportedURL if there is none."""
    try:
        return _TRANSPORTS[address.scheme]
    except KeyError:
        raise UnsupportedURL(
            f"{address.url!r}: no transport registered for scheme {address.scheme!r}"
        ) from None


async def connect(url: str) -> trio.abc.Stream:
    """Open a connection to ``url``.

    Raises UnsupportedURL for a bad URL and TransportError (naming the URL) when nothing
    accepts the connection. Cancellation leaves no connection open.
    """
    address = parse_url(url)
    return await transport_for(address).connect(address)


async def open_listener(url: str) -> Listener:
    """Listen on ``url``; the listener's ``url`` names the address actually bound.

    Raises UnsupportedURL for a bad URL, AddressInUse when a live listener holds the address,
    TransportError for other failures.
    """
    address = parse_url(url)
    return await transport_for(address).open_listener(address)


register_transport(TcpTransport())
register_transport(UnixTransport())
register_transport(MemoryTransport())
