"""The coordinator's side of node agents: number their ranks, carry their ranks' connections,
hear their ranks' exits.

A node agent (:mod:`flodl.agent`) connects with its own hello flag and first says
:class:`~flodl.wire.messages.AgentJoin` (its node rank and how many ranks its host runs). The
:class:`~flodl.core.coordinator.hosts.HostTable` decides the ranks it runs; the agent is told
them with :class:`~flodl.wire.messages.AssignRanks` once every node before it has joined (agents
and the coordinator start in any order). From then on the agent reports each exit of its
ranks' processes (:class:`~flodl.wire.messages.RankExited`), which reaches the run's death
detection at once, as a local supervisor's does, and asks for a save-and-stop when it is
signalled (:class:`~flodl.wire.messages.AgentStop`). Each of its ranks' connections arrives as
a tunnel (:class:`~flodl.wire.messages.TunnelOpen`), handed to the admission as that rank's
stream (:mod:`flodl.coordinator.tunnels`); when the agent's connection ends, so do they. When
the run ends every agent hears :class:`~flodl.wire.messages.RunOver` and restarts no rank after
it.

An agent that claims what is not its own (a rank of another node, a second join, a node that
joined before with another rank count) is refused: it is told why
(:class:`~flodl.wire.messages.AgentRefusal`) and its connection ends with AgentRefused; the
run and the other agents are not disturbed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from functools import partial

import trio

from flodl.coordinator.admission import Tunneled
from flodl.coordinator.links import CONNECTION_ERRORS
from flodl.coordinator.tunnels import Downlink, DownlinkHub
from flodl.core.coordinator.hosts import HostTable
from flodl.errors import AgentRefused, ChannelClosed, HandshakeTimeout
from flodl.supervise.exits import RankExit
from flodl.transports.channel import Channel
from flodl.transports.tunnel_stream import TunnelStream
from flodl.wire.messages import (
    AgentJoin,
    AgentRefusal,
    AgentStop,
    AssignRanks,
    Message,
    RankExited,
    RunOver,
    TunnelClosed,
    TunnelOpen,
    TunnelUp,
)

log = logging.getLogger("flodl.coordinator.agents")

__all__ = ["AgentDesk"]


class AgentDesk:
    """Serves every node agent's connection for one coordinator.

    ``rank_exited`` and ``request_stop`` are the coordinator's (an exit goes to its death
    detection at once; a stop ends the run with a save); ``run_over`` is set when the run
    ends; ``join_timeout``: seconds an agent has to say AgentJoin after its handshake;
    ``tunnels``: where the streams of the ranks an agent carries go to be admitted.
    """

    def __init__(
        self,
        world_size: int,
        *,
        rank_exited: Callable[[RankExit], Sequence[str]],
        request_stop: Callable[[], None],
        run_over: trio.Event,
        join_timeout: float,
        tunnels: trio.MemorySendChannel[Tunneled],
    ) -> None:
        self.table = HostTable(world_size)
        self._tunnels = tunnels
        self._rank_exited = rank_exited
        self._request_stop = request_stop
        self._run_over = run_over
        self._join_timeout = join_timeout
        self._numbered: dict[int, trio.Event] = {}
        self.downlinks = DownlinkHub()
        """Writes what goes down to every agent (its task runs beside the coordinator's)."""
        self.exits: list[RankExited] = []
        """Every exit an agent reported, in order (with its output's tail)."""

    async def serve(self, node_rank: int, channel: Channel) -> None:
        """Serve node ``node_rank``'s agent until its connection ends.

        Raises AgentRefused (after telling the agent why) for a claim that is not its own,
        HandshakeTimeout when it does not join in time; either ends only this connection.
        Always forgets the agent on the way out (its node may be joined again).
        """
        with trio.move_on_after(self._join_timeout) as waiting:
            first = await channel.receive()
        if waiting.cancelled_caught:
            raise HandshakeTimeout(
                f"node {node_rank}'s agent did not say AgentJoin within {self._join_timeout} s"
            )
        try:
            join = self._joined(node_rank, first)
            fresh = self.table.join(node_rank, join.nproc)
        except AgentRefused as err:
            await _refuse(channel, err)
            raise
        log.info("node %d's agent joined from %s with %d ranks", node_rank, join.host, join.nproc)
        for numbered in fresh:
            self._numbered_event(numbered.node_rank).set()
        carried = _Carried(node_rank, Downlink(channel, self.downlinks))
        try:
            async with trio.open_nursery() as nursery:

                async def write_down() -> None:
                    await carried.downlink.run()
                    nursery.cancel_scope.cancel()  # returns only once the connection failed

                nursery.start_soon(write_down)
                nursery.start_soon(self._tell, node_rank, channel)
                await self._listen(node_rank, channel, carried)
                nursery.cancel_scope.cancel()
        finally:
            self.table.leave(node_rank)
            for stream in carried.streams.values():
                stream.feed_eof()  # the agent is gone: so is every rank it carried

    def _joined(self, node_rank: int, first: Message) -> AgentJoin:
        if not isinstance(first, AgentJoin):
            raise AgentRefused(
                f"node {node_rank}'s agent sent {type(first).__name__} before AgentJoin"
            )
        if first.node_rank != node_rank:
            raise AgentRefused(
                f"node {node_rank}'s agent joined as node {first.node_rank} (its hello said "
                f"{node_rank})"
            )
        return first

    def _runs(self, node_rank: int, rank: int) -> bool:
        """Whether ``rank`` is one of node ``node_rank``'s."""
        return self.table.owner(rank) == node_rank

    def _numbered_event(self, node_rank: int) -> trio.Event:
        return self._numbered.setdefault(node_rank, trio.Event())

    async def _tell(self, node_rank: int, channel: Channel) -> None:
        """Send the node its ranks once they are numbered, and RunOver once the run ends."""
        await self._numbered_event(node_rank).wait()
        numbered = self.table.ranks_of(node_rank)
        assert numbered is not None  # the event is set only once numbered
        await channel.send(AssignRanks(numbered.first_rank, numbered.nproc, self.table.world_size))
        await self._run_over.wait()
        await channel.send(RunOver("the run ended"))

    async def _listen(self, node_rank: int, channel: Channel, carried: _Carried) -> None:
        """Take the agent's messages until its connection ends; AgentRefused (the agent told
        why first) for one that claims what is not the agent's."""
        while True:
            try:
                message = await channel.receive()
            except ChannelClosed:
                return
            try:
                self._take(node_rank, message, carried)
            except AgentRefused as err:
                await _refuse(channel, err)
                raise

    def _take(self, node_rank: int, message: Message, carried: _Carried) -> None:
        if isinstance(message, TunnelUp):
            for slot, chunk in zip(message.slots, message.chunks, strict=True):
                carried.stream(slot).feed(chunk)
        elif isinstance(message, TunnelOpen):
            stream = carried.open(message.slot)
            self._tunnels.send_nowait((stream, partial(self._runs, node_rank)))
        elif isinstance(message, TunnelClosed):
            carried.stream(message.slot).feed_eof()
        elif isinstance(message, RankExited):
            if self.table.owner(message.rank) != node_rank:
                raise AgentRefused(
                    f"node {node_rank}'s agent reported the exit of rank {message.rank}, "
                    f"which it does not run"
                )
            self.exits.append(message)
            exit = RankExit(
                message.rank,
                message.pid,
                message.returncode,
                message.exited_unix,
                message.restarting,
            )
            for notice in self._rank_exited(exit):
                log.warning("%s", notice)
        elif isinstance(message, AgentStop):
            log.warning("node %d's agent asks the run to stop: %s", node_rank, message.reason)
            self._request_stop()
        else:
            raise AgentRefused(
                f"node {node_rank}'s agent sent {type(message).__name__} after joining"
            )


class _Carried:
    """The rank connections one agent carries: its downlink and a stream per tunnel slot."""

    def __init__(self, node_rank: int, downlink: Downlink) -> None:
        self.node_rank = node_rank
        self.downlink = downlink
        self.streams: dict[int, TunnelStream] = {}

    def open(self, slot: int) -> TunnelStream:
        if slot in self.streams:
            raise AgentRefused(f"node {self.node_rank}'s agent opened tunnel {slot} twice")
        stream = self.streams[slot] = self.downlink.stream(slot)
        return stream

    def stream(self, slot: int) -> TunnelStream:
        try:
            return self.streams[slot]
        except KeyError:
            raise AgentRefused(
                f"node {self.node_rank}'s agent sent on tunnel {slot}, which it never opened"
            ) from None


async def _refuse(channel: Channel, err: AgentRefused) -> None:
    """Tell the agent why it is refused; best effort (the refusal is raised either way)."""
    with contextlib.suppress(*CONNECTION_ERRORS):
        await channel.send(AgentRefusal(str(err)))
