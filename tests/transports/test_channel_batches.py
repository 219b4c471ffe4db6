"""Channel batches: several frames per write (send_many), every buffered frame per read
(receive_batch), pre-encoded broadcasts, and errors that trail good frames."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from flodl.errors import (
    AuthenticationError,
    BrokenChannel,
    ChannelClosed,
    FrameTooLarge,
    SequenceError,
)
from flodl.transports.channel import Channel
from flodl.transports.memory_stream import memory_stream_pair
from flodl.wire.codec import FrameDecoder, FrameEncoder, encode_message
from flodl.wire.messages import (
    TO_COORDINATOR_TAGS,
    TO_RANK_TAGS,
    CoordHeartbeat,
    ExtendPartition,
    Heartbeat,
    Message,
    Note,
    SetGlobalStep,
    SyncNow,
)

UP = b"channel-test-key-to-coordinator!"
DOWN = b"channel-test-key-to-the-rank-000"


def pair(max_payload: int = 1 << 20) -> tuple[Channel, Channel, trio.abc.Stream]:
    """(rank channel, coordinator channel, the rank's raw stream) over the memory transport."""
    rank_end, coord_end = memory_stream_pair()
    rank = Channel(
        rank_end, send_key=UP, receive_key=DOWN, receive_tags=TO_RANK_TAGS, max_payload=200
    )
    coord = Channel(
        coord_end,
        send_key=DOWN,
        receive_key=UP,
        receive_tags=TO_COORDINATOR_TAGS,
        max_payload=max_payload,
    )
    return rank, coord, rank_end


async def test_send_many_is_one_write_and_receive_batch_returns_it_whole() -> None:
    _rank, coord, rank_end = pair()
    window: list[Message] = [
        SyncNow(round=3, generation=1),
        SetGlobalStep(global_step=120),
        ExtendPartition(epoch=0, offset=500, size=20),
    ]
    await coord.send_many(window)
    # One send_all: the raw stream holds the three frames back to back in one chunk.
    raw = await rank_end.receive_some()
    encoder = FrameEncoder(DOWN)
    assert raw == b"".join(encoder.encode(m) for m in window)


async def test_receive_batch_delivers_every_buffered_message_in_order() -> None:
    rank, coord, _ = pair()
    sent = [Heartbeat(rank=1, step_count=i) for i in range(5)]
    await rank.send_many(sent)
    assert await coord.receive_batch() == sent
    await rank.send(Heartbeat(rank=1, step_count=5))
    await rank.send(Heartbeat(rank=1, step_count=6))
    # Mixed use: receive() takes one of a batch, receive_batch() the rest, in order.
    assert await coord.receive() == Heartbeat(rank=1, step_count=5)
    assert await coord.receive_batch() == [Heartbeat(rank=1, step_count=6)]
    await rank.aclose()
    with pytest.raises(ChannelClosed):
        await coord.receive_batch()


async def test_encoded_message_frames_exactly_like_the_message() -> None:
    message = SyncNow(round=7, generation=2)
    encoded = encode_message(message)
    for seq in (0, 1, 41):
        plain = FrameEncoder(DOWN, first_seq=seq).encode(message)
        assert FrameEncoder(DOWN, first_seq=seq).encode(encoded) == plain
    # One encoding framed for several peers, each under its own key and sequence.
    rank, coord, _ = pair()
    beat = encode_message(CoordHeartbeat())
    await coord.send(beat)
    await coord.send_many([beat, beat])
    # Two writes, both buffered by now: one read takes them, the batch holds all three.
    assert await rank.receive_batch() == [CoordHeartbeat()] * 3


async def test_oversized_message_in_a_batch_sends_those_before_it_and_keeps_the_channel() -> None:
    rank, coord, _ = pair()
    before = Heartbeat(rank=1, step_count=1)
    with pytest.raises(FrameTooLarge):
        await rank.send_many([before, Note(rank=1, detail="x" * 500), before])
    after = Heartbeat(rank=1, step_count=2)
    await rank.send(after)  # the refused frame consumed no sequence number
    assert await coord.receive_batch() == [before, after]


async def test_oversized_encoded_message_is_refused_too() -> None:
    rank, _, _ = pair()
    with pytest.raises(FrameTooLarge):
        await rank.send(encode_message(Note(rank=1, detail="x" * 500)))


async def test_good_frames_ahead_of_a_forged_one_come_first_then_the_error() -> None:
    _rank, coord, rank_end = pair()
    encoder = FrameEncoder(UP)
    good = [Heartbeat(rank=1, step_count=i) for i in range(2)]
    data = b"".join(encoder.encode(m) for m in good)
    forged = bytearray(encoder.encode(Heartbeat(rank=1, step_count=2)))
    forged[-1] ^= 0x01
    await rank_end.send_all(data + bytes(forged))
    assert await coord.receive_batch() == good
    with pytest.raises(AuthenticationError):
        await coord.receive_batch()
    with pytest.raises(BrokenChannel):
        await coord.receive_batch()
    with pytest.raises(BrokenChannel):
        await coord.receive()


async def test_send_many_on_a_broken_stream_names_the_messages() -> None:
    rank, coord, _ = pair()
    await coord.aclose()
    with pytest.raises(BrokenChannel, match="Heartbeat, Heartbeat"):
        await rank.send_many([Heartbeat(rank=1, step_count=0)] * 2)
    with pytest.raises(BrokenChannel, match="an earlier send failed"):
        await rank.send(Heartbeat(rank=1, step_count=1))


async def test_cancelled_receive_batch_loses_no_bytes() -> None:
    _rank, coord, rank_end = pair()
    frame = FrameEncoder(UP).encode(Heartbeat(rank=2, step_count=9))
    await rank_end.send_all(frame[:30])
    with trio.move_on_after(0.01):
        await coord.receive_batch()
    await rank_end.send_all(frame[30:])
    assert await coord.receive_batch() == [Heartbeat(rank=2, step_count=9)]


async def test_decoder_read_into_keeps_the_good_messages_ahead_of_an_error() -> None:
    encoder = FrameEncoder(UP)
    good = [Heartbeat(rank=3, step_count=i) for i in range(3)]
    data = b"".join(encoder.encode(m) for m in good)
    replayed = FrameEncoder(UP, first_seq=1).encode(Heartbeat(rank=3, step_count=9))
    decoder = FrameDecoder(UP, allowed_tags=TO_COORDINATOR_TAGS)
    out: list[Message] = []
    decoder.feed(data[:-5])  # the third frame is still incomplete
    decoder.read_into(out)
    assert out == good[:2]
    decoder.feed(data[-5:] + replayed)
    with pytest.raises(SequenceError):
        decoder.read_into(out)
    assert out == good
    with pytest.raises(BrokenChannel):
        decoder.read_into(out)
