"""SocketReader: one task reads many socket channels, in order per channel, ending each bad one
with its own error while the others are served; passes are capped; closing leaks no fd.

Every channel is a real socket (socketpair, or TCP on 127.0.0.1 for a reset); the peer writes
raw frames built by the real encoder.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import attrs
import pytest
import trio

from flodl.errors import (
    AuthenticationError,
    BrokenChannel,
    FrameTooLarge,
    ProtocolError,
    SequenceError,
    TruncatedFrame,
    UnknownMessage,
    WireError,
)
from flodl.transports.channel import Channel
from flodl.transports.memory_stream import memory_stream_pair
from flodl.transports.socket_reader import PASS_MESSAGES, READ_BYTES, SocketReader
from flodl.transports.socket_stream import SocketStream
from flodl.wire.codec import FrameEncoder
from flodl.wire.messages import TO_COORDINATOR_TAGS, Heartbeat, Message, SyncNow

from .reader_log import WAIT, ReaderLog

UP = b"socket-reader-test-key-upward-00"


def beat(rank: int, step: int) -> Heartbeat:
    return Heartbeat(rank=rank, step_count=step)


@attrs.define(eq=False)
class Peer:
    """The far end of one watched channel: a raw socket and the encoder of its frames."""

    sock: socket.socket
    channel: Channel
    encoder: FrameEncoder = attrs.field(factory=lambda: FrameEncoder(UP))

    def frames(self, messages: Sequence[Message]) -> bytes:
        return b"".join(self.encoder.encode(m) for m in messages)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)


def coordinator_channel(sock: socket.socket) -> Channel:
    return Channel(
        SocketStream(sock), send_key=b"x" * 32, receive_key=UP, receive_tags=TO_COORDINATOR_TAGS
    )


def socket_peer() -> Peer:
    near, far = socket.socketpair()
    return Peer(far, coordinator_channel(near))


@asynccontextmanager
async def reading(peers: list[Peer]) -> AsyncIterator[tuple[SocketReader, ReaderLog]]:
    """A running reader watching ``peers``; cancelled, and every socket closed, on exit."""
    reader = SocketReader()
    log = ReaderLog()
    for index, peer in enumerate(peers):
        reader.add(peer.channel, *log.handlers(index))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run, log.after_pass)
            yield reader, log
            nursery.cancel_scope.cancel()
    finally:
        for peer in peers:
            peer.sock.close()
            await peer.channel.aclose()


async def test_each_channel_is_handed_its_messages_in_order() -> None:
    peers = [socket_peer() for _ in range(3)]
    sent = {i: [beat(i, step) for step in range(60)] for i in range(3)}
    async with reading(peers) as (_, log):
        # Interleaved writes of uneven sizes, some frames split across writes.
        for chunk in range(0, 60, 7):
            for i, peer in enumerate(peers):
                data = peer.frames(sent[i][chunk : chunk + 7])
                peer.send(data[:5])
                await trio.sleep(0)
                peer.send(data[5:])
        await log.wait_for(lambda: all(len(log.messages.get(i, [])) == 60 for i in range(3)))
    assert log.messages == sent
    assert log.ends == {}
    assert log.times == sorted(log.times)
    assert log.passes >= 1


def _garbage(peer: Peer) -> bytes:
    return b"\x00" * 64


def _forged(peer: Peer) -> bytes:
    frame = bytearray(peer.frames([beat(0, 99)]))  # the right sequence number, one bit changed
    frame[-1] ^= 1
    return bytes(frame)


def _wrong_direction(peer: Peer) -> bytes:
    return peer.frames([SyncNow(round=1, generation=0)])  # a coordinator-to-rank message


def _replayed(peer: Peer) -> bytes:
    return FrameEncoder(UP).encode(beat(0, 0))  # sequence 0 again


def _too_large(peer: Peer) -> bytes:
    frame = peer.frames([beat(0, 99)])
    magic, version, tag, _, seq = struct.unpack_from("<IHHIQ", frame)
    return struct.pack("<IHHIQ", magic, version, tag, 1 << 30, seq)


BAD_INPUT: dict[str, tuple[Callable[[Peer], bytes], type[WireError]]] = {
    "garbage": (_garbage, ProtocolError),
    "forged": (_forged, AuthenticationError),
    "wrong-direction": (_wrong_direction, UnknownMessage),
    "replayed": (_replayed, SequenceError),
    "too-large": (_too_large, FrameTooLarge),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
async def test_bad_input_ends_that_channel_after_its_good_frames(case: str) -> None:
    make_bad, expected = BAD_INPUT[case]
    honest, bad = socket_peer(), socket_peer()
    good = [beat(1, step) for step in range(3)]
    async with reading([honest, bad]) as (reader, log):
        # Good frames and the bad bytes in one write: nothing more arrives on that socket, so
        # the error found behind the good frames must surface without another readiness.
        bad.send(bad.frames(good) + make_bad(bad))
        await log.wait_for(lambda: 1 in log.ends)
        assert log.messages[1] == good
        ((error,),) = log.ends.values()
        assert type(error) is expected
        assert reader.channels == 1
        # Nothing more from the bad channel is handed over; the honest one is still served.
        bad.send(bad.frames([beat(1, 7)]))
        honest.send(honest.frames([beat(0, 0), beat(0, 1)]))
        await log.wait_for(lambda: len(log.messages.get(0, [])) == 2)
    assert log.messages[1] == good
    assert list(log.ends) == [1]


async def test_end_of_stream_at_a_boundary_mid_frame_and_a_reset() -> None:
    clean, cut = socket_peer(), socket_peer()
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    reset = Peer(client, coordinator_channel(accepted))
    async with reading([clean, cut, reset]) as (reader, log):
        clean.send(clean.frames([beat(0, 0)]))
        clean.sock.shutdown(socket.SHUT_WR)
        frame = cut.frames([beat(1, 0)])
        cut.send(frame[:-3])
        cut.sock.shutdown(socket.SHUT_WR)
        reset.send(reset.frames([beat(2, 0)]))
        reset.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.sock.close()  # an RST: the connection is reset, not closed
        await log.wait_for(lambda: len(log.ends) == 3)
        assert reader.channels == 0
    assert log.messages == {0: [beat(0, 0)], 2: [beat(2, 0)]}
    assert log.ends[0] == [None]
    assert [type(e) for e in log.ends[1]] == [TruncatedFrame]
    assert [type(e) for e in log.ends[2]] == [BrokenChannel]


async def test_flooding_channels_cannot_starve_a_quiet_one_and_passes_are_capped() -> None:
    floods = [socket_peer() for _ in range(4)]
    quiet = socket_peer()
    frame_size = len(FrameEncoder(UP).encode(beat(0, 0)))
    per_read = -(-READ_BYTES // frame_size)  # at most this many frames from one read
    flooded = {i: [beat(i, step) for step in range(2000)] for i in range(4)}
    unsent: dict[int, memoryview] = {}
    for i, peer in enumerate(floods):
        peer.sock.setblocking(False)
        data = memoryview(peer.frames(flooded[i]))
        while data:  # fill the socket's buffers before the reader starts
            try:
                data = data[peer.sock.send(data) :]
            except BlockingIOError:
                break
        assert len(data) < len(flooded[i]) * frame_size - 2 * per_read * frame_size
        unsent[i] = data
    quiet.send(quiet.frames([beat(9, 0)]))

    async def send_rest(peer: Peer, data: memoryview) -> None:
        while data:
            await trio.lowlevel.wait_writable(peer.sock)
            data = data[peer.sock.send(data) :]

    async with reading([*floods, quiet]) as (_, log):
        async with trio.open_nursery() as nursery:
            for i, peer in enumerate(floods):
                nursery.start_soon(send_rest, peer, unsent[i])
        await log.wait_for(
            lambda: (
                all(len(log.messages.get(i, [])) == 2000 for i in range(4)) and 4 in log.messages
            )
        )
    assert {i: log.messages[i] for i in range(4)} == flooded
    # Every ready socket is read once before any is read twice: the quiet rank's message comes
    # before any flooding socket's second batch.
    order = [index for index, *_ in log.batches]
    first_repeat = next(n for n, index in enumerate(order) if index in order[:n])
    assert order.index(4) < first_repeat
    handed_per_pass: dict[int, int] = {}
    for _, size, done, _ in log.batches:
        assert size <= per_read
        handed_per_pass[done] = handed_per_pass.get(done, 0) + size
    assert max(handed_per_pass.values()) <= PASS_MESSAGES + per_read
    assert len(handed_per_pass) >= 4 * 2000 // (PASS_MESSAGES + per_read)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_cancel_and_close_release_every_fd() -> None:
    before = open_fds()
    peers = [socket_peer() for _ in range(5)]
    reader = SocketReader()
    log = ReaderLog()
    for index, peer in enumerate(peers):
        reader.add(peer.channel, *log.handlers(index))
    with trio.move_on_after(WAIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run, log.after_pass)
            peers[0].send(peers[0].frames([beat(0, 0)]))
            await log.wait_for(lambda: 0 in log.messages)
            reader.discard(peers[1].channel)
            reader.discard(peers[1].channel)  # idempotent
            peers[1].send(peers[1].frames([beat(1, 0)]))
            peers[2].send(peers[2].frames([beat(2, 0)]))
            await log.wait_for(lambda: 2 in log.messages)
            nursery.cancel_scope.cancel()
    assert 1 not in log.messages  # discarded before it spoke
    assert reader.closed and reader.channels == 0
    # The channels are their owners' to close, and still work.
    peers[3].send(peers[3].frames([beat(3, 0)]))
    assert await peers[3].channel.receive() == beat(3, 0)
    for peer in peers:
        peer.sock.close()
        await peer.channel.aclose()
    reader.close()  # idempotent
    assert open_fds() == before


async def test_a_reader_closed_while_running_stops_and_releases_its_fd() -> None:
    before = open_fds()
    reader = SocketReader()

    async def run() -> None:
        with pytest.raises(trio.ClosedResourceError):
            await reader.run()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await trio.sleep(0.01)
        reader.close()
    assert open_fds() == before


async def test_it_refuses_channels_it_cannot_watch() -> None:
    reader = SocketReader()
    left, _ = memory_stream_pair()
    memory = coordinator_channel_over(left)
    assert not SocketReader.serves(memory)
    with pytest.raises(ValueError, match="no socket"):
        reader.add(memory, *ReaderLog().handlers(0))
    peer = socket_peer()
    assert SocketReader.serves(peer.channel)
    reader.add(peer.channel, *ReaderLog().handlers(0))
    with pytest.raises(ValueError, match="already watched"):
        reader.add(peer.channel, *ReaderLog().handlers(1))
    reader.close()
    other = socket_peer()
    with pytest.raises(trio.ClosedResourceError):
        reader.add(other.channel, *ReaderLog().handlers(2))
    for p in (peer, other):
        p.sock.close()
        await p.channel.aclose()


def coordinator_channel_over(stream: trio.abc.Stream) -> Channel:
    return Channel(stream, send_key=b"x" * 32, receive_key=UP, receive_tags=TO_COORDINATOR_TAGS)
