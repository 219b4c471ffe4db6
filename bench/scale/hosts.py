"""The agents layout of the split mode: simulated ranks reach the coordinator through simulated
node agents, one connection per host.

A :class:`WireHost` speaks for ``per_host`` ranks as a real node agent does (:mod:`flodl.agent`):
its own handshake (the agent flag), ``AgentJoin``, then ``AssignRanks`` tells it its ranks; each
rank's connection is a tunnel whose bytes (the rank's own handshake and authenticated frames)
travel in ``TunnelUp`` and ``TunnelDown`` frames of the host's one socket. What the host's ranks
send within one metronome slot (2 ms) or one pass over the ready sockets goes up as one
``TunnelUp``, as the real agent folds what is queued when its sender wakes. A killed rank is
reported as the agent reports it (``RankExited``, then ``TunnelClosed``); a killed host closes its
socket with no goodbye, as a SIGKILLed agent's kernel does.

The ranks are the split mode's :class:`~.sockets.WireRank`: the same :class:`~.ranks.RankLoop`
around the same RankMachine, stamping what they send; only the path of their bytes differs.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence

import trio

from flodl.wire.codec import FrameDecoder, FrameEncoder
from flodl.wire.handshake import (
    SERVER_HELLO_SIZE,
    ClientState,
    check_server_hello,
    make_client_hello,
)
from flodl.wire.messages import (
    TO_AGENT_TAGS,
    AgentJoin,
    AssignRanks,
    Message,
    RankExited,
    TunnelClosed,
    TunnelDown,
    TunnelEnd,
    TunnelOpen,
    TunnelUp,
)

from .sockets import WireGenerator, WireRank, open_handshaken

KILLED_RETURNCODE = -9
"""What a rank killed by the bench exits with, as the agent reports it (SIGKILL)."""


class _Handshaking:
    """A rank whose hello went up its tunnel and whose reply has not come back yet."""

    def __init__(self, rank: int, state: ClientState, phases: tuple[float, float]) -> None:
        self.rank = rank
        self.state = state
        self.phases = phases
        self.reply = bytearray()


class WireHost:
    """One simulated node agent: its socket to the coordinator and its ranks' tunnels.

    To its ranks it is their hub (:meth:`write`, :meth:`hang_up`, ``recorder``, ``metronome``):
    what they write is queued and goes up folded (:meth:`flush`, which the generator calls after
    each metronome slot and each pass over ready sockets)."""

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
        """The host's ranks by tunnel slot (slot = local rank), once their handshake is done."""
        self._handshaking: dict[int, _Handshaking] = {}
        self._queued: list[Message] = []
        self._slots: list[int] = []
        self._chunks: list[bytes] = []

    # --- what the host's ranks see as their hub -----------------------------------------------

    def write(self, rank: WireRank, data: bytes) -> None:
        """Queue ``data`` of ``rank`` to go up in the host's next TunnelUp."""
        if self.open:
            self._slots.append(rank.rank - self.first_rank)
            self._chunks.append(data)
            self.hub.dirty(self)

    def hang_up(self, rank: WireRank) -> None:
        """``rank`` said goodbye: its connection to the agent closes."""
        self.close_rank(rank.rank - self.first_rank)

    def close(self, rank: WireRank) -> None:
        self.close_rank(rank.rank - self.first_rank)

    # --- the host -----------------------------------------------------------------------------

    def open_tunnels(self, phases: Sequence[tuple[float, float]], key: bytes) -> None:
        """Connect every rank of the host to the agent: each hello goes up its tunnel."""
        for slot, rank_phases in enumerate(phases):
            rank = self.first_rank + slot
            hello, state = make_client_hello(key, rank, self.world_size)
            self._handshaking[slot] = _Handshaking(rank, state, rank_phases)
            self.send_up(TunnelOpen(slot))
            self._slots.append(slot)
            self._chunks.append(hello)
        self.hub.dirty(self)

    def send_up(self, message: Message) -> None:
        """Queue an agent message (after the tunnel bytes queued before it)."""
        self._fold()
        self._queued.append(message)
        self.hub.dirty(self)

    def kill_rank(self, rank: int) -> None:
        """The rank's process dies: the agent reports the exit, then its connection ends."""
        slot = rank - self.first_rank
        if slot in self.ranks:
            exit = RankExited(rank, os.getpid(), KILLED_RETURNCODE, time.time(), False, "")
            self.send_up(exit)
            self.close_rank(slot)

    def close_rank(self, slot: int) -> None:
        wire = self.ranks.pop(slot, None)
        if wire is not None:
            wire.open = False
            self.send_up(TunnelClosed(slot))

    def flush(self) -> None:
        """Send what is queued: the tunnel bytes as one TunnelUp, in order with the rest."""
        self._fold()
        if self._queued and self.open:
            queued, self._queued = self._queued, []
            self.hub.write(self, b"".join(self.encoder.encode(m) for m in queued))

    def _fold(self) -> None:
        if self._chunks:
            self._queued.append(TunnelUp(tuple(self._slots), tuple(self._chunks)))
            self._slots, self._chunks = [], []

    def received(self, data: bytes, now: float) -> None:
        """Act on what the coordinator sent the agent: its ranks' bytes, tunnel ends."""
        self.decoder.feed(data)
        messages: list[Message] = []
        self.decoder.read_into(messages)
        for message in messages:
            if isinstance(message, TunnelDown):
                for slot, chunk in zip(message.slots, message.chunks, strict=True):
                    self._down(slot, chunk, now)
            elif isinstance(message, TunnelEnd):
                wire = self.ranks.pop(message.slot, None)
                if wire is not None:
                    wire.open = False
            if not self.open:
                return

    def _down(self, slot: int, chunk: bytes, now: float) -> None:
        wire = self.ranks.get(slot)
        if wire is not None:
            wire.received(chunk, now)
            return
        joining = self._handshaking.get(slot)
        if joining is None:
            return  # a rank already gone
        joining.reply += chunk
        if len(joining.reply) < SERVER_HELLO_SIZE:
            return
        del self._handshaking[slot]
        keys = check_server_hello(bytes(joining.reply[:SERVER_HELLO_SIZE]), joining.state)
        wire = WireRank(joining.rank, self.world_size, self, None, keys, *joining.phases)
        self.ranks[slot] = wire
        wire.start()
        rest = bytes(joining.reply[SERVER_HELLO_SIZE:])
        if rest:
            wire.received(rest, now)


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
