"""``unix:///path``: Unix-domain stream sockets, owner-only (mode 0600).

Listening replaces a stale socket file (left by a process that died: connecting to it is
refused) and refuses a live one with AddressInUse. Closing the listener removes the socket
file, but only if it is still the one this listener created.
"""

from __future__ import annotations

import errno
import os
import socket
import stat

import trio

from flodl.errors import AddressInUse, UnsupportedURL
from flodl.transports.base import ListenerBase
from flodl.transports.errors import SOCKET_ERRORS, map_exceptions
from flodl.transports.socket_stream import SocketStream, from_trio_stream
from flodl.transports.url import ParsedURL

SOCKET_MODE = 0o600
_BACKLOG = 128
_BIND_ATTEMPTS = 3


def _socket_path(address: ParsedURL) -> str:
    if address.scheme != "unix" or address.path is None:
        raise UnsupportedURL(f"{address.url!r} is not a unix address")
    return address.path


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


class UnixListener(ListenerBase):
    """A listening Unix socket that owns its socket file."""

    def __init__(self, inner: trio.SocketListener, url: str, path: str) -> None:
        self._inner = inner
        self.url = url
        self.path = path
        self._file_identity = _identity(os.stat(path))

    async def accept(self) -> SocketStream:
        """Next connection. Cancellation loses no pending connection."""
        with map_exceptions(SOCKET_ERRORS, f"accept failed on {self.url}"):
            return from_trio_stream(await self._inner.accept())

    async def aclose(self) -> None:
        """Close the socket, then remove the socket file if it is still ours (same inode).

        Idempotent; the file is removed even if the close is cancelled.
        """
        try:
            await self._inner.aclose()
        finally:
            self._remove_own_file()

    def _remove_own_file(self) -> None:
        try:
            if _identity(os.lstat(self.path)) == self._file_identity:
                os.unlink(self.path)
        except FileNotFoundError:
            pass


class UnixTransport:
    """The unix:// scheme."""

    scheme = "unix"

    async def connect(self, address: ParsedURL) -> SocketStream:
        """Connect to the socket file; no such file or nobody listening -> TransportError."""
        path = _socket_path(address)
        with map_exceptions(SOCKET_ERRORS, f"cannot connect to {address.url}"):
            return from_trio_stream(await trio.open_unix_socket(path))

    async def open_listener(self, address: ParsedURL) -> UnixListener:
        """Bind the path with mode 0600 and listen.

        The mode is set between bind and listen: until listen, connecting is refused, so the
        file is never connectable with looser permissions. A stale socket file is removed and
        the bind retried; a live listener, or a path that is not a socket, raises
        AddressInUse. Two processes racing for one stale path can still both see it stale in
        the microseconds between another's bind and listen; do not share a path between
        processes started at the same moment.
        """
        path = _socket_path(address)
        with map_exceptions(SOCKET_ERRORS, f"cannot listen on {address.url}"):
            for _ in range(_BIND_ATTEMPTS):
                await trio.lowlevel.checkpoint()
                try:
                    sock = _bound_socket(path)
                except OSError as exc:
                    if exc.errno != errno.EADDRINUSE:
                        raise
                    await _remove_if_stale(path, address.url)
                    continue
                try:
                    os.chmod(path, SOCKET_MODE)
                    sock.listen(_BACKLOG)
                    return UnixListener(trio.SocketListener(sock), address.url, path)
                except BaseException:
                    sock.close()
                    _unlink_quietly(path)
                    raise
        raise AddressInUse(f"cannot listen on {address.url}: the socket file keeps reappearing")


def _bound_socket(path: str) -> trio.socket.SocketType:
    """A Unix stream socket bound to ``path``, bound in this thread; nothing left open if the
    bind fails.

    trio's own ``bind`` of a Unix socket runs in a worker thread (a path on a slow file system
    could block). On a run folder or a temporary folder the bind is one quick syscall, and a
    thread would make every listener's start depend on thread scheduling: under trio's
    autojumping test clock the clock jumps while the thread runs, past whatever deadline comes
    next (a coordinator's join timeout).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except BaseException:
        sock.close()
        raise
    return trio.socket.from_stdlib_socket(sock)


async def _remove_if_stale(path: str, url: str) -> None:
    """Remove ``path`` if it is a socket nobody listens on; raise AddressInUse if it is live.

    Probing a live listener opens (and at once closes) one connection to it.
    """
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(before.st_mode):
        raise AddressInUse(f"cannot listen on {url}: {path} exists and is not a socket")
    probe = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    try:
        await probe.connect(path)
    except ConnectionRefusedError:
        pass  # stale: nobody is listening
    except FileNotFoundError:
        return
    except OSError as exc:
        raise AddressInUse(f"cannot listen on {url}: {path} is in use ({exc})") from exc
    else:
        raise AddressInUse(f"cannot listen on {url}: a live listener holds {path}")
    finally:
        probe.close()
    try:
        # Remove only the file we probed, not one a new listener bound meanwhile.
        if _identity(os.lstat(path)) == _identity(before):
            os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
