"""A rank's messages to the coordinator, sent in the order the rank machine produced them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import trio

from flodl.errors import CoordinatorError, FlodlError, TransportError
from flodl.transports.channel import Channel
from flodl.wire.messages import Message

__all__ = ["Outbox"]


class Outbox:
    """Queued messages for one channel. :meth:`put` never waits; :meth:`flush` sends what is
    queued; :meth:`flush_soon` does it from a task of its own. A broken connection is
    reported once per failed send to ``on_broken`` and never raised."""

    def __init__(self, on_broken: Callable[[FlodlError], None]) -> None:
        self.channel: Channel | None = None
        self.closed = False
        """Set when nothing more may be sent (the coordinator is lost)."""
        self._on_broken = on_broken
        self._queue: deque[Message] = deque()
        self._flushing = False

    def put(self, message: Message) -> None:
        self._queue.append(message)

    def flush_soon(self, nursery: trio.Nursery | None) -> None:
        """Send what is queued from a new task in ``nursery`` (unless one already does)."""
        if self._queue and not self._flushing and nursery is not None:
            self._flushing = True
            nursery.start_soon(self.flush)

    async def flush(self) -> None:
        """Send the queue in order. A message is taken off the queue and queued for the
        channel's (fair) send lock in one step, so concurrent flushes keep the order."""
        try:
            while self._queue:
                await self.send(self._queue.popleft())
        finally:
            self._flushing = False

    async def send(self, message: Message) -> None:
        """Send now (behind the channel's earlier sends); never raises for a broken one."""
        channel = self.channel
        if channel is None or self.closed:
            return
        try:
            await channel.send(message)
        except TransportError as err:  # the channel maps stream errors to ours
            self._on_broken(CoordinatorError(f"lost the connection to the coordinator: {err}"))
