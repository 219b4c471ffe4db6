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

import collections
import enum
import math
import operator
from collections.abc import Callable

import attrs
import trio

from flodl.errors import ConfigError

DEFAULT_CAPACITY = 65536


def _non_negative_finite(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"FaultPlan.{attribute.name} must be a finite number >= 0, got {value!r}")


def _optional_byte_count(
    instance: object, attribute: attrs.Attribute[int | None], value: int | None
) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"FaultPlan.{attribute.name} must be None or an int >= 0, got {value!r}")


@attrs.frozen
class FaultPlan:
    """How a memory link misbehaves: added latency, a byte budget, a partition.

    See the module docstring for the exact semantics. The default plan is a perfect link.
    """

    latency: float = attrs.field(default=0.0, validator=_non_negative_finite)
    cut_after_bytes: int | None = attrs.field(default=None, validator=_optional_byte_count)
    partitioned: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


class Link:
    """The fault plan shared by a group of connections (those made through one listener name).

    :meth:`set_plan` applies at once to every connection of the link, existing and future.
    """

    __slots__ = ("_healed", "_held", "_hooked", "_plan")

    def __init__(self, plan: FaultPlan | None = None) -> None:
        self._plan = plan if plan is not None else FaultPlan()
        self._held: set[_Pipe] = set()  # pipes whose reader waits for a partition to heal
        self._hooked: set[_Pipe] = set()  # pipes with a readable hook (told of every plan)
        self._healed = trio.lowlevel.ParkingLot()

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    def set_plan(self, plan: FaultPlan) -> None:
        """Replace the plan now; readers held by a partition re-check it (no checkpoint)."""
        self._plan = plan
        for pipe in list(self._held | self._hooked):
            pipe.readable.wake()
        self._healed.unpark_all()

    def hold(self, pipe: _Pipe) -> None:
        """Register a reader that waits for the partition to heal."""
        self._held.add(pipe)

    def release(self, pipe: _Pipe) -> None:
        self._held.discard(pipe)

    def hook(self, pipe: _Pipe, hooked: bool) -> None:
        """Tell (or stop telling) ``pipe``'s readable hook of every plan change."""
        if hooked:
            self._hooked.add(pipe)
        else:
            self._hooked.discard(pipe)

    async def wait_until_flowing(self) -> None:
        """Return once the link is not partitioned. Always a checkpoint."""
        if not self._plan.partitioned:
            await trio.lowlevel.checkpoint()
        while self._plan.partitioned:
            await self._healed.park()


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

    Each end of a stream admits one receiving and one sending task at a time (the guards), so
    each of a pipe's two wait points has at most one waiter; a slot is cheaper than a
    ParkingLot. :meth:`wake` reschedules the parked task (no-op when none); a cancelled
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


class _Pipe:
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
        self.reverse: _Pipe = self

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
        self.link.hook(self, False)
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
        self.link.hook(self, hook is not None)
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
        self.link.hold(self)
        try:
            await self.readable.park()
        finally:
            self.link.release(self)

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


class MemoryStream(trio.abc.HalfCloseableStream):
    """One end of an in-memory connection; see the module docstring for its semantics.

    Cancellation: a cancelled ``receive_some`` takes no bytes. A ``send_all`` cancelled while
    waiting for buffer room has already queued its bytes (trio leaves the stream's state
    unspecified after a cancelled send; here it is simply "sent"). ``aclose`` closes even if
    cancelled.
    """

    def __init__(self, outgoing: _Pipe, incoming: _Pipe) -> None:
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
    forward = _Pipe(shared, capacity)
    backward = _Pipe(shared, capacity)
    forward.reverse = backward
    backward.reverse = forward
    return MemoryStream(forward, backward), MemoryStream(backward, forward)
