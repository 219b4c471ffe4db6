"""The coordinator's end of a tunnel (:mod:`flodl.coordinator.tunnels`): a rank's byte stream
over its agent's channel, and the downlink that writes to the agent."""

from __future__ import annotations

import socket
from functools import partial

import pytest
import trio
import trio.testing

from flodl.coordinator.tunnels import DOWNLINK_LIMIT, Downlink, DownlinkHub
from flodl.transports.channel import Channel
from flodl.transports.readers import reader_for
from flodl.transports.socket_stream import SocketStream
from flodl.transports.tunnel_reader import TunnelReader
from flodl.transports.tunnel_stream import TunnelStream
from flodl.wire.codec import FrameEncoder
from flodl.wire.fields import MAX_BLOB
from flodl.wire.messages import (
    FROM_AGENT_TAGS,
    TO_AGENT_TAGS,
    TO_COORDINATOR_TAGS,
    Heartbeat,
    Message,
    TunnelDown,
    TunnelEnd,
)

UP, DOWN = b"u" * 32, b"d" * 32


def agent_pair() -> tuple[Channel, Channel]:
    """(the coordinator's end, the agent's end) of an agent's channel, in memory."""
    coordinator_end, agent_end = trio.testing.memory_stream_pair()
    coordinator = Channel(
        coordinator_end, send_key=DOWN, receive_key=UP, receive_tags=FROM_AGENT_TAGS
    )
    agent = Channel(agent_end, send_key=UP, receive_key=DOWN, receive_tags=TO_AGENT_TAGS)
    return coordinator, agent


async def test_a_tunnel_stream_reads_what_was_fed_in_order_then_its_end() -> None:
    coordinator, _agent = agent_pair()
    stream = Downlink(coordinator).stream(3)
    stream.feed(b"hello ")
    stream.feed(b"world")
    assert await stream.receive_some(3) == b"hel"
    assert await stream.receive_some() == b"lo world"
    got: list[bytes] = []
    async with trio.open_nursery() as nursery:

        async def read() -> None:
            got.append(await stream.receive_some())

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # nothing fed: it waits
        stream.feed(b"!")
    assert got == [b"!"]
    stream.feed_eof()
    assert await stream.receive_some() == b""  # the rank's connection ended
    with pytest.raises(trio.BrokenResourceError):
        await stream.send_all(b"late")
    await stream.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive_some()


