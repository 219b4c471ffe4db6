"""``tcp://host:port``: TCP streams with Nagle's algorithm off (small control frames go now)."""

from __future__ import annotations

import errno
import socket

import trio

from flodl.errors import AddressInUse, UnsupportedURL
from flodl.transports.base import ListenerBase
from flodl.transports.errors import SOCKET_ERRORS, map_exceptions
from flodl.transports.socket_stream import SocketStream, from_trio_stream
from flodl.transports.url import ParsedURL, format_tcp_url


def _host_port(address: ParsedURL) -> tuple[str, int]:
    if address.scheme != "tcp" or address.host is None or address.port is None:
        raise UnsupportedURL(f"{address.url!r} is not a tcp address")
    return address.host, address.port


def _set_nodelay(stream: SocketStream) -> None:
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)


class TcpListener(ListenerBase):
    """A listening TCP socket. ``url`` carries the bound address and port."""

    def __init__(self, inner: trio.SocketListener) -> None:
        self._inner = inner
        sockname = inner.socket.getsockname()
        self.url = format_tcp_url(sockname[0], sockname[1])

    @property
    def port(self) -> int:
        """The bound port (useful after asking for port 0)."""
        port: int = self._inner.socket.getsockname()[1]
        return port

    async def accept(self) -> SocketStream:
        """Next connection, with TCP_NODELAY set. Cancellation loses no pending connection."""
        with map_exceptions(SOCKET_ERRORS, f"accept failed on {self.url}"):
            stream = from_trio_stream(await self._inner.accept())
        _set_nodelay(stream)
        return stream

    async def aclose(self) -> None:
        """Close the listening socket (idempotent; closes even if cancelled)."""
        await self._inner.aclose()


class TcpTransport:
    """The tcp:// scheme."""

    scheme = "tcp"

    async def connect(self, address: ParsedURL) -> SocketStream:
        """Connect (happy eyeballs over the resolved addresses); TCP_NODELAY is set.

        Raises TransportError naming the URL when the host does not resolve or every
        address refuses. A silent host can take as long as the OS connect timeout: bound it
        with a cancel scope.
        """
        host, port = _host_port(address)
        if port == 0:
            raise UnsupportedURL(f"{address.url!r}: cannot connect to port 0")
        with map_exceptions(SOCKET_ERRORS, f"cannot connect to {address.url}"):
            stream = from_trio_stream(await trio.open_tcp_stream(host, port))
        _set_nodelay(stream)
        return stream

    async def open_listener(self, address: ParsedURL) -> TcpListener:
        """Listen on host:port (port 0: the OS picks one; the listener's url reports it).

        If the host resolves to several addresses, only the first is bound, so that the
        listener has exactly one address to report. A port held by a live socket raises
        AddressInUse.
        """
        host, port = _host_port(address)
        with map_exceptions(SOCKET_ERRORS, f"cannot listen on {address.url}"):
            try:
                listeners = await trio.open_tcp_listeners(port, host=host)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise AddressInUse(f"cannot listen on {address.url}: address in use") from exc
                raise
        first, *others = listeners
        for extra in others:
            extra.socket.close()
        return TcpListener(first)
