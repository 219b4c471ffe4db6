"""The messages between a node agent and its coordinator (tags 128-191).

Part of the one catalogue, :mod:`flodl.wire.messages` (which imports them): tags 128-159 travel
from an agent to the coordinator, 160-191 back. A rank's channel accepts none of them, and an
agent's channel nothing else. The node's ranks reach the coordinator through their agent, which
speaks for them: each rank's handshake and frames end at the agent, which checks them and
carries the ranks' messages in :class:`RanksUp` and :class:`RanksDown`, many to a frame under
one MAC, so a host holds one connection to the coordinator however many ranks it runs.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from flodl.errors import MessageValidationError
from flodl.wire.fields import blob_list, boolean, f64, i64, text, u64, u64_list
from flodl.wire.message_base import Message

__all__ = [
    "FROM_AGENT",
    "TO_AGENT",
    "AgentJoin",
    "AgentRefusal",
    "AgentStop",
    "AssignRanks",
    "KillRank",
    "RankClosed",
    "RankEnd",
    "RankExited",
    "RankOpen",
    "RanksDown",
    "RanksUp",
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
class RankOpen(Message):
    """Rank ``rank`` of the node connected to the agent and passed its handshake there: the
    agent speaks for it from now on."""

    TAG: ClassVar[int] = 134
    rank: int = u64()


@attrs.frozen
class RanksUp(Message):
    """What the node's ranks sent, in order: message ``i`` has tag ``tags[i]`` and the CBOR
    payload ``payloads[i]``, as the rank framed it (each names its rank in its ``rank`` field).
    Whatever the ranks sent together travels in one frame under one MAC: a window's reports,
    heartbeats, a round's acks of every rank of the host."""

    TAG: ClassVar[int] = 135
    tags: tuple[int, ...] = u64_list()
    payloads: tuple[bytes, ...] = blob_list()

    def __attrs_post_init__(self) -> None:
        _equal_lengths(("tags", self.tags), ("payloads", self.payloads))

    @property
    def carried(self) -> int:
        """The ranks' messages in this frame."""
        return len(self.tags)


@attrs.frozen
class RankClosed(Message):
    """Rank ``rank``'s connection to the agent ended (the agent no longer speaks for it)."""

    TAG: ClassVar[int] = 136
    rank: int = u64()


def _equal_lengths(*fields: tuple[str, tuple[object, ...]]) -> None:
    lengths = [len(values) for _, values in fields]
    if len(set(lengths)) != 1:
        names = ", ".join(f"'{name}'" for name, _ in fields)
        raise MessageValidationError(
            f"fields {names}: expected lists of equal length, got {lengths}"
        )


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
    RankOpen,
    RanksUp,
    RankClosed,
)
"""Messages a node agent sends to the coordinator."""


@attrs.frozen
class RanksDown(Message):
    """What the coordinator sends the node's ranks, in order: message ``i`` (tag ``tags[i]``,
    CBOR payload ``payloads[i]``) goes to the next ``fanout[i]`` ranks of ``ranks``. A message
    for several of the host's ranks (a broadcast) travels once."""

    TAG: ClassVar[int] = 165
    tags: tuple[int, ...] = u64_list()
    payloads: tuple[bytes, ...] = blob_list()
    fanout: tuple[int, ...] = u64_list()
    ranks: tuple[int, ...] = u64_list()

    def __attrs_post_init__(self) -> None:
        _equal_lengths(("tags", self.tags), ("payloads", self.payloads), ("fanout", self.fanout))
        if 0 in self.fanout or sum(self.fanout) != len(self.ranks):
            raise MessageValidationError(
                f"field 'fanout': expected counts of at least 1 adding up to the "
                f"{len(self.ranks)} ranks, got {list(self.fanout)}"
            )

    def deliveries(self) -> list[tuple[int, bytes, tuple[int, ...]]]:
        """``(tag, payload, ranks)`` of each message, in order."""
        out = []
        at = 0
        for tag, payload, count in zip(self.tags, self.payloads, self.fanout, strict=True):
            out.append((tag, payload, self.ranks[at : at + count]))
            at += count
        return out


@attrs.frozen
class RankEnd(Message):
    """The coordinator ended rank ``rank``'s connection: the agent closes it, once what was
    sent to the rank before is written."""

    TAG: ClassVar[int] = 166
    rank: int = u64()


@attrs.frozen
class KillRank(Message):
    """The run declared rank ``rank`` dead for silence: the agent SIGKILLs its process (paused
    or stuck, it would not exit on its own) and restarts it as after any failure."""

    TAG: ClassVar[int] = 167
    rank: int = u64()


@attrs.frozen
class AgentRefusal(Message):
    """The coordinator will not take this agent (``reason``); it closes the connection next."""

    TAG: ClassVar[int] = 162
    reason: str = text()


TO_AGENT: tuple[type[Message], ...] = (
    AssignRanks,
    RunOver,
    AgentRefusal,
    RanksDown,
    RankEnd,
    KillRank,
)
"""Messages the coordinator sends to a node agent."""
