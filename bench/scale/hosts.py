"""The agents layout of the split mode: simulated ranks reach the coordinator through simulated
node agents, one connection per host.

A :class:`WireHost` speaks for ``per_host`` ranks as a real node agent does (:mod:`flodl.agent`):
its own handshake (the agent flag), ``AgentJoin``, then ``AssignRanks`` tells it its ranks; it
opens each (``RankOpen``, the rank's handshake having ended at the agent) and carries their
messages: what the host's ranks send within one metronome slot (2 ms) or one pass over the
ready sockets goes up as one ``RanksUp`` (tags and stamped payloads, one MAC), as the real agent
folds what is queued when its sender wakes; each ``RanksDown`` payload is decoded once for all
the ranks it goes to. A killed rank is reported as the agent reports it (``RankExited``, then
``RankClosed``); a killed host closes its socket with no goodbye, as a SIGKILLed agent's kernel
does.

The ranks are the split mode's :class:`~.sockets.WireRank`: the same :class:`~.ranks.RankLoop`
around the same RankMachine, stamping what they send; only the path of their messages differs.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence

import cbor2
import trio

from flodl.wire.codec import FrameDecoder, FrameEncoder, PayloadDecoder
from flodl.wire.handshake import make_client_hello
from flodl.wire.messages import (
    TO_AGENT_TAGS,
    TO_RANK_TAGS,
    AgentJoin,
    AssignRanks,
    Message,
    RankClosed,
    RankEnd,
    RankExited,
    RankOpen,
    RanksDown,
    RanksUp,
    from_payload,
)

from .sockets import WireGenerator, WireRank, open_handshaken
from .stamps import stamped_payload

KILLED_RETURNCODE = -9
"""What a rank killed by the bench exits with, as the agent reports it (SIGKILL)."""


class WireHost:
    """One simulated node agent: its socket to the coordinator and the ranks it speaks for.

    To its ranks it is their hub (:meth:`carry`, :meth:`hang_up`, ``recorder``,
    ``metronome``): what they send is queued and goes up folded (:meth:`flush`, which the
    generator calls after each metronome slot and each pass over ready sockets)."""

    def __init__(
        self,
        node_rank: int,
        world_size: int,
        hub: WireGenerator,
        sock: socket.socket,
        codec: tuple[FrameEncoder, FrameDecoder],
        first_rank: int,
    ) -> None:
        self.node_rank = node_rank
        self.world_size = world_size
        self.hub = hub
        self.sock = sock
        self.first_rank = first_rank
        self.recorder = hub.recorder
        self.metronome = hub.metronome
        self.encoder, self.decoder = codec
        self.unsent = bytearray()
        self.open = True
        self.ranks: dict[int, WireRank] = {}
        """The host's open ranks, by rank."""
        self._queued: list[Message] = []
        self._tags: list[int] = []
        self._payloads: list[bytes] = []
        self._decoder = PayloadDecoder()

    # --- what the host's ranks see as their hub -----------------------------------------------

    def carry(self, rank: WireRank, messages: Sequence[Message], at: float) -> None:
        """Queue ``rank``'s messages, stamped with ``at``, to go up in the next RanksUp."""
        if self.open:
            dumps = cbor2.dumps
            for message in messages:
                self._tags.append(message.TAG)
                self._payloads.append(dumps(stamped_payload(message, at)))
            self.hub.dirty(self)

    def hang_up(self, rank: WireRank) -> None:
        """``rank`` said goodbye: its connection to the agent closes."""
        self.close_rank(rank.rank)

    def close(self, rank: WireRank) -> None:
        self.close_rank(rank.rank)

    # --- the host -----------------------------------------------------------------------------

    def open_ranks(self, phases: Sequence[tuple[float, float]]) -> None:
        """Every rank of the host connects to the agent (its handshake ends there) and starts."""
        for slot, rank_phases in enumerate(phases):
            rank = self.first_rank + slot
            self.send_up(RankOpen(rank))
            wire = WireRank(rank, self.world_size, self, None, None, *rank_phases)
            self.ranks[rank] = wire
            wire.start()

    def send_up(self, message: Message) -> None:
        """Queue an agent message (after the ranks' messages queued before it)."""
        self._fold()
        self._queued.append(message)
        self.hub.dirty(self)

    def kill_rank(self, rank: int) -> None:
        """The rank's process dies: the agent reports the exit, then its connection ends."""
        if rank in self.ranks:
            exit = RankExited(rank, os.getpid(), KILLED_RETURNCODE, time.time(), False, "")
            self.send_up(exit)
            self.close_rank(rank)

    def close_rank(self, rank: int) -> None:
        wire = self.ranks.pop(rank, None)
        if wire is not None:
            wire.open = False
            self.send_up(RankClosed(rank))

    def flush(self) -> None:
        """Send what is queued: the ranks' messages as one RanksUp, in order with the rest."""
        self._fold()
        if self._queued and self.open:
            queued, self._queued = self._queued, []
            self.hub.write(self, b"".join(self.encoder.encode(m) for m in queued))

    def _fold(self) -> None:
        if self._tags:
            self._queued.append(RanksUp(tuple(self._tags), tuple(self._payloads)))
            self._tags, self._payloads = [], []

    def received(self, data: bytes, now: float) -> None:
        """Act on what the coordinator sent the agent: its ranks' messages, their ends."""
        self.decoder.feed(data)
        messages: list[Message] = []
        self.decoder.read_into(messages)
        for message in messages:
            if isinstance(message, RanksDown):
                for tag, payload, ranks in message.deliveries():
                    decoded = from_payload(tag, self._decoder.decode(payload), TO_RANK_TAGS)
                    for rank in ranks:
                        wire = self.ranks.get(rank)
                        if wire is not None:
                            wire.handle((decoded,), now)
            elif isinstance(message, RankEnd):
                wire = self.ranks.pop(message.rank, None)
                if wire is not None:
                    wire.open = False
            if not self.open:
                return


async def open_wire_host(
    url: str, key: bytes, node_rank: int, per_host: int
) -> tuple[socket.socket, FrameEncoder, FrameDecoder]:
    """Connect node ``node_rank``'s agent, complete its handshake and say AgentJoin; its socket
    (non-blocking, AssignRanks still to come) and its channel's framing both ways."""
    hello = make_client_hello(key, node_rank, 0, agent=True)
    stream, keys = await open_handshaken(url, *hello)
    encoder = FrameEncoder(keys.to_coordinator)
    try:
        await stream.send_all(encoder.encode(AgentJoin(node_rank, per_host, "bench")))
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    decoder = FrameDecoder(keys.to_rank, allowed_tags=TO_AGENT_TAGS)
    return stream.socket, encoder, decoder


async def assigned_ranks(sock: socket.socket, decoder: FrameDecoder) -> AssignRanks:
    """Wait for the coordinator's AssignRanks on ``sock`` (it comes once the nodes before
    this one joined)."""
    while True:
        message = decoder.next_message()
        if message is not None:
            if not isinstance(message, AssignRanks):
                raise RuntimeError(f"the coordinator sent {type(message).__name__} first")
            return message
        await trio.lowlevel.wait_readable(sock)
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            continue
        if not data:
            raise RuntimeError("the coordinator hung up before assigning ranks")
        decoder.feed(data)
