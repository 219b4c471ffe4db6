"""The coordinator's side of node agents: number their ranks, carry their ranks' connections,
hear their ranks' exits.

A node agent (:mod:`flodl.agent`) connects with its own hello flag and first says
:class:`~flodl.wire.messages.AgentJoin` (its node rank and how many ranks its host runs). The
:class:`~flodl.core.coordinator.hosts.HostTable` decides the ranks it runs; the agent is told
them with :class:`~flodl.wire.messages.AssignRanks` once every node before it has joined (agents
and the coordinator start in any order). From then on the agent reports each exit of its
ranks' processes (:class:`~flodl.wire.messages.RankExited`), which reaches the run's death
detection at once, as a local supervisor's does, and asks for a save-and-stop when it is
signalled (:class:`~flodl.wire.messages.AgentStop`). It speaks for its ranks: each rank that
passed its handshake at the agent is announced (:class:`~flodl.wire.messages.RankOpen`) and
handed to the admission as a :class:`~flodl.coordinator.carried.CarriedRank`; the messages of
all its ranks arrive together (:class:`~flodl.wire.messages.RanksUp`), each handed to its rank
in order; agents' frames are read as ranks' are, by the coordinator's shared reader, which
settles the effects once per pass. When the agent's connection ends, so do its ranks'. When
the run ends every agent hears :class:`~flodl.wire.messages.RunOver` and restarts no rank after
it.

An agent that claims what is not its own (a rank of another node, a message of a rank it did not
open, a second join, a node that joined before with another rank count) or sends what does not
decode is refused: it is told why
(:class:`~flodl.wire.messages.AgentRefusal`) and its connection ends with AgentRefused; the
run and the other agents are not disturbed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import trio

from flodl.coordinator.admission import Carried
from flodl.coordinator.carried import CarriedRank, Downlink, DownlinkHub
from flodl.coordinator.links import CONNECTION_ERRORS
from flodl.core.coordinator.hosts import HostTable
from flodl.core.coordinator.timeline import TimelineEvent
from flodl.errors import AgentRefused, ChannelClosed, HandshakeTimeout, ProtocolError
from flodl.supervise.exits import RankExit
from flodl.transports.channel import Channel
from flodl.transports.channel_reader import ChannelReader
from flodl.wire.codec import PayloadDecoder
from flodl.wire.messages import (
    TO_COORDINATOR_TAGS,
    AgentJoin,
    AgentRefusal,
    AgentStop,
    AssignRanks,
    Message,
    RankClosed,
    RankExited,
    RankOpen,
    RanksUp,
    RunOver,
    from_payload,
)

log = logging.getLogger("flodl.coordinator.agents")

__all__ = ["AgentDesk"]


class AgentDesk:
    """Serves every node agent's connection for one coordinator.

    ``rank_exited`` and ``request_stop`` are the coordinator's (an exit goes to its death
    detection at once; a stop ends the run with a save); ``run_over`` is set when the run
    ends; ``join_timeout``: seconds an agent has to say AgentJoin after its handshake;
    ``carried``: where the ranks an agent carries go to be admitted; ``reader_for(channel)``:
    the shared reader for an agent's channel (None: the agent's task reads it), which settles
    after each pass; ``settle()`` is called after each frame an agent's task read (the
    coordinator writes what its messages made it decide).
    """

    def __init__(
        self,
        world_size: int,
        *,
        rank_exited: Callable[[RankExit], Sequence[str]],
        request_stop: Callable[[], None],
        run_over: trio.Event,
        join_timeout: float,
        carried: trio.MemorySendChannel[Carried],
        settle: Callable[[], None] = lambda: None,
        reader_for: Callable[[Channel], ChannelReader | None] = lambda _channel: None,
    ) -> None:
        self.table = HostTable(world_size)
        self._carried = carried
        self._settle = settle
        self._reader_for = reader_for
        self._rank_exited = rank_exited
        self._request_stop = request_stop
        self._run_over = run_over
        self._join_timeout = join_timeout
        self._numbered: dict[int, trio.Event] = {}
        self.downlinks = DownlinkHub()
        """Writes what goes down to every agent (its task runs beside the coordinator's)."""
        self.exits: list[RankExited] = []
        """Every exit an agent reported, in order (with its output's tail)."""
        self._serving: dict[int, _Carried] = {}
        """The ranks each agent carries now, by node rank."""

    def on_event(self, seq: int, event: TimelineEvent) -> None:
        """An event sink (``Coordinator.add_event_sink``): a rank the run declares dead for
        silence is killed by its agent (paused or stuck, it would not exit on its own), which
        then restarts it as after any failure."""
        rank = event.silenced_rank
        if rank is None:
            return
        node_rank = self.table.owner(rank)
        carried = None if node_rank is None else self._serving.get(node_rank)
        if carried is not None:
            carried.downlink.kill(rank)

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
        carried = self._serving[node_rank] = _Carried(node_rank, Downlink(channel, self.downlinks))
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
            del self._serving[node_rank]
            self.table.leave(node_rank)
            gone = ChannelClosed(f"node {node_rank}'s agent is gone")
            for rank in carried.ranks.values():
                rank.ended(gone)  # the agent is gone: so is every rank it carried

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
        why first) for one that claims what is not the agent's, the channel's wire error for a
        bad frame.

        With a shared reader for the agent's kind of stream (the coordinator's), every agent
        whose frames arrived is read in one pass and the effects settled once per pass, as for
        ranks connected directly; else this task reads, and settles after each frame."""
        while channel.holds_result:  # what came with AgentJoin
            for message in await channel.receive_batch():
                await self._take_or_refuse(node_rank, message, carried, channel)
        reader = self._reader_for(channel)
        if reader is None:
            while True:
                try:
                    message = await channel.receive()
                except ChannelClosed:
                    return
                await self._take_or_refuse(node_rank, message, carried, channel)
        ended = trio.Event()
        failure: list[Exception] = []

        def on_messages(batch: list[Message], now: float) -> None:
            try:
                for message in batch:
                    self._take(node_rank, message, carried, now)
            except AgentRefused as err:
                reader.discard(channel)
                on_end(err)

        def on_end(error: Exception | None) -> None:
            if error is not None:
                failure.append(error)
            ended.set()

        reader.add(channel, on_messages, on_end)
        try:
            await ended.wait()
        finally:
            reader.discard(channel)
        if failure:
            if isinstance(failure[0], AgentRefused):
                await _refuse(channel, failure[0])
            raise failure[0]

    async def _take_or_refuse(
        self, node_rank: int, message: Message, carried: _Carried, channel: Channel
    ) -> None:
        try:
            self._take(node_rank, message, carried, trio.current_time())
        except AgentRefused as err:
            await _refuse(channel, err)
            raise
        finally:
            self._settle()

    def _take(self, node_rank: int, message: Message, carried: _Carried, now: float) -> None:
        if isinstance(message, RanksUp):
            self._hand_over(carried, message, now)
        elif isinstance(message, RankOpen):
            if self.table.owner(message.rank) != node_rank:
                raise AgentRefused(
                    f"node {node_rank}'s agent opened rank {message.rank}, which it does not run"
                )
            rank = carried.open(message.rank)
            self._carried.send_nowait((message.rank, rank))
        elif isinstance(message, RankClosed):
            carried.rank(message.rank).ended(None)
            carried.ranks.pop(message.rank)
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

    def _hand_over(self, carried: _Carried, up: RanksUp, now: float) -> None:
        """Hand each message of ``up`` to its rank, in order (a run of one rank's messages in
        one batch). AgentRefused for a message that does not decode or names a rank the agent
        did not open (those before it are handed over)."""
        decode = carried.payloads.decode
        batch: list[Message] = []
        into: CarriedRank | None = None
        try:
            for tag, payload in zip(up.tags, up.payloads, strict=True):
                try:
                    message = from_payload(tag, decode(payload), TO_COORDINATOR_TAGS)
                except ProtocolError as err:
                    raise AgentRefused(
                        f"node {carried.node_rank}'s agent carried a message that does not "
                        f"decode: {err}"
                    ) from None
                rank = carried.rank(message.rank)  # type: ignore[attr-defined]
                if rank is not into:
                    if into is not None:
                        into.deliver(batch, now)
                    into, batch = rank, []
                batch.append(message)
        finally:
            if into is not None and batch:
                into.deliver(batch, now)


class _Carried:
    """The ranks one agent carries: its downlink and a :class:`CarriedRank` per open rank."""

    def __init__(self, node_rank: int, downlink: Downlink) -> None:
        self.node_rank = node_rank
        self.downlink = downlink
        self.ranks: dict[int, CarriedRank] = {}
        self.payloads = PayloadDecoder()

    def open(self, rank: int) -> CarriedRank:
        if rank in self.ranks:
            raise AgentRefused(f"node {self.node_rank}'s agent opened rank {rank} twice")
        carried = self.ranks[rank] = CarriedRank(rank, self.downlink)
        return carried

    def rank(self, rank: int) -> CarriedRank:
        try:
            return self.ranks[rank]
        except KeyError:
            raise AgentRefused(
                f"node {self.node_rank}'s agent spoke for rank {rank}, which it has not opened"
            ) from None


async def _refuse(channel: Channel, err: AgentRefused) -> None:
    """Tell the agent why it is refused; best effort (the refusal is raised either way)."""
    with contextlib.suppress(*CONNECTION_ERRORS):
        await channel.send(AgentRefusal(str(err)))
