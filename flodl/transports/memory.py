"""``memory://name``: in-process connections for tests and simulation.

A :class:`MemoryNetwork` maps names to listeners and to fault plans. The module-level
functions use one process-wide network, the one ``connect("memory://...")`` uses; a
simulation that wants isolation builds its own network and :class:`MemoryTransport`.

A fault plan belongs to a name, not to a listener: set it before or after the listener opens,
it survives the listener closing, and changing it affects every open connection made through
that name at once (semantics: :mod:`flodl.transports.memory_stream`).
"""

from __future__ import annotations

import math

import trio

from flodl.errors import AddressInUse, TransportError, UnsupportedURL
from flodl.transports.base import ListenerBase
from flodl.transports.memory_stream import (
    DEFAULT_CAPACITY,
    FaultPlan,
    Link,
    MemoryStream,
    memory_stream_pair,
)
from flodl.transports.url import ParsedURL

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_NETWORK",
    "FaultPlan",
    "MemoryListener",
    "MemoryNetwork",
    "MemoryStream",
    "MemoryTransport",
    "fault_plan",
    "set_fault_plan",
]


class MemoryNetwork:
    """Names -> listeners and fault plans, for one group of in-process peers."""

    def __init__(self) -> None:
        self._listeners: dict[str, MemoryListener] = {}
        self._links: dict[str, Link] = {}

    def link(self, name: str) -> Link:
        """The link (fault plan holder) of ``name``, created with a perfect plan if new."""
        link = self._links.get(name)
        if link is None:
            link = self._links[name] = Link()
        return link

    def set_fault_plan(self, name: str, plan: FaultPlan) -> None:
        """Apply ``plan`` to ``name`` now: to its open connections and to future ones."""
        self.link(name).set_plan(plan)

    def fault_plan(self, name: str) -> FaultPlan:
        """The plan in force for ``name`` (a perfect link if none was set)."""
        return self.link(name).plan

    def listener(self, name: str) -> MemoryListener | None:
        return self._listeners.get(name)

    def bind(self, name: str) -> MemoryListener:
        """Register a new listener under ``name``; AddressInUse if a live one holds it."""
        if name in self._listeners:
            raise AddressInUse(f"cannot listen on memory://{name}: a live listener holds it")
        listener = MemoryListener(self, name)
        self._listeners[name] = listener
        return listener

    def unbind(self, listener: MemoryListener) -> None:
        """Forget ``listener`` if it still holds its name."""
        if self._listeners.get(listener.name) is listener:
            del self._listeners[listener.name]

    async def connect(self, name: str, capacity: int = DEFAULT_CAPACITY) -> MemoryStream:
        """Connect to the listener on ``name`` and return the client end.

        Waits while the name's link is partitioned. Raises TransportError if no listener
        holds the name. Cancellation before return leaves no half-open connection.
        """
        link = self.link(name)
        await link.wait_until_flowing()
        listener = self._listeners.get(name)
        if listener is None:
            raise TransportError(f"cannot connect to memory://{name}: nobody is listening")
        client, server = memory_stream_pair(link, capacity)
        listener.deliver(server)
        return client


class MemoryListener(ListenerBase):
    """Accepts the connections made to one name of a MemoryNetwork."""

    def __init__(self, network: MemoryNetwork, name: str) -> None:
        self.name = name
        self.url = f"memory://{name}"
        self._network = network
        self._incoming, self._pending = trio.open_memory_channel[MemoryStream](math.inf)

    def deliver(self, server_end: MemoryStream) -> None:
        """Queue an incoming connection for accept()."""
        self._incoming.send_nowait(server_end)

    async def accept(self) -> MemoryStream:
        """Next queued connection; ClosedResourceError after (or during) aclose."""
        try:
            return await self._pending.receive()
        except trio.EndOfChannel:
            raise trio.ClosedResourceError("this memory listener is closed") from None

    async def aclose(self) -> None:
        """Release the name and close connections not yet accepted (their clients read EOF).

        A task blocked in accept() gets ClosedResourceError. Accepted connections stay open.
        Idempotent; closes even if cancelled.
        """
        self._network.unbind(self)  # from here on, nothing new is delivered
        unaccepted: list[MemoryStream] = []
        while True:
            try:
                unaccepted.append(self._pending.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        self._pending.close()
        self._incoming.close()
        for stream in unaccepted:
            await _close_now(stream)
        await trio.lowlevel.checkpoint()


async def _close_now(stream: MemoryStream) -> None:
    with trio.CancelScope(shield=True):
        await stream.aclose()


class MemoryTransport:
    """The memory:// scheme over ``network``, with ``capacity`` unread bytes per direction."""

    scheme = "memory"

    def __init__(
        self, network: MemoryNetwork | None = None, capacity: int = DEFAULT_CAPACITY
    ) -> None:
        self.network = network if network is not None else DEFAULT_NETWORK
        self.capacity = capacity

    async def connect(self, address: ParsedURL) -> MemoryStream:
        return await self.network.connect(_name(address), self.capacity)

    async def open_listener(self, address: ParsedURL) -> MemoryListener:
        await trio.lowlevel.checkpoint()
        return self.network.bind(_name(address))


def _name(address: ParsedURL) -> str:
    if address.scheme != "memory" or address.name is None:
        raise UnsupportedURL(f"{address.url!r} is not a memory address")
    return address.name


DEFAULT_NETWORK = MemoryNetwork()


def set_fault_plan(name: str, plan: FaultPlan) -> None:
    """Apply ``plan`` to ``memory://name`` in the process-wide network, now."""
    DEFAULT_NETWORK.set_fault_plan(name, plan)


def fault_plan(name: str) -> FaultPlan:
    """The plan in force for ``memory://name`` in the process-wide network."""
    return DEFAULT_NETWORK.fault_plan(name)
