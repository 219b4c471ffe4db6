"""The coordinator's end of the ranks a node agent carries (:mod:`flodl.coordinator.carried`):
what it hands the server, and the downlink that writes what goes to them as RanksDown frames."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from flodl.coordinator.carried import (
    DOWNLINK_LIMIT,
    FRAME_BYTES,
    CarriedRank,
    Downlink,
    DownlinkHub,
)
from flodl.errors import BrokenChannel, ChannelClosed, FrameTooLarge
from flodl.transports.channel import Channel
from flodl.transports.socket_stream import SocketStream
from flodl.wire.codec import encode_message
from flodl.wire.fields import MAX_BLOB
from flodl.wire.messages import (
    FROM_AGENT_TAGS,
    TO_AGENT_TAGS,
    Abort,
    CoordHeartbeat,
    Heartbeat,
    KillRank,
    Message,
    NewGroupSession,
    RankEnd,
    RanksDown,
    SyncNow,
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


def socket_agent_pair() -> tuple[Channel, Channel]:
    """:func:`agent_pair` over a real socket pair: the coordinator's end writes without
    waiting, as a connected agent's does."""
    ours, theirs = socket.socketpair()
    for sock in (ours, theirs):
        sock.setblocking(False)
    coordinator = Channel(
        SocketStream(ours), send_key=DOWN, receive_key=UP, receive_tags=FROM_AGENT_TAGS
    )
    agent = Channel(SocketStream(theirs), send_key=UP, receive_key=DOWN, receive_tags=TO_AGENT_TAGS)
    return coordinator, agent


async def received_until_end(agent: Channel) -> tuple[list[tuple[str, tuple[int, ...]]], Message]:
    """What reached the agent, as (message kind, ranks) in order, up to the first RankEnd."""
    seen: list[tuple[str, tuple[int, ...]]] = []
    while isinstance(message := await agent.receive(), RanksDown):
        for tag, _, ranks in message.deliveries():
            seen.append((Abort.__name__ if tag == Abort.TAG else str(tag), ranks))
    return seen, message


