"""The agent's end of its ranks' tunnels: the host's ranks connect to the agent, and their bytes
travel to the coordinator over the agent's one connection.

Each rank connects to a Unix socket of the agent (``FLODL_COORDINATOR`` points there) as it
would to a coordinator, and its connection becomes tunnel ``slot``: what the rank sends goes up
untouched (its handshake and authenticated frames are the coordinator's business), what comes
down for the slot is written back to it. Each rank has a writer task of its own, so a rank that
reads slowly holds up no other. The coordinator sees each tunnel as the rank's own connection
(:mod:`flodl.coordinator.tunnels`).

Guarantees: bytes keep their order each way; a rank's connection that ends is reported up once
(``TunnelClosed``); a tunnel the coordinator ends is closed at the rank once what was sent down
before is written; when the agent's connection ends every rank's connection is closed, so each
rank sees its coordinator gone at once.
"""

from __future__ import annotations

import itertools
import logging
import math
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import trio

from flodl.transports import open_listener
from flodl.transports.base import Listener
from flodl.wire.messages import Message, TunnelClosed, TunnelOpen

log = logging.getLogger("flodl.agent")

__all__ = ["Chunk", "RankTunnels"]

READ_SIZE = 1 << 16


class Chunk:
    """Bytes rank tunnel ``slot`` sent, queued to go up (the link folds chunks into frames)."""

    __slots__ = ("data", "slot")

    def __init__(self, slot: int, data: bytes) -> None:
        self.slot = slot
        self.data = data


Up = Callable[[Message | Chunk], None]
"""Queue something to go up to the coordinator (never waits)."""


class _Tunnel:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.down, self.to_write = trio.open_memory_channel[bytes | None](math.inf)
        """What came down for this rank; None: the coordinator ended the tunnel."""


class RankTunnels:
    """The host's ranks' tunnels, through a Unix socket of this agent."""

    def __init__(self, up: Up) -> None:
        self._up = up
        self._tunnels: dict[int, _Tunnel] = {}
        self._slots = itertools.count()
        self._folder = Path(tempfile.mkdtemp(prefix="flodl-agent-"))
        self.url = f"unix://{self._folder / 'ranks.sock'}"
        """Where the ranks connect (their ``FLODL_COORDINATOR``)."""
        self._listener: Listener | None = None

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept the ranks' connections until cancelled; reports ``started`` once the socket
        listens (start the ranks after that). Closes every rank's connection and removes the
        socket when it ends, also when cancelled."""
        try:
            async with await open_listener(self.url) as listener, trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    stream = await listener.accept()
                    nursery.start_soon(self._carry, next(self._slots), stream)
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)

    def down(self, slot: int, data: bytes) -> None:
        """Bytes the coordinator sent tunnel ``slot`` (dropped if its rank is gone)."""
        tunnel = self._tunnels.get(slot)
        if tunnel is not None:
            tunnel.down.send_nowait(data)

    def end(self, slot: int) -> None:
        """The coordinator ended tunnel ``slot``: close its rank's connection once written."""
        tunnel = self._tunnels.get(slot)
        if tunnel is not None:
            tunnel.down.send_nowait(None)

    async def _carry(self, slot: int, stream: trio.abc.Stream) -> None:
        tunnel = self._tunnels[slot] = _Tunnel(stream)
        self._up(TunnelOpen(slot))
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write, tunnel, nursery.cancel_scope)
                while True:
                    try:
                        data = await stream.receive_some(READ_SIZE)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        data = b""
                    if not data:
                        break
                    self._up(Chunk(slot, bytes(data)))
                nursery.cancel_scope.cancel()
        finally:
            del self._tunnels[slot]
            self._up(TunnelClosed(slot))
            await trio.aclose_forcefully(stream)

    async def _write(self, tunnel: _Tunnel, carrying: trio.CancelScope) -> None:
        async for data in tunnel.to_write:
            if data is None:
                break
            try:
                await tunnel.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                break
        carrying.cancel()  # the rank's connection ends (read side too)
