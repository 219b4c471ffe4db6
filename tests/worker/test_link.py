"""The rank's receiver (:func:`flodl.worker.link.receive_until_lost`) and its lifeline: the
pipe a node agent holds open, whose end means the agent died."""

from __future__ import annotations

import os

import trio
import trio.testing
from trio.testing import MockClock

from flodl.errors import FlodlError
from flodl.transports.channel import Channel
from flodl.wire.messages import TO_COORDINATOR_TAGS, TO_RANK_TAGS, CoordHeartbeat, Message
from flodl.worker.link import receive_until_lost

UP, DOWN = b"u" * 32, b"d" * 32


def channels() -> tuple[Channel, Channel]:
    rank_end, coordinator_end = trio.testing.memory_stream_pair()
    rank = Channel(rank_end, send_key=UP, receive_key=DOWN, receive_tags=TO_RANK_TAGS)
    coordinator = Channel(
        coordinator_end, send_key=DOWN, receive_key=UP, receive_tags=TO_COORDINATOR_TAGS
    )
    return rank, coordinator


async def test_the_end_of_the_lifeline_loses_the_coordinator_at_once(
    autojump_clock: MockClock,
) -> None:
    rank, coordinator = channels()
    read_end, write_end = os.pipe()
    heard: list[Message] = []
    lost: list[FlodlError] = []
    try:
        async with trio.open_nursery() as nursery:
            receiving = trio.Event()

            async def receive() -> None:
                await receive_until_lost(rank, 10.0, heard.append, lost.append, lifeline=read_end)
                receiving.set()

            nursery.start_soon(receive)
            await coordinator.send(CoordHeartbeat())
            await trio.sleep(5)  # half the heartbeat timeout: nothing is lost yet
            assert heard == [CoordHeartbeat()] and lost == []
            start = trio.current_time()
            os.close(write_end)  # the agent died
            write_end = -1
            await receiving.wait()
            assert trio.current_time() == start  # at once, not at the heartbeat timeout
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    assert [str(err) for err in lost] == ["the node agent that started this rank is gone"]


async def test_without_a_lifeline_silence_still_loses_the_coordinator(
    autojump_clock: MockClock,
) -> None:
    rank, _coordinator = channels()
    lost: list[FlodlError] = []
    start = trio.current_time()
    await receive_until_lost(rank, 10.0, lambda message: None, lost.append)
    assert trio.current_time() - start == 10.0
    assert "silent for 10 s" in str(lost[0])
