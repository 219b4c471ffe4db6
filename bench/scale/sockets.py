"""The split mode's load generator: simulated ranks on raw non-blocking sockets.

The generator is the load, not the system under test: it must keep its schedule at 1,024
ranks on one core, or the coordinator sees bursts a real cluster would not send. So its ranks
skip the parts of a real worker that the coordinator cannot see: after the handshake each
rank's socket is a plain non-blocking socket; one task waits on an epoll set of all of them,
and a rank's frames are written at once with a plain send. Framing is the library's own
(FrameEncoder, FrameDecoder) and every rank is a RankLoop around a RankMachine, as in the
in-process mode.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Sequence
from typing import Any, Protocol

import trio
import trio.lowlevel

from flodl.transports import connect
from flodl.transports.channel import RECEIVE_CHUNK
from flodl.transports.socket_stream import SocketStream
from flodl.wire.codec import FrameDecoder, FrameEncoder
from flodl.wire.handshake import (
    SERVER_HELLO_SIZE,
    ClientState,
    SessionKeys,
    check_server_hello,
    make_client_hello,
)
from flodl.wire.messages import TO_RANK_TAGS, Message

from .ranks import HEARTBEAT_PERIOD_S, Metronome, RankLoop
from .record import Recorder
from .stamps import stamped_frames

RECEIVE_AT_ONCE = 16
"""Sockets the generator reads before it lets its metronome run (a checkpoint). When a window
ends every rank has messages at once, and each costs its machine tens of microseconds: 16
keep the metronome's wait to about a millisecond, so the ranks' ticks stay on schedule."""


class RankHub(Protocol):
    """Where a :class:`WireRank`'s messages go: the generator's sockets, or its host's agent."""

    recorder: Recorder
    metronome: Metronome

    def carry(self, rank: WireRank, messages: Sequence[Message], at: float) -> None:
        """Send ``messages`` of ``rank``, stamped with send time ``at``."""
        ...

    def hang_up(self, rank: WireRank) -> None: ...


class WireRank:
    """One simulated rank of the generator: its :class:`RankLoop` over a raw socket (or, in
    the agents layout, its host's agent: ``sock`` and ``keys`` None). Frames from the
    coordinator are decoded into messages for the machine; what the machine sends is stamped
    with its send time and framed as it is written (:func:`stamped_frames`)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        hub: RankHub,
        sock: socket.socket | None,
        keys: SessionKeys | None,
        batch_phase: float,
        heartbeat_phase: float,
    ) -> None:
        self.rank = rank
        self.hub = hub
        self.sock = sock
        if keys is not None:
            self.encoder = FrameEncoder(keys.to_coordinator)
            self.decoder = FrameDecoder(keys.to_rank, allowed_tags=TO_RANK_TAGS)
        self.unsent = bytearray()
        """Bytes the socket did not take yet (written when it is writable again)."""
        self.open = True
        self.heartbeat_phase = heartbeat_phase
        self.loop = RankLoop(rank, world_size, batch_phase, hub.recorder, self._schedule)

    def _schedule(self, when: float) -> None:
        self.hub.metronome.at(when, self.tick)

    def start(self) -> None:
        """Announce the job; heartbeats from the rank's phase on."""
        now = trio.current_time()
        self.send(self.loop.start(now))
        self.hub.metronome.at(now + self.heartbeat_phase, self.heartbeat)

    def tick(self, now: float) -> None:
        if self.open:
            self.send(self.loop.tick(now))

    def heartbeat(self, now: float) -> None:
        if not self.open or self.loop.over:
            return
        self.hub.metronome.at(now + HEARTBEAT_PERIOD_S, self.heartbeat)
        self.send(self.loop.heartbeat(now))

    def received(self, data: bytes, now: float) -> None:
        """Act on the bytes that arrived, message by message."""
        self.decoder.feed(data)
        messages: list[Message] = []
        self.decoder.read_into(messages)
        self.handle(messages, now)

    def handle(self, messages: Sequence[Message], now: float) -> None:
        """Act on messages from the coordinator, one by one."""
        recorder, loop = self.hub.recorder, self.loop
        for message in messages:
            if recorder.measuring:
                recorder.delivered[type(message).__name__] += 1
            self.send(loop.receive(message, now))
            if not self.open:
                return

    def send(self, messages: Sequence[Message]) -> None:
        """Write ``messages``, stamped now; after the goodbye, hang up once it is written."""
        if not self.open:
            return
        if messages:
            self.hub.carry(self, messages, time.perf_counter())
            self.hub.recorder.count_sent(messages)
        if self.loop.over:
            self.hub.hang_up(self)


