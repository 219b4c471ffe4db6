"""Channel: ends of stream (clean, cut, broken), sender exclusion, and the handshake drivers."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest
import trio
import trio.testing

from flodl.errors import (
    AuthenticationError,
    BrokenChannel,
    ChannelClosed,
    FrameTooLarge,
    TruncatedFrame,
)
from flodl.transports import connect, open_listener
from flodl.transports.channel import Channel
from flodl.transports.greeting import accept_rank, connect_rank
from flodl.transports.socket_stream import SocketStream
from flodl.wire.codec import FrameEncoder
from flodl.wire.messages import (
    TO_COORDINATOR_TAGS,
    TO_RANK_TAGS,
    Heartbeat,
    Note,
    StartEpoch,
    SyncNow,
)

UP = b"channel-test-key-to-coordinator!"
DOWN = b"channel-test-key-to-the-rank-000"
SESSION_KEY = b"channel-test-session-key-0123456"


def rank_channel(stream: trio.abc.Stream, max_payload: int = 1 << 20) -> Channel:
    return Channel(
        stream, send_key=UP, receive_key=DOWN, receive_tags=TO_RANK_TAGS, max_payload=max_payload
    )


def coordinator_channel(stream: trio.abc.Stream) -> Channel:
    return Channel(stream, send_key=DOWN, receive_key=UP, receive_tags=TO_COORDINATOR_TAGS)


def memory_pair() -> tuple[Channel, Channel]:
    rank_end, coord_end = trio.testing.memory_stream_pair()
    return rank_channel(rank_end), coordinator_channel(coord_end)


async def test_clean_close_ends_iteration_and_keeps_saying_closed() -> None:
    rank, coord = memory_pair()
    sent = [Heartbeat(rank=1, step_count=i) for i in range(5)]
    for message in sent:
        await rank.send(message)
    await rank.aclose()
    assert [m async for m in coord] == sent
    for _ in range(2):
        with pytest.raises(ChannelClosed):
            await coord.receive()


async def test_end_of_stream_mid_frame_is_truncated_then_broken() -> None:
    rank_end, coord_end = trio.testing.memory_stream_pair()
    coord = coordinator_channel(coord_end)
    frame = FrameEncoder(UP).encode(Heartbeat(rank=1, step_count=1))
    await rank_end.send_all(frame[: len(frame) // 2])
    await rank_end.aclose()
    with pytest.raises(TruncatedFrame):
        await coord.receive()
    with pytest.raises(BrokenChannel):
        await coord.receive()


async def test_reset_connection_is_a_broken_channel() -> None:
    async with await open_listener("tcp://127.0.0.1:0") as listener:
        client = await connect(listener.url)
        server = await listener.accept()
        assert isinstance(client, SocketStream)
        # Abortive close: the kernel sends RST instead of FIN.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await client.aclose()
        coord = coordinator_channel(server)
        with pytest.raises(BrokenChannel) as info:
            await coord.receive()
        assert isinstance(info.value.__cause__, trio.BrokenResourceError)
        with pytest.raises(BrokenChannel):
            await coord.send(SyncNow(round=1, generation=0))
        await coord.aclose()


async def test_use_after_local_close_is_a_broken_channel() -> None:
    rank, coord = memory_pair()
    await coord.aclose()
    with pytest.raises(BrokenChannel):
        await coord.receive()
    with pytest.raises(BrokenChannel):
        await coord.send(SyncNow(round=1, generation=0))
    await rank.aclose()


async def test_wire_error_surfaces_once_then_the_channel_is_broken() -> None:
    rank_end, coord_end = trio.testing.memory_stream_pair()
    coord = coordinator_channel(coord_end)
    frame = bytearray(FrameEncoder(UP).encode(Heartbeat(rank=1, step_count=1)))
    frame[-1] ^= 0x80
    await rank_end.send_all(frame)
    with pytest.raises(AuthenticationError):
        await coord.receive()
    with pytest.raises(BrokenChannel):
        await coord.receive()


async def test_concurrent_senders_never_interleave_frames() -> None:
    # Lockstep streams hand over bytes in pieces and checkpoint inside send_all: two
    # unguarded send_all calls would collide (BusyResourceError) or mix their bytes.
    rank_end, coord_end = trio.testing.lockstep_stream_pair()
    rank, coord = rank_channel(rank_end), coordinator_channel(coord_end)
    senders, per_sender = 8, 25
    received: list[Heartbeat] = []

    async def send_all_of(sender: int) -> None:
        for i in range(per_sender):
            await rank.send(Heartbeat(rank=sender, step_count=i))

    async def receive_everything() -> None:
        for _ in range(senders * per_sender):
            message = await coord.receive()
            assert isinstance(message, Heartbeat)
            received.append(message)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive_everything)
        for sender in range(senders):
            nursery.start_soon(send_all_of, sender)
    for sender in range(senders):
        steps = [m.step_count for m in received if m.rank == sender]
        assert steps == list(range(per_sender))


async def test_two_receivers_at_once_are_refused() -> None:
    _, coord = memory_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(coord.receive)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await coord.receive()
        nursery.cancel_scope.cancel()


async def test_cancelled_receive_loses_no_bytes() -> None:
    rank_end, coord_end = trio.testing.memory_stream_pair()
    coord = coordinator_channel(coord_end)
    frame = FrameEncoder(UP).encode(Heartbeat(rank=2, step_count=9))
    await rank_end.send_all(frame[:30])
    with trio.move_on_after(0.01):
        await coord.receive()
    await rank_end.send_all(frame[30:])
    assert await coord.receive() == Heartbeat(rank=2, step_count=9)


async def test_oversized_send_is_refused_and_the_channel_stays_usable() -> None:
    rank_end, coord_end = trio.testing.memory_stream_pair()
    rank, coord = rank_channel(rank_end, max_payload=200), coordinator_channel(coord_end)
    with pytest.raises(FrameTooLarge):
        await rank.send(Note(rank=1, detail="x" * 500))
    await rank.send(Heartbeat(rank=1, step_count=3))  # sequence number 0 was not consumed
    assert await coord.receive() == Heartbeat(rank=1, step_count=3)


async def test_send_eof_half_closes() -> None:
    rank_end, coord_end = trio.testing.memory_stream_pair()
    rank, coord = rank_channel(rank_end), coordinator_channel(coord_end)
    await rank.send(Heartbeat(rank=1, step_count=1))
    await rank.send_eof()
    assert [m async for m in coord] == [Heartbeat(rank=1, step_count=1)]
    await coord.send(SyncNow(round=4, generation=0))  # the other direction still flows
    assert await rank.receive() == SyncNow(round=4, generation=0)
    with pytest.raises(BrokenChannel):
        await rank.send(Heartbeat(rank=1, step_count=2))


@pytest.mark.parametrize("scheme", ["tcp", "unix", "memory"])
async def test_handshake_drivers_work_over_every_transport(scheme: str, tmp_path: Path) -> None:
    url = {
        "tcp": "tcp://127.0.0.1:0",
        "unix": f"unix://{tmp_path / 'c.sock'}",
        "memory": f"memory://channel-{tmp_path.name}",
    }[scheme]
    async with await open_listener(url) as listener:
        accepted: list[tuple[int, Channel]] = []

        async def coordinator() -> None:
            stream = await listener.accept()
            accepted.append(await accept_rank(stream, SESSION_KEY, 4, taken=lambda rank: rank == 0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(coordinator)
            rank = await connect_rank(await connect(listener.url), SESSION_KEY, 3, 4)
        ((rank_id, coord),) = accepted
        assert rank_id == 3
        async with rank, coord:
            await coord.send(StartEpoch(epoch=1, partition_offset=0, partition_size=10))
            await rank.send(Heartbeat(rank=3, step_count=0))
            assert await rank.receive() == StartEpoch(1, 0, 10)
            assert await coord.receive() == Heartbeat(rank=3, step_count=0)
