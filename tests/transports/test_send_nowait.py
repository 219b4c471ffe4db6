"""Channel.send_nowait: frames written without waiting over a real unix socket; what the
socket cannot take goes out first with the next flush, so the peer sees every frame in order
(its decoder checks the sequence numbers); streams without the capability refuse up front.
The reading side: receive_nowait / receive_batch_nowait take what has arrived, never wait."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from flodl.errors import ChannelClosed
from flodl.transports import connect, open_listener
from flodl.transports.channel import Channel
from flodl.transports.socket_stream import SocketStream
from flodl.wire.codec import encode_message
from flodl.wire.messages import TO_RANK_TAGS, ExtendPartition, Message, SyncNow

KEY_A = b"send-nowait-test-key-coordinator"
KEY_B = b"send-nowait-test-key-rank-000000"


async def unix_pair(folder: Path) -> tuple[Channel, Channel]:
    """(coordinator side, rank side) of one unix connection."""
    async with await open_listener(f"unix://{folder}/s.sock") as listener:
        client = await connect(listener.url)
        server = await listener.accept()
    sender = Channel(server, send_key=KEY_A, receive_key=KEY_B, receive_tags=frozenset())
    receiver = Channel(client, send_key=KEY_B, receive_key=KEY_A, receive_tags=TO_RANK_TAGS)
    return sender, receiver


async def receive(channel: Channel, count: int) -> list[Message]:
    got: list[Message] = []
    while len(got) < count:
        got += await channel.receive_batch()
    return got


async def test_frames_written_at_once_arrive_in_order(tmp_path: Path) -> None:
    sender, receiver = await unix_pair(tmp_path)
    beat = encode_message(SyncNow(round=1, generation=0))
    assert sender.send_nowait([beat, ExtendPartition(epoch=0, offset=5, size=3)]) is True
    await sender.send(SyncNow(round=2, generation=0))  # numbered after the direct ones
    assert await receive(receiver, 3) == [
        SyncNow(round=1, generation=0),
        ExtendPartition(epoch=0, offset=5, size=3),
        SyncNow(round=2, generation=0),
    ]
    await sender.aclose()
    await receiver.aclose()


async def test_a_full_socket_keeps_the_rest_for_flush_before_anything_later(
    tmp_path: Path,
) -> None:
    sender, receiver = await unix_pair(tmp_path)
    sent: list[Message] = []
    # Nobody reads yet: write until the socket takes a write only in part.
    while True:
        message = ExtendPartition(epoch=0, offset=len(sent), size=1)
        sent.append(message)
        if not sender.send_nowait([message]):
            break
        assert len(sent) < 1_000_000
    with pytest.raises(trio.WouldBlock):  # the unsent tail must go first
        sender.send_nowait([SyncNow(round=9, generation=0)])
    last = SyncNow(round=10, generation=0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.send, last)  # waits until the reader makes room
        got = await receive(receiver, len(sent) + 1)
    assert got == [*sent, last]
    await sender.aclose()
    await receiver.aclose()


async def test_streams_without_direct_writes_refuse_and_consume_nothing() -> None:
    left, right = trio.testing.memory_stream_pair()  # no send_nowait (flodl's memory has one)
    sender = Channel(left, send_key=KEY_A, receive_key=KEY_B, receive_tags=frozenset())
    receiver = Channel(right, send_key=KEY_B, receive_key=KEY_A, receive_tags=TO_RANK_TAGS)
    with pytest.raises(trio.WouldBlock):
        sender.send_nowait([SyncNow(round=1, generation=0)])
    await sender.send(SyncNow(round=2, generation=0))  # sequence 0: nothing was numbered
    assert await receiver.receive() == SyncNow(round=2, generation=0)


async def test_socket_stream_send_nowait_reports_bytes_and_closed(tmp_path: Path) -> None:
    async with await open_listener(f"unix://{tmp_path}/s.sock") as listener:
        client = await connect(listener.url)
        server = await listener.accept()
    assert isinstance(server, SocketStream)
    assert server.send_nowait(b"hello") == 5
    assert await client.receive_some(5) == b"hello"
    await server.aclose()
    with pytest.raises(trio.ClosedResourceError):
        server.send_nowait(b"x")
    await client.aclose()


async def test_receive_nowait_reads_what_arrived_without_waiting(tmp_path: Path) -> None:
    sender, receiver = await unix_pair(tmp_path)
    stream = receiver.stream
    assert isinstance(stream, SocketStream)
    with pytest.raises(trio.WouldBlock):
        stream.receive_nowait()
    assert receiver.receive_batch_nowait() == []  # nothing yet: no wait, no error
    first, second = SyncNow(round=1, generation=0), SyncNow(round=2, generation=0)
    frames = encode_frames(sender, [first, second])
    await sender.stream.send_all(frames[:-4])
    assert receiver.receive_batch_nowait() == [first]  # the second is not complete yet
    await sender.stream.send_all(frames[-4:])
    assert receiver.receive_batch_nowait() == [second]
    await sender.aclose()
    with pytest.raises(ChannelClosed):
        receiver.receive_batch_nowait()
    await receiver.aclose()
    with pytest.raises(trio.ClosedResourceError):
        stream.receive_nowait()


async def test_receive_batch_nowait_needs_a_stream_that_can() -> None:
    _, right = trio.testing.memory_stream_pair()  # no receive_nowait (flodl's memory has one)
    receiver = Channel(right, send_key=KEY_B, receive_key=KEY_A, receive_tags=TO_RANK_TAGS)
    with pytest.raises(trio.WouldBlock):
        receiver.receive_batch_nowait()


def encode_frames(channel: Channel, messages: list[Message]) -> bytes:
    """The frames ``channel`` would send for ``messages`` (numbered as its next ones)."""
    data, too_large = channel._encode(messages)
    assert too_large is None
    return data