async def test_what_the_coordinator_writes_goes_down_in_order_and_an_end_after_it() -> None:
    coordinator, agent = agent_pair()
    downlink = Downlink(coordinator)
    streams = [downlink.stream(slot) for slot in (1, 2)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(downlink.run)
        await streams[0].send_all(b"a")
        await streams[1].send_all(b"b")
        await streams[0].send_all(b"c")
        await streams[1].aclose()  # the coordinator ends slot 2: the agent hears it last
        carried = []
        while True:
            message = await agent.receive()
            if isinstance(message, TunnelEnd):
                break
            assert isinstance(message, TunnelDown)
            carried += list(zip(message.slots, message.chunks, strict=True))
        nursery.cancel_scope.cancel()
    assert message == TunnelEnd(2)
    assert carried == [(1, b"a"), (2, b"b"), (1, b"c")]


async def test_a_large_write_is_cut_to_frames_and_an_agent_that_cannot_keep_up_breaks() -> None:
    coordinator, agent = agent_pair()
    downlink = Downlink(coordinator)
    stream = downlink.stream(0)
    big = bytes(range(256)) * (MAX_BLOB // 256 + 10)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(downlink.run)
        await stream.send_all(big)
        received = b""
        while len(received) < len(big):
            message = await agent.receive()
            assert isinstance(message, TunnelDown)
            assert sum(len(c) for c in message.chunks) <= MAX_BLOB
            received += b"".join(message.chunks)
        nursery.cancel_scope.cancel()
    assert received == big
    stalled = Downlink(coordinator)  # nobody writes: it fills up
    with pytest.raises(trio.BrokenResourceError, match="cannot keep up"):
        for _ in range(DOWNLINK_LIMIT // MAX_BLOB + 2):
            stalled.push(0, b"x" * MAX_BLOB)
    with pytest.raises(trio.BrokenResourceError, match="connection failed"):
        await stalled.stream(1).send_all(b"y")


async def test_tunnelled_channels_are_read_by_one_shared_reader() -> None:
    """Ranks through agents cost the coordinator no reader task each: one TunnelReader reads
    every tunnel whose bytes arrived, in one pass."""
    coordinator, _agent = agent_pair()
    downlink = Downlink(coordinator)
    channels = [
        Channel(
            downlink.stream(slot), send_key=DOWN, receive_key=UP, receive_tags=TO_COORDINATOR_TAGS
        )
        for slot in range(3)
    ]
    assert reader_for(channels[0]) is TunnelReader
    reader = TunnelReader()
    seen: list[tuple[int, list[Message]]] = []

    def record(index: int, batch: list[Message], _now: float) -> None:
        seen.append((index, batch))

    def ignore(_error: Exception | None) -> None:
        pass

    for index, channel in enumerate(channels):
        reader.add(channel, partial(record, index), ignore)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader.run)
        await trio.testing.wait_all_tasks_blocked()
        for index in (2, 0):  # one agent frame carrying two ranks' bytes
            stream = channels[index].stream
            assert isinstance(stream, TunnelStream)
            stream.feed(FrameEncoder(UP).encode(Heartbeat(index, 7)))  # each its own session
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert seen == [(2, [Heartbeat(2, 7)]), (0, [Heartbeat(0, 7)])]


def socket_agent_pair() -> tuple[Channel, Channel]:
    """:func:`agent_pair` over a real socket pair: the coordinator's end writes without
    waiting (a NowaitStream), as a connected agent's does."""
    ours, theirs = socket.socketpair()
    for sock in (ours, theirs):
        sock.setblocking(False)
    coordinator = Channel(
        SocketStream(ours), send_key=DOWN, receive_key=UP, receive_tags=FROM_AGENT_TAGS
    )
    agent = Channel(SocketStream(theirs), send_key=UP, receive_key=DOWN, receive_tags=TO_AGENT_TAGS)
    return coordinator, agent


async def test_the_hub_writes_a_step_of_writes_to_an_agent_as_one_frame() -> None:
    coordinator, agent = socket_agent_pair()
    hub = DownlinkHub()
    downlink = Downlink(coordinator, hub)  # its own task never runs: the hub alone writes
    streams = [downlink.stream(slot) for slot in range(3)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        for stream in streams:  # what one broadcast does: a write to each rank, no wait
            assert isinstance(stream, TunnelStream)
            stream.send_nowait(b"beat %d" % stream.slot)
        await streams[1].aclose()
        down = await agent.receive()
        end = await agent.receive()
        nursery.cancel_scope.cancel()
    await coordinator.aclose()
    await agent.aclose()
    assert down == TunnelDown((0, 1, 2), (b"beat 0", b"beat 1", b"beat 2"))
    assert end == TunnelEnd(1)


async def test_what_the_socket_does_not_take_at_once_goes_out_in_order_after_it() -> None:
    coordinator, agent = socket_agent_pair()
    hub = DownlinkHub()
    downlink = Downlink(coordinator, hub)
    stream = downlink.stream(0)
    parts = [bytes([n]) * (MAX_BLOB // 2) for n in range(40)]  # far more than a socket holds
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        nursery.start_soon(downlink.run)
        for part in parts:
            stream.send_nowait(part)
            await trio.lowlevel.checkpoint()  # the hub writes between them
        received = b""
        while len(received) < sum(map(len, parts)):
            message = await agent.receive()
            assert isinstance(message, TunnelDown)
            received += b"".join(message.chunks)
        nursery.cancel_scope.cancel()
    await coordinator.aclose()
    await agent.aclose()
    assert received == b"".join(parts)
    assert downlink.broken is None
