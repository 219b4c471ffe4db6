"""The messages between a node agent and its coordinator (tags 128-191).

Part of the one catalogue, :mod:`flodl.wire.messages` (which imports them): tags 128-159 travel
from an agent to the coordinator, 160-191 back. A rank's channel accepts none of them, and an
agent's channel nothing else. The node's ranks reach the coordinator through their agent: each
rank's connection is a *tunnel* whose bytes (the rank's own handshake and authenticated frames,
untouched) the agent carries in :class:`TunnelUp` and :class:`TunnelDown`, so a host holds one
connection to the coordinator however many ranks it runs.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from flodl.wire.fields import blob_list, boolean, f64, i64, text, u64, u64_list
from flodl.wire.message_base import Message

__all__ = [
    "FROM_AGENT",
    "TO_AGENT",
    "AgentJoin",
    "AgentRefusal",
    "AgentStop",
    "AssignRanks",
    "RankExited",
    "RunOver",
    "TunnelClosed",
    "TunnelDown",
    "TunnelEnd",
    "TunnelOpen",
    "TunnelUp",
]


@attrs.frozen
class AgentJoin(Message):
    """A node agent's first message: it speaks for node ``node_rank`` (the rank its hello
    carried), which runs ``nproc`` ranks, on host ``host``."""

    TAG: ClassVar[int] = 128
    node_rank: int = u64()
    nproc: int = u64()
    host: str = text()


@attrs.frozen
class RankExited(Message):
    """A rank process of the agent's node exited: ``returncode`` as Python gives it (``-N``:
    killed by signal N), ``restarting``: the agent starts the rank again, ``tail``: the last
    lines of its output (a traceback)."""

    TAG: ClassVar[int] = 129
    rank: int = u64()
    pid: int = u64()
    returncode: int = i64()
    exited_unix: float = f64()
    restarting: bool = boolean()
    tail: str = text(default="")


@attrs.frozen
class AgentStop(Message):
    """The agent was told to stop (Ctrl-C, SIGTERM, SIGHUP): the run ends with a save."""

    TAG: ClassVar[int] = 130
    reason: str = text()


@attrs.frozen
class TunnelOpen(Message):
    """One of the node's ranks connected to the agent: its bytes travel as tunnel ``slot``
    (an agent's own number for the connection, never reused while the agent lives)."""

    TAG: ClassVar[int] = 131
    slot: int = u64()


@attrs.frozen
class TunnelUp(Message):
    """What the node's ranks sent, in order: ``chunks[i]`` from tunnel ``slots[i]``. Whatever
    arrived together travels in one frame (a window's batch reports, heartbeats, a round's
    acks of every rank of the host)."""

    TAG: ClassVar[int] = 132
    slots: tuple[int, ...] = u64_list()
    chunks: tuple[bytes, ...] = blob_list()


@attrs.frozen
class TunnelClosed(Message):
    """Tunnel ``slot``'s rank connection ended on the agent's side."""

    TAG: ClassVar[int] = 133
    slot: int = u64()


@attrs.frozen
class AssignRanks(Message):
    """The coordinator's answer to :class:`AgentJoin`: the node runs ranks ``first_rank`` to
    ``first_rank + nproc - 1`` of ``world_size``."""

    TAG: ClassVar[int] = 160
    first_rank: int = u64()
    nproc: int = u64()
    world_size: int = u64()


@attrs.frozen
class RunOver(Message):
    """The run has ended (``reason``): the agent restarts no rank from now on."""

    TAG: ClassVar[int] = 161
    reason: str = text()


FROM_AGENT: tuple[type[Message], ...] = (
    AgentJoin,
    RankExited,
    AgentStop,
    TunnelOpen,
    TunnelUp,
    TunnelClosed,
)
"""Messages a node agent sends to the coordinator."""


@attrs.frozen
class TunnelDown(Message):
    """What the coordinator sends the node's ranks, in order: ``chunks[i]`` for tunnel
    ``slots[i]`` (a broadcast to the host is one frame)."""

    TAG: ClassVar[int] = 163
    slots: tuple[int, ...] = u64_list()
    chunks: tuple[bytes, ...] = blob_list()


@attrs.frozen
class TunnelEnd(Message):
    """The coordinator ended tunnel ``slot``'s connection: the agent closes the rank's."""

    TAG: ClassVar[int] = 164
    slot: int = u64()


@attrs.frozen
class AgentRefusal(Message):
    """The coordinator will not take this agent (``reason``); it closes the connection next."""

    TAG: ClassVar[int] = 162
    reason: str = text()


TO_AGENT: tuple[type[Message], ...] = (AssignRanks, RunOver, AgentRefusal, TunnelDown, TunnelEnd)
"""Messages the coordinator sends to a node agent."""