class WireGenerator:
    """The generator's ranks, their sockets (one epoll set) and their metronome."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.metronome = Metronome(recorder, after_slot=self.flush_hosts)
        self._epoll = select.epoll()
        self._by_fd: dict[int, Any] = {}
        """What each socket belongs to: a :class:`WireRank`, or a host of the agents layout
        (:class:`~.hosts.WireHost`: the same ``sock``, ``unsent``, ``open``, ``received``)."""
        self._hanging_up: set[WireRank] = set()
        """Ranks that said goodbye and close once their unsent bytes are written."""
        self._dirty: dict[Any, None] = {}
        """Hosts with something queued to go up (agents layout)."""

    def dirty(self, host: Any) -> None:
        """``host`` queued something: it flushes after this slot or pass (:meth:`flush_hosts`)."""
        self._dirty[host] = None

    def flush_hosts(self) -> None:
        """Let each host that queued something send it, folded (agents layout)."""
        while self._dirty:
            dirty, self._dirty = self._dirty, {}
            for host in dirty:
                host.flush()

    def add(self, rank: Any) -> None:
        self._by_fd[rank.sock.fileno()] = rank
        self._epoll.register(rank.sock.fileno(), select.EPOLLIN)

    def carry(self, rank: WireRank, messages: Sequence[Message], at: float) -> None:
        """Frame ``rank``'s messages, stamped with ``at``, and write them."""
        self.write(rank, stamped_frames(rank.encoder, messages, at))

    def write(self, rank: Any, data: bytes) -> None:
        """Write ``data`` now, or queue it behind bytes the socket has not taken yet."""
        if rank.unsent:
            rank.unsent += data
            return
        try:
            sent = rank.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.close(rank)
            return
        if sent < len(data):
            rank.unsent += data[sent:]
            self._epoll.modify(rank.sock.fileno(), select.EPOLLIN | select.EPOLLOUT)

    def _flush(self, rank: Any) -> None:
        try:
            sent = rank.sock.send(rank.unsent)
        except BlockingIOError:
            return
        except OSError:
            self.close(rank)
            return
        del rank.unsent[:sent]
        if not rank.unsent:
            if rank in self._hanging_up:
                self.close(rank)
            else:
                self._epoll.modify(rank.sock.fileno(), select.EPOLLIN)

    def hang_up(self, rank: WireRank) -> None:
        """Close ``rank``'s socket once everything it sent is written."""
        if not rank.unsent:
            self.close(rank)
        else:
            self._hanging_up.add(rank)

    def close(self, rank: Any) -> None:
        """Close the socket of a rank, or of a host (its ranks are gone with it)."""
        self._hanging_up.discard(rank)
        if rank.open:
            rank.open = False
            del self._by_fd[rank.sock.fileno()]
            self._epoll.unregister(rank.sock.fileno())
            rank.sock.close()
            for carried in getattr(rank, "ranks", {}).values():
                carried.open = False

    def close_all(self) -> None:
        for rank in list(self._by_fd.values()):
            self.close(rank)
        self._epoll.close()

    async def serve(self) -> None:
        """Read every socket that is ready, a few dozen between checkpoints; until cancelled."""
        epoll = self._epoll
        while True:
            await trio.lowlevel.wait_readable(epoll.fileno())
            events = epoll.poll(0)
            for start in range(0, len(events), RECEIVE_AT_ONCE):
                if start:
                    await trio.lowlevel.checkpoint()
                now = trio.current_time()
                for fd, flags in events[start : start + RECEIVE_AT_ONCE]:
                    rank = self._by_fd.get(fd)
                    if rank is not None:
                        self._ready(rank, flags, now)
                self.flush_hosts()

    def _ready(self, rank: Any, flags: int, now: float) -> None:
        if flags & select.EPOLLOUT and rank.unsent:
            self._flush(rank)
        if not flags & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) or not rank.open:
            return
        try:
            data = rank.sock.recv(RECEIVE_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close(rank)
            return
        rank.received(data, now)


async def open_wire_rank(
    url: str, key: bytes, rank: int, world_size: int
) -> tuple[socket.socket, SessionKeys]:
    """Connect and complete the handshake for ``rank``; its socket (non-blocking) and keys."""
    stream, keys = await open_handshaken(url, *make_client_hello(key, rank, world_size))
    return stream.socket, keys


async def open_handshaken(
    url: str, hello: bytes, state: ClientState
) -> tuple[SocketStream, SessionKeys]:
    """Connect, send ``hello`` and check the coordinator's reply: the stream and the session's
    keys (the stream is closed on failure)."""
    stream = await connect(url)
    try:
        await stream.send_all(hello)
        reply = b""
        while len(reply) < SERVER_HELLO_SIZE:
            data = await stream.receive_some(SERVER_HELLO_SIZE - len(reply))
            if not data:
                raise RuntimeError("the coordinator hung up during the handshake")
            reply += data
        keys = check_server_hello(reply, state)
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    assert isinstance(stream, SocketStream)
    return stream, keys
