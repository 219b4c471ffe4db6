"""A rank's connection carried through its node agent, as a ``trio.abc.Stream``.

The coordinator's end of one tunnel (:mod:`flodl.coordinator.tunnels` feeds it what the agent
carried up, and writes through the agent's downlink): the admission serves it as it serves a
socket, and, being a :class:`~flodl.transports.base.NowaitStream` with a readable hook, it is
written without waiting and read by one shared reader (:mod:`flodl.transports.tunnel_reader`).

Guarantees: bytes come out in the order they were fed; the end is read once everything before
it was; a closed stream tells its agent once, unless the rank's side had ended first.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

__all__ = ["TunnelStream"]


class TunnelStream(trio.abc.Stream):
    """One rank's connection through its agent, as the coordinator's admission sees it."""

    def __init__(
        self, slot: int, push: Callable[[int, bytes], None], end: Callable[[int], None]
    ) -> None:
        self.slot = slot
        self._push = push
        self._end = end
        self._buffer = bytearray()
        self._arrived = trio.Event()
        self._eof = False
        self._closed = False
        self._readable_hook: Callable[[], None] | None = None

    # --- what the agent's connection delivers --------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Bytes the rank sent, in order."""
        if not self._eof:
            self._buffer += data
            self._readable()

    def feed_eof(self) -> None:
        """The rank's connection ended (at the agent, or the agent is gone)."""
        self._eof = True
        self._readable()

    def set_readable_hook(self, hook: Callable[[], None] | None) -> None:
        """Call ``hook()`` whenever something becomes readable (bytes, or the end); a shared
        reader watches the stream this way (:mod:`flodl.transports.tunnel_reader`)."""
        self._readable_hook = hook

    @property
    def readable(self) -> bool:
        """Something is there to read (bytes, or the end not yet read)."""
        return bool(self._buffer) or self._eof

    def _readable(self) -> None:
        self._arrived.set()
        if self._readable_hook is not None:
            self._readable_hook()

    # --- trio.abc.Stream -----------------------------------------------------------------------

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while not self._buffer and not self._eof and not self._closed:
            await self._arrived.wait()
            self._arrived = trio.Event()
        if self._closed:
            raise trio.ClosedResourceError("the tunnel stream was closed")
        await trio.lowlevel.checkpoint()
        size = len(self._buffer) if max_bytes is None else max_bytes
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data  # b"" once the rank's connection ended and everything was read

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.send_nowait(data)
        await trio.lowlevel.checkpoint()

    def send_nowait(self, data: bytes | bytearray | memoryview) -> int:
        """Queue ``data`` for the rank (it never waits: the agent's downlink buffers)."""
        if self._closed:
            raise trio.ClosedResourceError("the tunnel stream was closed")
        if self._eof:
            raise trio.BrokenResourceError("the rank's connection through its agent ended")
        self._push(self.slot, bytes(data))
        return len(data)

    def receive_nowait(self, max_bytes: int) -> bytes:
        """What has arrived, at most ``max_bytes``; b"" at the end; WouldBlock when nothing."""
        if self._closed:
            raise trio.ClosedResourceError("the tunnel stream was closed")
        if not self._buffer:
            if self._eof:
                return b""
            raise trio.WouldBlock
        data = bytes(self._buffer[:max_bytes])
        del self._buffer[:max_bytes]
        return data

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._arrived.set()
            if not self._eof:
                self._end(self.slot)
        await trio.lowlevel.checkpoint()
