"""One direction of a ``memory://`` connection: a FIFO of chunks stamped with delivery times.

The writer end queues chunks, each stamped with the trio time at which it may be delivered
(its link's latency when sent); the reader waits for the head chunk's time. Markers for the end
of the stream and for a cut travel in the same FIFO. The guarantees this implements are those
of :mod:`flodl.transports.memory_stream`.
"""

from __future__ import annotations

import collections
import enum
import math
from collections.abc import Callable

import trio

from flodl.transports.memory_link import Link


class _Marker(enum.Enum):
    EOF = "eof"
    RESET = "reset"


_Chunk = tuple[float, bytes | memoryview | _Marker]
"""(deliver_at, item). Data is the sender's bytes object, or a memoryview of the part of one
left after a partial read (so reading a large chunk piecewise copies each byte once)."""

_AT_ONCE = -math.inf
"""The delivery stamp of a chunk sent with zero latency: ready as soon as it is at the head
(saves reading the clock on both ends of the hot path)."""


class _Waiter:
    """Where the one task that waits on one side of a pipe parks.

    Each end of a stream admits one receiving and one sending task at a time (the stream's
    guards), so each of a pipe's two wait points has at most one waiter; a slot is cheaper
    than a ParkingLot. :meth:`wake` reschedules the parked task (no-op when none); a cancelled
    :meth:`park` leaves the slot empty. A ``hook`` (if set) is called by every :meth:`wake`
    as well: a reader that watches the pipe without parking a task on it.
    """

    __slots__ = ("_task", "hook")

    def __init__(self) -> None:
        self._task: trio.lowlevel.Task | None = None
        self.hook: Callable[[], None] | None = None

    def wake(self) -> None:
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task)
        hook = self.hook
        if hook is not None:
            hook()

    async def park(self) -> None:
        if self._task is not None:  # the guards make this unreachable; never lose a waiter
            raise trio.BusyResourceError("another task is already waiting on this memory pipe")
        self._task = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, _raise_cancel: object) -> trio.lowlevel.Abort:
        self._task = None
        return trio.lowlevel.Abort.SUCCEEDED


