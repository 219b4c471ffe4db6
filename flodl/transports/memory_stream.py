"""In-process byte streams with a fault plan: the medium of the ``memory://`` transport.

A connection is two one-way pipes. A pipe is a FIFO of chunks, each stamped with the trio
time at which it may be delivered; the reader waits for the head chunk's time. No task runs
per connection or per byte, so a simulation can hold thousands of connections.

Fault semantics (a :class:`FaultPlan` is read from the shared :class:`Link` at each use, so a
new plan applies at once to every existing connection of that link):

- ``latency``: a chunk sent at time ``t`` becomes receivable at ``t + latency`` (the latency
  in force when it was sent), and never before the chunks sent ahead of it. ``send_eof`` and
  ``aclose`` markers travel the same way. Connecting adds no latency, and a reader's
  ``aclose`` is felt by the writer at once (its next ``send_all`` raises
  ``BrokenResourceError``), partition or not.
- ``cut_after_bytes=N``: each direction of each connection carries at most N bytes in total
  (counted from the connection's start). The ``send_all`` that would exceed N queues the bytes
  up to N, breaks the connection and raises ``trio.BrokenResourceError``. After a break, each
  end first receives what was queued to it before the break, then ``BrokenResourceError``;
  every later ``send_all`` raises ``BrokenResourceError``, like a reset TCP connection.
- ``partitioned=True``: bytes stop flowing in both directions. Nothing is lost or raised:
  sends keep queueing (``send_all`` blocks only when the buffer is full, as always),
  receivers wait; when the plan turns ``partitioned`` off, the held bytes are delivered in
  order (at once if their latency has elapsed). New connections wait for the partition to
  heal (bound them with a cancel scope).

Buffering: ``send_all`` queues all its bytes, then waits until the unread bytes of its
direction are at most ``capacity``. ``capacity=0`` makes a lockstep stream: ``send_all``
returns once the reader has taken everything.

Reading without a task per stream: :meth:`MemoryStream.receive_nowait` takes what is
receivable now, and :meth:`MemoryStream.set_readable_hook` installs a callback called
whenever something lands in the stream's receive buffer (or the link's plan changes), so
one task can read many streams (:mod:`flodl.transports.memory_reader`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import trio

from flodl.errors import ConfigError
from flodl.transports.memory_link import FaultPlan, Link
from flodl.transports.memory_pipe import Pipe

__all__ = ["DEFAULT_CAPACITY", "FaultPlan", "Link", "MemoryStream", "memory_stream_pair"]

DEFAULT_CAPACITY = 65536


class _Guard:
    """Raises BusyResourceError when two tasks use one side of a stream at once."""

    __slots__ = ("_busy", "_message")

    def __init__(self, message: str) -> None:
        self._busy = False
        self._message = message

    def __enter__(self) -> None:
        if self._busy:
            raise trio.BusyResourceError(self._message)
        self._busy = True

    def __exit__(self, *exc_info: object) -> None:
        self._busy = False


class MemoryStream(trio.abc.HalfCloseableStream):
    """One end of an in-memory connection; see the module docstring for its semantics.

    Cancellation: a cancelled ``receive_some`` takes no bytes. A ``send_all`` cancelled while
    waiting for buffer room has already queued its bytes (trio leaves the stream's state
    unspecified after a cancelled send; here it is simply "sent"). ``aclose`` closes even if
    cancelled.
    """

    def __init__(self, outgoing: Pipe, incoming: Pipe) -> None:
        self._outgoing = outgoing
        self._incoming = incoming
        self._send_guard = _Guard("another task is already sending on this stream")
        self._receive_guard = _Guard("another task is already receiving on this stream")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with self._send_guard:
            await self._outgoing.send_all(bytes(data))

    def send_nowait(self, data: bytes | bytearray | memoryview) -> int:
        """Queue all of ``data`` now if the buffer has room (its length), else nothing (0).

        Never waits and is not a checkpoint (for callers that write many streams in one
        step). Like :meth:`send_all` it may take the buffer past ``capacity`` by one write.
        Raises BusyResourceError while :meth:`send_all` is under way, ClosedResourceError
        after :meth:`send_eof` or :meth:`aclose`, BrokenResourceError once the connection is
        cut or the peer closed it (a cut by the fault plan queues the bytes up to the cut).
        """
        with self._send_guard:
            pipe = self._outgoing
            pipe.check_writable()
            if not data:
                return 0
            if pipe.buffered > 0 and pipe.buffered >= pipe.capacity:
                return 0
            pipe.write(bytes(data))
            return len(data)

    async def wait_send_all_might_not_block(self) -> None:
        with self._send_guard:
            await self._outgoing.wait_writable()

    async def send_eof(self) -> None:
        """Queue an end-of-stream marker; the peer reads b"" after the bytes sent before it."""
        with self._send_guard:
            await trio.lowlevel.checkpoint()
            self._outgoing.write_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)
            if max_bytes < 1:
                raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        with self._receive_guard:
            return await self._incoming.receive(max_bytes)

    def receive_nowait(self, max_bytes: int | None = None) -> bytes:
        """What has arrived and is due now, at most ``max_bytes``; b"" at the end of the
        stream. Never waits and is not a checkpoint. Raises ``trio.WouldBlock`` when nothing
        is receivable (nothing queued, still in flight, or partitioned), BusyResourceError
        while :meth:`receive_some` is under way, BrokenResourceError once the connection is
        cut (after what was queued before the cut), ClosedResourceError after :meth:`aclose`.
        """
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)
            if max_bytes < 1:
                raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        with self._receive_guard:
            return self._incoming.receive_nowait(max_bytes)

    def receivable_at(self) -> float:
        """-inf if :meth:`receive_nowait` would not raise WouldBlock now; else the trio time
        it will stop raising it if nothing else happens (inf: not until something lands or
        the plan changes, which the readable hook reports)."""
        return self._incoming.receivable_at()

    def set_readable_hook(self, hook: Callable[[], None] | None) -> None:
        """Call ``hook()`` (None: stop) whenever something lands in the receive buffer (data,
        end of stream, a cut), when this end closes, and when the link's plan changes.

        It is called synchronously from the task that caused it (usually the peer's
        ``send_all``), so it must be cheap and must not raise. Data still in flight (a
        latency plan) is announced when sent, not when due: :meth:`receivable_at` says when.
        """
        self._incoming.set_hook(hook)

    async def aclose(self) -> None:
        """Close both directions: the peer reads b"" after what was sent, its sends break."""
        self._outgoing.write_eof()
        self._incoming.close_reader()
        await trio.lowlevel.checkpoint()


def memory_stream_pair(
    link: Link | None = None, capacity: int = DEFAULT_CAPACITY
) -> tuple[MemoryStream, MemoryStream]:
    """Two connected MemoryStream ends governed by ``link``'s fault plan (a private perfect
    link if None). ``capacity``: unread bytes per direction before ``send_all`` waits."""
    if capacity < 0:
        raise ConfigError(f"capacity must be >= 0, got {capacity}")
    shared = link if link is not None else Link()
    forward = Pipe(shared, capacity)
    backward = Pipe(shared, capacity)
    forward.reverse = backward
    backward.reverse = forward
    return MemoryStream(forward, backward), MemoryStream(backward, forward)
