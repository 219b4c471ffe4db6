"""The messages between a node agent and its coordinator (tags 128-191).

Part of the one catalogue, :mod:`flodl.wire.messages` (which imports them): tags 128-159 travel
from an agent to the coordinator, 160-191 back. A rank's channel accepts none of them, and an
agent's channel nothing else.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from flodl.wire.fields import boolean, f64, i64, text, u64
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


FROM_AGENT: tuple[type[Message], ...] = (AgentJoin, RankExited, AgentStop)
"""Messages a node agent sends to the coordinator."""


@attrs.frozen
class AgentRefusal(Message):
    """The coordinator will not take this agent (``reason``); it closes the connection next."""

    TAG: ClassVar[int] = 162
    reason: str = text()


TO_AGENT: tuple[type[Message], ...] = (AssignRanks, RunOver, AgentRefusal)
"""Messages the coordinator sends to a node agent."""
