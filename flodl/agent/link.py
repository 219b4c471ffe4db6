"""The agent's connection to its coordinator: join, learn the node's ranks, report exits.

:func:`open_agent_link` connects (trying again while the coordinator is not up yet), completes
the agent's handshake, says :class:`~flodl.wire.messages.AgentJoin` and waits for the node's
ranks. The :class:`AgentLink` it returns is the agent's
:class:`~flodl.supervise.exits.ExitSink` (each exit of a rank's process goes to the coordinator
at once, with the tail of the rank's output) and what its stop signals act on
(:class:`~flodl.coordinator.signals.Stoppable`: a stop asks the coordinator to end the run with
a save). :meth:`AgentLink.run` carries the messages both ways until the coordinator ends the run
or is lost.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import trio

from flodl.agent.config import AgentConfig
from flodl.agent.sessions import RankSessions, Said
from flodl.errors import (
    AgentRefused,
    ChannelClosed,
    CoordinatorError,
    FlodlError,
    ProtocolError,
)
from flodl.supervise.exits import RankExit
from flodl.transports.channel import Channel
from flodl.transports.greeting import connect_agent
from flodl.transports.reach import local_address, reach_patiently
from flodl.wire.codec import EncodedMessage, PayloadDecoder
from flodl.wire.fields import MAX_ITEMS
from flodl.wire.messages import (
    TO_RANK_TAGS,
    AgentJoin,
    AgentRefusal,
    AgentStop,
    AssignRanks,
    KillRank,
    Message,
    RankEnd,
    RankExited,
    RanksDown,
    RanksUp,
    RunOver,
    from_payload,
)

__all__ = ["AgentLink", "NodeAssignment", "open_agent_link"]

FRAME_BYTES = 1 << 20
"""Payload bytes of the ranks' messages gathered into one ``RanksUp`` before the next."""

TAIL_CHARS = 2000
"""How much of a rank's output goes with the report of its exit (a traceback's tail)."""


@attrs.frozen
class NodeAssignment:
    """The ranks the coordinator gave this node, and this host's address as it sees it."""

    first_rank: int
    nproc: int
    world_size: int
    host: str

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc)


class AgentLink:
    """One agent's channel to its coordinator, once the node's ranks are known."""

    def __init__(
        self,
        channel: Channel,
        node_rank: int,
        log_dir: Path,
        key: bytes,
        assignment: NodeAssignment,
    ) -> None:
        self._channel = channel
        self._node_rank = node_rank
        self._log_dir = log_dir
        self._outgoing, self._queued = trio.open_memory_channel[Message | Said](math.inf)
        self.ranks = RankSessions(
            self._outgoing.send_nowait, key, assignment.ranks, assignment.world_size
        )
        """Where the node's ranks connect; the agent speaks for them over this link."""
        self._payloads = PayloadDecoder()
        self.run_over = False
        """The coordinator said the run ended (RunOver)."""
        self.lost: FlodlError | None = None
        """Why the coordinator was lost, when it was (None: it was not)."""
        self.ended = trio.Event()
        """Set once the run ended or the coordinator was lost: the ranks are to exit."""
        self.kill_rank: Callable[[int], None] = lambda _rank: None
        """What the coordinator's KillRank calls (the agent's
        :meth:`~flodl.agent.host_ranks.HostRanks.kill_silenced`)."""

    # --- ExitSink, Stoppable ----------------------------------------------------------------

    @property
    def run_ended(self) -> bool:
        """The run is over (RunOver came, or the coordinator is gone): restart no rank."""
        return self.ended.is_set()

    def rank_exited(self, exit: RankExit) -> Sequence[str]:
        """Report ``exit`` to the coordinator at once (queued; never blocks)."""
        tail = _tail(self._log_dir / f"rank{exit.rank}.log")
        report = RankExited(
            exit.rank, exit.pid, exit.returncode, exit.exited_unix, exit.restarting, tail
        )
        self._outgoing.send_nowait(report)
        return []

    async def wait_ended(self) -> None:
        """Return once the run ended or the coordinator was lost."""
        await self.ended.wait()

    def lost_ranks(self) -> Sequence[int]:
        """None known: the coordinator decides which ranks the run lost, and after the run's
        end every rank of the host gets the exit grace alike."""
        return ()

    def request_stop(self, save: bool = True) -> None:
        """Ask the coordinator to end the run with a save (a stop signal reached the agent)."""
        self._outgoing.send_nowait(AgentStop(f"node {self._node_rank}'s agent was signalled"))

    # --- the connection ---------------------------------------------------------------------

    async def run(self) -> None:
        """Send what is queued and take what the coordinator says until the connection ends.

        Returns once the coordinator is lost (:attr:`lost` says why) or the channel closed
        after RunOver; :attr:`ended` is set by then. Raises AgentRefused when the coordinator
        refuses the agent.
        """
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_queued)
                try:
                    await self._receive()
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self.ranks.close()  # the ranks' connections end with the agent's
            self.ended.set()

    async def _send_queued(self) -> None:
        """Send what is queued, in order; the ranks' messages queued together go up as one
        RanksUp (what arrived together: a round's acks, a window's reports)."""
        async for first in self._queued:
            items = [first]
            while True:
                try:
                    items.append(self._queued.receive_nowait())
                except trio.WouldBlock:
                    break
            try:
                await self._channel.send_many(_folded(items))
            except FlodlError as err:
                self._lose(err)
                return

    async def _receive(self) -> None:
        while True:
            try:
                message = await self._channel.receive()
            except ChannelClosed as err:
                if not self.run_over:
                    self._lose(err)
                return
            except FlodlError as err:
                self._lose(err)
                return
            if isinstance(message, RanksDown):
                try:
                    self._hand_down(message)
                except ProtocolError as err:
                    self._lose(err)
                    return
            elif isinstance(message, RankEnd):
                self.ranks.end(message.rank)
            elif isinstance(message, KillRank):
                self.kill_rank(message.rank)
            elif isinstance(message, RunOver):
                self.run_over = True
                self.ended.set()
            elif isinstance(message, AgentRefusal):
                who = f"node {self._node_rank}"
                raise AgentRefused(f"the coordinator refused {who}: {message.reason}")

    def _hand_down(self, down: RanksDown) -> None:
        """Each message of ``down`` to its ranks, decoded once; ProtocolError if one does not
        decode (the channel is not trusted after that: the coordinator is lost)."""
        for tag, payload, ranks in down.deliveries():
            message = from_payload(tag, self._payloads.decode(payload), TO_RANK_TAGS)
            encoded = EncodedMessage(message, payload)
            for rank in ranks:
                self.ranks.down(rank, encoded)

    def _lose(self, err: FlodlError) -> None:
        if self.lost is None and not self.run_over:
            self.lost = err
        self.ended.set()

    async def aclose(self) -> None:
        await self._channel.aclose()