async def test_messages_reach_the_agent_in_order_and_an_end_after_them() -> None:
    coordinator, agent = agent_pair()
    downlink = Downlink(coordinator)
    ranks = [CarriedRank(rank, downlink) for rank in (1, 2)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(downlink.run)
        ranks[0].send_nowait([Heartbeat(1, 0)])
        await ranks[1].send_many([Abort("bye")])
        ranks[0].send_nowait([CoordHeartbeat()])
        await ranks[1].aclose()  # the coordinator ends rank 2: the agent hears it last
        seen, end = await received_until_end(agent)
        nursery.cancel_scope.cancel()
    assert end == RankEnd(2)
    assert seen == [(str(Heartbeat.TAG), (1,)), ("Abort", (2,)), (str(CoordHeartbeat.TAG), (1,))]
    with pytest.raises(BrokenChannel):
        ranks[1].send_nowait([CoordHeartbeat()])  # closed: nothing more goes to it


async def test_a_kill_reaches_the_agent_after_what_was_queued_before_it() -> None:
    coordinator, agent = agent_pair()
    downlink = Downlink(coordinator)
    rank = CarriedRank(3, downlink)
    rank.send_nowait([Heartbeat(3, 0)])
    downlink.kill(3)  # the run declared rank 3 dead for silence
    downlink.end(3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(downlink.run)
        down, end, kill = [await agent.receive() for _ in range(3)]
        nursery.cancel_scope.cancel()
    assert isinstance(down, RanksDown) and [r for _, _, r in down.deliveries()] == [(3,)]
    assert (end, kill) == (RankEnd(3), KillRank(3))


async def test_a_broadcast_travels_once_for_every_rank_without_reordering_any() -> None:
    coordinator, agent = agent_pair()
    downlink = Downlink(coordinator)
    ranks = [CarriedRank(rank, downlink) for rank in range(3)]
    sync = encode_message(SyncNow(round=4, generation=0))  # one object for every rank
    ranks[0].send_nowait([sync, Abort("only 0")])
    ranks[1].send_nowait([Abort("first 1"), sync])  # 1 had something before the sync
    ranks[2].send_nowait([sync])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(downlink.run)
        down = await agent.receive()
        nursery.cancel_scope.cancel()
    assert isinstance(down, RanksDown)
    got = [(tag, ranks) for tag, _, ranks in down.deliveries()]
    assert got == [
        (SyncNow.TAG, (0, 2)),  # once for 0 and 2
        (Abort.TAG, (0,)),
        (Abort.TAG, (1,)),
        (SyncNow.TAG, (1,)),  # 1's sync stays behind its Abort
    ]


async def test_large_queues_are_cut_to_frames_and_an_agent_that_cannot_keep_up_breaks() -> None:
    coordinator, agent = agent_pair()
    downlink = Downlink(coordinator)
    rank = CarriedRank(0, downlink)
    notes = [Abort("x" * 4000) for _ in range(2 * FRAME_BYTES // 4000 + 10)]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(downlink.run)
        rank.send_nowait(notes)
        frames: list[RanksDown] = []
        while sum(len(f.ranks) for f in frames) < len(notes):
            message = await agent.receive()
            assert isinstance(message, RanksDown)
            frames.append(message)
        nursery.cancel_scope.cancel()
    assert len(frames) >= 3
    assert all(sum(map(len, f.payloads)) <= FRAME_BYTES for f in frames)
    with pytest.raises(FrameTooLarge):
        rank.send_nowait([NewGroupSession(1, 0, 2, b"y" * MAX_BLOB)])  # with its fields
    stalled = Downlink(coordinator)  # nobody writes: it fills up
    with pytest.raises(BrokenChannel, match="cannot keep up"):
        stalled.push(0, [CoordHeartbeat()] * (DOWNLINK_LIMIT + 1))
    with pytest.raises(BrokenChannel, match="connection failed"):
        CarriedRank(1, stalled).send_nowait([CoordHeartbeat()])


async def test_the_hub_writes_a_step_as_one_frame_and_keeps_what_a_busy_channel_refused() -> None:
    coordinator, agent = socket_agent_pair()
    hub = DownlinkHub()
    downlink = Downlink(coordinator, hub)
    ranks = [CarriedRank(rank, downlink) for rank in range(3)]
    beat = encode_message(CoordHeartbeat())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        nursery.start_soon(downlink.run)
        async with coordinator._send_lock:  # another send holds the channel (RunOver, say)
            for rank in ranks:
                rank.send_nowait([beat])
            await trio.testing.wait_all_tasks_blocked()  # the hub tried, and was refused
        await ranks[1].aclose()
        seen, end = await received_until_end(agent)
        nursery.cancel_scope.cancel()
    await coordinator.aclose()
    await agent.aclose()
    assert seen == [(str(CoordHeartbeat.TAG), (0, 1, 2))]  # nothing lost, one payload
    assert end == RankEnd(1)


async def test_what_arrives_before_the_server_attaches_is_held_and_handed_over() -> None:
    coordinator, _agent = agent_pair()
    rank = CarriedRank(3, Downlink(coordinator))
    rank.deliver([Heartbeat(3, 1)], 0.0)
    rank.deliver([Heartbeat(3, 2)], 0.0)
    handed: list[Message] = []
    ends: list[Exception | None] = []
    rank.attach(lambda batch, _now: handed.extend(batch), ends.append)
    assert handed == [Heartbeat(3, 1), Heartbeat(3, 2)] and ends == []
    rank.deliver([Heartbeat(3, 3)], 1.0)
    gone = ChannelClosed("the agent is gone")
    rank.ended(gone)
    rank.ended(None)  # once only
    rank.deliver([Heartbeat(3, 4)], 2.0)  # after its end: dropped
    assert handed[-1] == Heartbeat(3, 3) and ends == [gone]
    early = CarriedRank(4, Downlink(coordinator))
    early.ended(None)  # the rank's connection ended before the server attached
    early.attach(lambda batch, _now: handed.extend(batch), ends.append)
    assert ends == [gone, None]
