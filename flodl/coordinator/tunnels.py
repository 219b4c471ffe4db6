"""Ranks that reach the coordinator through their node agent: one stream per rank, carried over
the agent's one connection.

A node agent (:mod:`flodl.agent`) accepts its ranks' connections and carries their bytes
(:class:`~flodl.wire.messages.TunnelUp`, :class:`~flodl.wire.messages.TunnelDown`). Here each
of those connections becomes a :class:`~flodl.transports.tunnel_stream.TunnelStream`, a
``trio.abc.Stream`` that the admission serves like any socket (one shared reader reads them
all, :mod:`flodl.transports.tunnel_reader`): the rank's own handshake and authenticated frames
pass through the agent untouched, so every rank is admitted, read, written and lost exactly as
one connected directly, and the machine sees the same messages. What the coordinator sends the
host's ranks is gathered by the agent's :class:`Downlink` and leaves as one frame per wake-up.

Guarantees: bytes reach each side in order; a stream's end (the rank's connection closed at
the agent, the agent gone, or the coordinator closing the stream) reaches the other side
once. A downlink whose agent cannot keep up (:data:`DOWNLINK_LIMIT` bytes queued) breaks:
every stream of that agent fails as a broken socket would.
"""

from __future__ import annotations

from collections import deque

import trio

from flodl.transports.channel import Channel
from flodl.transports.tunnel_stream import TunnelStream
from flodl.wire.fields import MAX_BLOB
from flodl.wire.messages import Message, TunnelDown, TunnelEnd

__all__ = ["DOWNLINK_LIMIT", "Downlink", "DownlinkHub"]

DOWNLINK_LIMIT = 64 << 20
"""Bytes queued for one agent before it is judged unable to keep up."""


class DownlinkHub:
    """Writes every agent's downlink from one task (:meth:`run`), once per scheduler step in
    which something was queued: a broadcast to thousands of ranks behind hundreds of agents
    costs one wake-up, not one per agent, and leaves as one frame per agent. A downlink whose
    connection cannot take its bytes at once is left to its own task (:meth:`Downlink.run`)."""

    def __init__(self) -> None:
        self._dirty: dict[Downlink, None] = {}
        self._wake = trio.Event()

    def mark(self, downlink: Downlink) -> None:
        """``downlink`` queued something: it is written at this task's next wake-up."""
        self._dirty[downlink] = None
        self._wake.set()

    async def run(self) -> None:
        """Write the marked downlinks without waiting, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            dirty, self._dirty = self._dirty, {}
            for downlink in dirty:
                downlink.write_nowait()


class Downlink:
    """What the coordinator sends one agent's ranks, queued and written as ``TunnelDown``
    frames: by the :class:`DownlinkHub` when given one (at once, everything queued in a
    step), else, and whenever the connection cannot take the bytes at once, by its own task
    (:meth:`run`). Either way in order: the ranks' bytes first, then the ends queued."""

    def __init__(self, channel: Channel, hub: DownlinkHub | None = None) -> None:
        self._channel = channel
        self._hub = hub
        self._slots: deque[int] = deque()
        self._chunks: deque[bytes] = deque()
        self._ended: list[int] = []
        self._queued_bytes = 0
        self._wake = trio.Event()
        self._own_task_writes = hub is None
        """The hub leaves this downlink to :meth:`run` (no hub, or its writes must wait)."""
        self.broken: BaseException | None = None
        """Why the downlink failed (its streams then fail too), or None."""

    def stream(self, slot: int) -> TunnelStream:
        """A new tunnel stream of this agent's, written through this downlink."""
        return TunnelStream(slot, self.push, self.end)

    def push(self, slot: int, data: bytes) -> None:
        """Queue ``data`` for tunnel ``slot``; never waits. BrokenResourceError once broken."""
        if self.broken is not None:
            raise trio.BrokenResourceError(f"the agent's connection failed: {self.broken!r}")
        if self._queued_bytes + len(data) > DOWNLINK_LIMIT:
            self.broken = trio.BrokenResourceError("the agent cannot keep up")
            raise self.broken
        for start in range(0, len(data), MAX_BLOB):
            self._slots.append(slot)
            self._chunks.append(data[start : start + MAX_BLOB])
        self._queued_bytes += len(data)
        self._queued()

    def end(self, slot: int) -> None:
        """Tell the agent the coordinator closed tunnel ``slot`` (after what was queued)."""
        self._ended.append(slot)
        self._queued()

    def _queued(self) -> None:
        if self._own_task_writes or self._hub is None:
            self._wake.set()
        else:
            self._hub.mark(self)

    def write_nowait(self) -> None:
        """Write what is queued if the connection takes it at once; what it does not take, and
        everything queued after it, is left to :meth:`run`. Never waits."""
        if self._own_task_writes or self.broken is not None:
            return
        messages = self._take()
        if not messages:
            return
        try:
            written = self._channel.send_nowait(messages)
        except trio.WouldBlock:  # an async send holds the channel: nothing was taken
            self._requeue(messages)
            written = False
        except Exception as err:  # the channel's typed errors; the streams report it
            self.broken = err
            written = False
        if not written:
            self._own_task_writes = True  # it flushes the rest (or returns, broken)
            self._wake.set()

    async def run(self) -> None:
        """Write what is left to this task until cancelled (all of it without a hub); on a
        failure record it in :attr:`broken` and return (the caller ends the agent's
        connection)."""
        try:
            while self.broken is None:
                await self._wake.wait()
                self._wake = trio.Event()
                await self._channel.flush()  # what a write without waiting left over
                while self._chunks or self._ended:
                    await self._channel.send_many(self._take())
                self._own_task_writes = self._hub is None
        except Exception as err:  # the channel's typed errors; the streams report it
            self.broken = err

    def _take(self) -> list[Message]:
        """Everything queued, as frames: TunnelDowns within a frame's size, then the ends."""
        out: list[Message] = []
        while self._chunks:
            slots: list[int] = []
            chunks: list[bytes] = []
            size = 0
            while self._chunks and (not chunks or size + len(self._chunks[0]) <= MAX_BLOB):
                slots.append(self._slots.popleft())
                chunk = self._chunks.popleft()
                chunks.append(chunk)
                size += len(chunk)
            self._queued_bytes -= size
            out.append(TunnelDown(tuple(slots), tuple(chunks)))
        ended, self._ended = self._ended, []
        out.extend(TunnelEnd(slot) for slot in ended)
        return out

    def _requeue(self, messages: list[Message]) -> None:
        """Put back what :meth:`_take` took (nothing of it was written), ahead of the rest."""
        ends = [m.slot for m in messages if isinstance(m, TunnelEnd)]
        downs = [m for m in messages if isinstance(m, TunnelDown)]
        for down in reversed(downs):
            for slot, chunk in zip(reversed(down.slots), reversed(down.chunks), strict=True):
                self._slots.appendleft(slot)
                self._chunks.appendleft(chunk)
                self._queued_bytes += len(chunk)
        self._ended[:0] = ends
