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
from flodl.wire.messages import TunnelDown, TunnelEnd

__all__ = ["DOWNLINK_LIMIT", "Downlink"]

DOWNLINK_LIMIT = 64 << 20
"""Bytes queued for one agent before it is judged unable to keep up."""


class Downlink:
    """What the coordinator sends one agent's ranks, queued and written by one task
    (:meth:`run`) as ``TunnelDown`` frames: everything queued when it wakes, in order."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._slots: deque[int] = deque()
        self._chunks: deque[bytes] = deque()
        self._ended: list[int] = []
        self._queued_bytes = 0
        self._wake = trio.Event()
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
        self._wake.set()

    def end(self, slot: int) -> None:
        """Tell the agent the coordinator closed tunnel ``slot`` (after what was queued)."""
        self._ended.append(slot)
        self._wake.set()

    async def run(self) -> None:
        """Write what is queued until cancelled; on a failure record it in :attr:`broken`
        and return (the caller ends the agent's connection)."""
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                while self._chunks or self._ended:
                    await self._write_some()
        except Exception as err:  # the channel's typed errors; the streams report it
            self.broken = err

    async def _write_some(self) -> None:
        """One TunnelDown of what is queued (within a frame's size), then the ends queued
        before anything that is still to be written."""
        slots: list[int] = []
        chunks: list[bytes] = []
        size = 0
        while self._chunks and (not chunks or size + len(self._chunks[0]) <= MAX_BLOB):
            slots.append(self._slots.popleft())
            chunk = self._chunks.popleft()
            chunks.append(chunk)
            size += len(chunk)
        self._queued_bytes -= size
        if chunks:
            await self._channel.send(TunnelDown(tuple(slots), tuple(chunks)))
        if not self._chunks:
            ended, self._ended = self._ended, []
            for slot in ended:
                await self._channel.send(TunnelEnd(slot))
