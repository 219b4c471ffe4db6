"""A lean trio stream over a connected socket (the tcp:// and unix:// transports use it).

It keeps trio's stream semantics (every call is a checkpoint, concurrent senders or receivers
raise ``BusyResourceError``, ``ClosedResourceError`` after close, ``BrokenResourceError``
when the OS reports an error) with fewer layers than ``trio.SocketStream``: a receive waits
for readability first instead of trying a ``recv`` that would fail, and a send calls the
socket directly. A coordinator reads a thousand mostly idle connections, where those layers
cost about as much as decoding the frames.
"""

from __future__ import annotations

import errno
import operator
import socket
from typing import Any

import trio
import trio.lowlevel

DEFAULT_RECEIVE_SIZE = 64 * 1024

_CLOSED_ERRNOS = frozenset({errno.EBADF, errno.ENOTSOCK})


def _translate(err: OSError) -> trio.BrokenResourceError | trio.ClosedResourceError:
    if err.errno in _CLOSED_ERRNOS:
        return trio.ClosedResourceError("the socket was closed")
    return trio.BrokenResourceError(f"socket error: {err}")


class _OneTaskAtATime:
    """Trio's rule for one direction of a stream: a second task using it raises
    ``BusyResourceError``. ``with guard:`` holds the direction for a waiting call;
    :meth:`check` is for calls that never wait."""

    def __init__(self, doing: str) -> None:
        self._busy = False
        self._message = f"another task is already {doing} on this stream"

    def check(self) -> None:
        if self._busy:
            raise trio.BusyResourceError(self._message)

    def __enter__(self) -> None:
        self.check()
        self._busy = True

    def __exit__(self, *exc_info: object) -> None:
        self._busy = False


class SocketStream(trio.abc.HalfCloseableStream):
    """A ``trio.abc.HalfCloseableStream`` over ``sock`` (connected; made non-blocking here).

    The stream owns the socket: :meth:`aclose` closes it.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.socket = sock
        self._sending = _OneTaskAtATime("sending")
        self._receiving = _OneTaskAtATime("receiving")
        self._eof_sent = False

    # --- sending ------------------------------------------------------------------------

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send every byte of ``data``; a checkpoint. Cancelled midway, part may be sent."""
        with self._sending:
            if self._eof_sent:
                raise trio.ClosedResourceError("cannot send data after sending EOF")
            self._check_open()
            await trio.lowlevel.checkpoint_if_cancelled()
            sock = self.socket
            with memoryview(data) as view:
                total = 0
                while total < len(view):
                    try:
                        total += sock.send(view[total:])
                    except BlockingIOError:
                        await trio.lowlevel.wait_writable(sock)
                    except OSError as err:
                        raise _translate(err) from err
            await trio.lowlevel.cancel_shielded_checkpoint()

    def send_nowait(self, data: bytes | bytearray | memoryview) -> int:
        """Write as much of ``data`` as the socket takes now; the number of bytes (0 if none).

        Never waits and is not a checkpoint (for callers that write many streams in one
        step). Raises BusyResourceError while :meth:`send_all` is under way, and
        ClosedResourceError / BrokenResourceError as :meth:`send_all` does.
        """
        self._sending.check()
        if self._eof_sent:
            raise trio.ClosedResourceError("cannot send data after sending EOF")
        self._check_open()
        try:
            return self.socket.send(data)
        except BlockingIOError:
            return 0
        except OSError as err:
            raise _translate(err) from err

    async def wait_send_all_might_not_block(self) -> None:
        with self._sending:
            self._check_open()
            await trio.lowlevel.wait_writable(self.socket)

    async def send_eof(self) -> None:
        """Shut down the sending side (idempotent); the peer then reads end of stream."""
        with self._sending:
            self._check_open()
            await trio.lowlevel.checkpoint()
            if self._eof_sent:
                return
            try:
                self.socket.shutdown(socket.SHUT_WR)
            except OSError as err:
                raise _translate(err) from err
            self._eof_sent = True

    # --- receiving ----------------------------------------------------------------------

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """At least one byte and at most ``max_bytes``, or b"" at the end of the stream.

        Always a checkpoint: it waits for readability before it reads.
        """
        max_bytes = DEFAULT_RECEIVE_SIZE if max_bytes is None else operator.index(max_bytes)
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        with self._receiving:
            self._check_open()
            sock = self.socket
            while True:
                await trio.lowlevel.wait_readable(sock)
                try:
                    return sock.recv(max_bytes)
                except BlockingIOError:
                    continue  # a spurious wake-up
                except OSError as err:
                    raise _translate(err) from err

    def receive_nowait(self, max_bytes: int = DEFAULT_RECEIVE_SIZE) -> bytes:
        """What the socket holds now, at most ``max_bytes``; b"" at the end of the stream.

        Never waits and is not a checkpoint (for one task that reads many sockets as they
        become readable: :mod:`flodl.transports.socket_reader`). Raises ``trio.WouldBlock``
        when nothing has arrived, BusyResourceError while :meth:`receive_some` is under way,
        and ClosedResourceError / BrokenResourceError as :meth:`receive_some` does.
        """
        self._receiving.check()
        try:
            return self.socket.recv(max_bytes)
        except BlockingIOError:
            raise trio.WouldBlock from None
        except OSError as err:
            raise _translate(err) from err

    # --- closing and options --------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the socket (idempotent); tasks blocked on it get ClosedResourceError."""
        if self.socket.fileno() != -1:
            trio.lowlevel.notify_closing(self.socket)
            self.socket.close()
        await trio.lowlevel.checkpoint()

    def setsockopt(self, level: int, option: int, value: int | bytes) -> None:
        self.socket.setsockopt(level, option, value)

    def getsockopt(self, level: int, option: int) -> Any:
        return self.socket.getsockopt(level, option)

    def _check_open(self) -> None:
        if self.socket.fileno() == -1:
            raise trio.ClosedResourceError("the stream was closed")


def from_trio_stream(stream: trio.SocketStream) -> SocketStream:
    """Take over the socket of ``stream`` (which must not be used afterwards)."""
    return SocketStream(socket.socket(fileno=stream.socket.detach()))