class Pipe:
    """One direction of a connection: chunks queued by the writer end for the reader end."""

    __slots__ = (
        "broken",
        "buffered",
        "capacity",
        "chunks",
        "link",
        "readable",
        "reader_closed",
        "readers_waiting",
        "reverse",
        "sent",
        "writable",
        "writer_done",
    )

    def __init__(self, link: Link, capacity: int) -> None:
        self.link = link
        self.capacity = capacity
        self.chunks: collections.deque[_Chunk] = collections.deque()
        self.buffered = 0  # unread data bytes in chunks
        self.sent = 0  # data bytes ever queued, for cut_after_bytes
        self.writer_done = False  # send_eof or aclose on the writer end
        self.reader_closed = False  # aclose on the reader end
        self.broken = False  # cut: a RESET marker was queued (or the reader had closed)
        self.readers_waiting = 0
        self.readable = _Waiter()  # the reader parks here
        self.writable = _Waiter()  # the writer parks here
        self.reverse: Pipe = self

    def _push(self, item: bytes | _Marker) -> None:
        latency = self.link.plan.latency
        deliver_at = trio.current_time() + latency if latency else _AT_ONCE
        self.chunks.append((deliver_at, item))
        self.readable.wake()

    def check_writable(self) -> None:
        if self.writer_done:
            raise trio.ClosedResourceError("this memory stream is closed for sending")
        if self._is_reset() or self.reader_closed:
            raise trio.BrokenResourceError("the memory connection is broken or the peer closed it")

    def _is_reset(self) -> bool:
        return self.broken or self.reverse.broken

    def write(self, data: bytes) -> None:
        """Queue ``data`` (non-empty) now, applying cut_after_bytes."""
        budget = self.link.plan.cut_after_bytes
        if budget is not None and self.sent + len(data) > budget:
            allowed = max(budget - self.sent, 0)
            if allowed:
                self._queue_data(data[:allowed])
            self.reset()
            self.reverse.reset()
            raise trio.BrokenResourceError(
                f"memory connection cut after {budget} bytes by its fault plan"
            )
        self._queue_data(data)

    def _queue_data(self, data: bytes) -> None:
        self.sent += len(data)
        self.buffered += len(data)
        self._push(data)

    def write_eof(self) -> None:
        if not self.writer_done:
            self.writer_done = True
            if not self.reader_closed and not self._is_reset():
                self._push(_Marker.EOF)
        self.writable.wake()

    def reset(self) -> None:
        if not self.broken and not self.reader_closed:
            self._push(_Marker.RESET)
        self.broken = True
        self.writable.wake()

    def close_reader(self) -> None:
        self.link.hook(self.readable, False)
        self.reader_closed = True
        self.chunks.clear()
        self.buffered = 0
        self.readable.wake()
        self.writable.wake()

    def has_room(self) -> bool:
        return self.buffered <= self.capacity

    def might_accept(self) -> bool:
        # A hooked pipe's reader takes what lands at once, like a reader waiting.
        return (
            self.buffered < self.capacity
            or self.readers_waiting > 0
            or self.readable.hook is not None
        )

    async def send_all(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        self.check_writable()
        if data:
            self.write(data)
        if self.has_room():
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        while not self.has_room():
            await self.writable.park()
            self.check_writable()

    async def wait_writable(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.writer_done:
            raise trio.ClosedResourceError("this memory stream is closed for sending")
        if self.might_accept() or self._is_reset() or self.reader_closed:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        while True:
            await self.writable.park()
            if self.writer_done:
                raise trio.ClosedResourceError("this memory stream is closed for sending")
            if self.might_accept() or self._is_reset() or self.reader_closed:
                return

    async def receive(self, max_bytes: int | None) -> bytes:
        await trio.lowlevel.checkpoint_if_cancelled()
        blocked = False
        while True:
            if self.reader_closed:
                raise trio.ClosedResourceError("this memory stream is closed")
            if self.link.plan.partitioned:
                await self._park_held()
                blocked = True
                continue
            chunks = self.chunks
            if chunks:
                deliver_at, item = chunks[0]
                if deliver_at is _AT_ONCE or deliver_at <= trio.current_time():
                    if item is _Marker.RESET:
                        raise trio.BrokenResourceError("the memory connection was cut")
                    if item is _Marker.EOF:
                        data = b""
                    elif (
                        len(chunks) == 1
                        and type(item) is bytes
                        and (max_bytes is None or len(item) <= max_bytes)
                    ):  # the usual case: one whole chunk waiting, handed over as it is
                        chunks.popleft()
                        self.buffered -= len(item)
                        self.writable.wake()
                        data = item
                    else:
                        data = self._take(max_bytes)
                    if not blocked:
                        await trio.lowlevel.cancel_shielded_checkpoint()
                    return data
                with trio.move_on_at(deliver_at):
                    await self._park_waiting()
            else:
                await self._park_waiting()
            blocked = True

    def receive_nowait(self, max_bytes: int | None) -> bytes:
        """What is receivable now (b"" at the end of the stream), as :meth:`receive` would
        return it, without waiting; trio.WouldBlock when nothing is."""
        if self.reader_closed:
            raise trio.ClosedResourceError("this memory stream is closed")
        chunks = self.chunks
        if not chunks or self.link.plan.partitioned:
            raise trio.WouldBlock
        deliver_at, item = chunks[0]
        if deliver_at is not _AT_ONCE and deliver_at > trio.current_time():
            raise trio.WouldBlock
        if item is _Marker.RESET:
            raise trio.BrokenResourceError("the memory connection was cut")
        if item is _Marker.EOF:
            return b""
        return self._take(max_bytes)

    def receivable_at(self) -> float:
        """When :meth:`receive_nowait` will next return or raise without blocking, as far as
        is known now: -inf (now), a trio time (a chunk still in flight), or inf (nothing
        queued, or the link is partitioned: the readable hook will tell)."""
        if self.reader_closed:
            return _AT_ONCE
        chunks = self.chunks
        if not chunks or self.link.plan.partitioned:
            return math.inf
        return chunks[0][0]

    def set_hook(self, hook: Callable[[], None] | None) -> None:
        self.readable.hook = hook
        self.link.hook(self.readable, hook is not None)
        if hook is not None:
            self.writable.wake()  # a lockstep writer may now go ahead

    async def _park_waiting(self) -> None:
        self.readers_waiting += 1
        self.writable.wake()  # a lockstep writer may now go ahead
        try:
            await self.readable.park()
        finally:
            self.readers_waiting -= 1

    async def _park_held(self) -> None:
        self.link.hold(self.readable)
        try:
            await self.readable.park()
        finally:
            self.link.release(self.readable)

    def _take(self, max_bytes: int | None) -> bytes:
        """Pop ready data from the head, up to max_bytes; stop at markers and future chunks.

        The head chunk must be ready data. A whole chunk that is all there is to take is
        returned as the sender's own bytes object, without a copy.
        """
        chunks = self.chunks
        limit = math.inf if max_bytes is None else max_bytes
        now: float | None = None
        parts: list[bytes | memoryview] = []
        taken = 0
        while chunks and taken < limit:
            deliver_at, item = chunks[0]
            if isinstance(item, _Marker):
                break
            if deliver_at is not _AT_ONCE:
                if now is None:
                    now = trio.current_time()
                if deliver_at > now:
                    break
            room = limit - taken
            if len(item) > room:
                cut = int(room)
                view = memoryview(item)
                parts.append(view[:cut])
                chunks[0] = (deliver_at, view[cut:])
                taken += cut
                break
            parts.append(item)
            taken += len(item)
            chunks.popleft()
        self.buffered -= taken
        self.writable.wake()
        if len(parts) == 1 and type(parts[0]) is bytes:
            return parts[0]
        return b"".join(parts)