async def open_agent_link(config: AgentConfig, key: bytes) -> tuple[AgentLink, NodeAssignment]:
    """Connect to the coordinator, join as ``config.node_rank`` and wait for the node's ranks.

    Waits as long as it takes for the nodes before this one to join (the caller bounds it).
    Raises CoordinatorError when no coordinator answers within the join timeout or it closes
    the connection first, the handshake's typed error when it refuses the agent (DuplicateRank:
    another agent speaks for this node), AgentRefused when it refuses the join. Nothing is left
    open on failure.
    """
    who = f"node {config.node_rank}'s agent"
    stream = await reach_patiently(config.coordinator, config.join_timeout, who)
    try:
        host = config.host or local_address(stream)
        channel = await connect_agent(stream, key, config.node_rank)
        await channel.send(AgentJoin(config.node_rank, config.nproc, socket.gethostname()))
        try:
            reply = await channel.receive()
        except ChannelClosed:
            raise CoordinatorError(f"{who}: the coordinator closed the connection") from None
        if isinstance(reply, AgentRefusal):
            raise AgentRefused(f"the coordinator refused {who}: {reply.reason}")
        if not isinstance(reply, AssignRanks):
            raise CoordinatorError(f"{who}: the coordinator sent {type(reply).__name__} first")
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    assignment = NodeAssignment(reply.first_rank, reply.nproc, reply.world_size, host)
    return AgentLink(channel, config.node_rank, config.run_dir, key, assignment), assignment


def _folded(items: Sequence[Message | Said]) -> list[Message]:
    """``items`` as messages, in order: each run of the ranks' messages one RanksUp (or more,
    each within :data:`FRAME_BYTES` and a list's length)."""
    out: list[Message] = []
    tags: list[int] = []
    payloads: list[bytes] = []
    size = 0

    def close_run() -> None:
        nonlocal size
        if payloads:
            out.append(RanksUp(tuple(tags), tuple(payloads)))
            tags.clear()
            payloads.clear()
            size = 0

    for item in items:
        if isinstance(item, Said):
            if payloads and (size + len(item.payload) > FRAME_BYTES or len(tags) >= MAX_ITEMS):
                close_run()
            tags.append(item.tag)
            payloads.append(item.payload)
            size += len(item.payload)
        else:
            close_run()
            out.append(item)
    close_run()
    return out


def _tail(log: Path) -> str:
    """The last :data:`TAIL_CHARS` characters of a rank's log ('' when there is none)."""
    try:
        with log.open("rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - 4 * TAIL_CHARS))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return text[-TAIL_CHARS:]
