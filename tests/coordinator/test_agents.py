"""Node agents at a real coordinator over TCP: their ranks, their exits, their bad claims.

Each test runs a coordinator on 127.0.0.1 and speaks for agents with the real handshake and
channel (:func:`flodl.transports.channel.connect_agent`), as ``flodl agent`` does.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import cbor2
import pytest
import trio
from trio.testing import MockClock

from flodl.agent.link import AgentLink
from flodl.coordinator.server import Coordinator, open_coordinator
from flodl.core.coordinator.timeline import EventKind
from flodl.errors import (
    AgentRefused,
    ChannelClosed,
    DuplicateRank,
    HandshakeError,
    HandshakeVersionMismatch,
    WrongKey,
)
from flodl.transports import connect
from flodl.transports.channel import Channel
from flodl.transports.greeting import connect_agent, connect_rank
from flodl.wire.handshake import SERVER_HELLO_SIZE, HelloStatus, make_client_hello
from flodl.wire.messages import (
    AgentJoin,
    AgentRefusal,
    AgentStop,
    AssignRanks,
    CoordHeartbeat,
    Heartbeat,
    Message,
    RankExited,
    RankOpen,
    RanksDown,
    RanksUp,
    RunOver,
    RunSettings,
    to_payload,
)
from tests.coordinator.agent_helpers import carrying_agent

KEY = bytes(range(32))
WORLD = 4
HEARTBEAT_1 = cbor2.dumps(to_payload(Heartbeat(1, 0)))


@asynccontextmanager
async def coordinator() -> AsyncIterator[Coordinator]:
    async with open_coordinator("tcp://127.0.0.1:0", WORLD, KEY, linger=0.0) as coord:
        yield coord


@asynccontextmanager
async def agent(coord: Coordinator, node: int, nproc: int) -> AsyncIterator[Channel]:
    """Node ``node``'s agent, joined with ``nproc`` ranks (not yet told its ranks)."""
    channel = await connect_agent(await connect(coord.url), KEY, node)
    async with channel:
        await channel.send(AgentJoin(node, nproc, "test-host"))
        yield channel


async def nothing_yet(channel: Channel) -> None:
    """The coordinator has sent ``channel`` nothing (the clock jumps past a long wait)."""
    with trio.move_on_after(60):
        message = await channel.receive()
        raise AssertionError(f"expected nothing yet, got {message}")


async def test_agents_are_told_their_ranks_in_node_order_whatever_order_they_joined(
    autojump_clock: MockClock,
) -> None:
    async with coordinator() as coord, agent(coord, 1, 3) as second:
        await nothing_yet(second)  # node 0 has not joined: node 1's first rank is not known
        async with agent(coord, 0, 1) as first:
            assert await first.receive() == AssignRanks(0, 1, WORLD)
            assert await second.receive() == AssignRanks(1, 3, WORLD)
        assert coord.agents is not None
        assert [coord.agents.table.owner(rank) for rank in range(WORLD)] == [0, 1, 1, 1]


async def test_a_second_agent_for_a_node_is_refused_while_the_first_is_connected(
    autojump_clock: MockClock,
) -> None:
    async with coordinator() as coord, agent(coord, 0, 2) as first:
        assert await first.receive() == AssignRanks(0, 2, WORLD)
        stream = await connect(coord.url)
        with pytest.raises(
            DuplicateRank,
            match="refused node 0: another live connection already holds an agent for that node",
        ):
            await connect_agent(stream, KEY, 0)
        await stream.aclose()
        # The first agent is undisturbed: it can still speak for its ranks.
        await first.send(RankExited(1, 4242, 1, 0.0, False, "Traceback: boom"))
        await trio.sleep(1)
        assert coord.agents is not None
        assert [exit.tail for exit in coord.agents.exits] == ["Traceback: boom"]


async def test_an_agent_speaking_for_another_nodes_rank_is_refused_and_the_run_goes_on(
    autojump_clock: MockClock,
) -> None:
    async with coordinator() as coord, agent(coord, 0, 2) as honest, agent(coord, 1, 2) as liar:
        assert await honest.receive() == AssignRanks(0, 2, WORLD)
        assert await liar.receive() == AssignRanks(2, 2, WORLD)
        await liar.send(RankExited(0, 99, -9, 0.0, False, ""))
        refusal = await liar.receive()
        assert isinstance(refusal, AgentRefusal)
        assert refusal.reason == "node 1's agent reported the exit of rank 0, which it does not run"
        with pytest.raises(Exception):  # noqa: B017 - closed by the coordinator: any end will do
            await liar.receive()
        errors = [err for _, err in coord.rank_errors]
        assert [type(err) for err in errors] == [AgentRefused]
        # The lie reached nothing: rank 0 is not dead. The honest agent's report is heard.
        assert not any("rank 0" in str(event.detail) for event in coord.timeline)
        await honest.send(RankExited(0, 4242, 3, 0.0, False, ""))
        await trio.sleep(1)
        assert any("rank 0 exited with code 3" in str(event.detail) for event in coord.timeline)


async def test_an_agent_that_joins_as_another_node_or_twice_is_refused(
    autojump_clock: MockClock,
) -> None:
    async with coordinator() as coord:
        channel = await connect_agent(await connect(coord.url), KEY, 0)
        async with channel:
            await channel.send(AgentJoin(1, 2, "test-host"))
            refusal = await channel.receive()
            assert isinstance(refusal, AgentRefusal)
            assert "joined as node 1 (its hello said 0)" in refusal.reason
        async with agent(coord, 0, 2) as again:
            assert await again.receive() == AssignRanks(0, 2, WORLD)
            await again.send(AgentJoin(0, 2, "test-host"))
            refusal = await again.receive()
            assert isinstance(refusal, AgentRefusal)
            assert refusal.reason == "node 0's agent sent AgentJoin after joining"


async def test_an_agent_stop_ends_the_run_and_every_agent_hears_it(
    autojump_clock: MockClock,
) -> None:
    async with coordinator() as coord, agent(coord, 0, 2) as first, agent(coord, 1, 2) as second:
        assert await first.receive() == AssignRanks(0, 2, WORLD)
        assert await second.receive() == AssignRanks(2, 2, WORLD)
        await second.send(AgentStop("node 1's agent was signalled"))
        assert await first.receive() == RunOver("the run ended")
        assert await second.receive() == RunOver("the run ended")
        assert coord.run_ended


async def test_agents_with_a_wrong_key_or_version_are_refused_with_the_typed_error(
    autojump_clock: MockClock,
) -> None:
    async with coordinator() as coord:
        stream = await connect(coord.url)
        with pytest.raises(WrongKey):
            await connect_agent(stream, bytes(32), 0)
        await stream.aclose()
        hello, _ = make_client_hello(KEY, 0, 0, agent=True)
        stream = await connect(coord.url)
        await stream.send_all(hello[:4] + struct.pack("<H", 99) + hello[6:])
        reply = b""
        while len(reply) < SERVER_HELLO_SIZE:
            reply += await stream.receive_some()
        # The refusal says VERSION_MISMATCH (it cannot be bound to a hello it did not read).
        assert struct.unpack_from("<IHH", reply)[2] == HelloStatus.VERSION_MISMATCH
        await stream.aclose()
        assert [type(err) for _, err in coord.rank_errors] == [WrongKey, HandshakeVersionMismatch]
        # A rank's hello for an agent's node rank is a different claim: it is admitted.
        rank = await connect_rank(await connect(coord.url), KEY, 0, WORLD)
        async with agent(coord, 0, 1) as first:
            assert await first.receive() == AssignRanks(0, 1, WORLD)
        await rank.aclose()


# --- ranks through their agent's one connection ------------------------------------------------


async def rank_through(link: AgentLink, rank: int, world: int = WORLD) -> Channel:
    return await connect_rank(await connect(link.ranks.url), KEY, rank, world)


async def test_ranks_reach_the_coordinator_through_their_agents_one_connection(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    async with (
        coordinator() as coord,
        AsyncExitStack() as closing,  # the ranks' channels, also when an assertion fails
        carrying_agent(coord, 0, 2, tmp_path / "a", KEY) as first,
    ):
        async with carrying_agent(coord, 1, 2, tmp_path / "b", KEY) as second:
            ranks = [
                await rank_through(first, 0),
                await rank_through(first, 1),
                await rank_through(second, 2),
                await rank_through(second, 3),
            ]
            for channel in ranks:
                closing.push_async_callback(channel.aclose)
            for channel in ranks:  # the coordinator's first word, through the agent
                assert isinstance(await channel.receive(), RunSettings)
            assert coord.connected_ranks == {0, 1, 2, 3}
            await ranks[3].send(Heartbeat(3, 0))
            assert isinstance(await ranks[3].receive(), CoordHeartbeat)
            await ranks[1].aclose()  # its connection at the agent ends: the coordinator sees it
            await trio.sleep(1)
            assert coord.connected_ranks == {0, 2, 3}
            dead = [e for e in coord.timeline if e.kind is EventKind.RANK_DEAD]
            assert [e.detail["rank"] for e in dead] == [1]
        # Node 1's agent is gone: so are the ranks it carried, at once.
        await trio.sleep(1)
        assert coord.connected_ranks == {0}
        with pytest.raises(ChannelClosed):
            while True:
                await ranks[2].receive()


async def test_a_rank_through_another_nodes_agent_is_refused_by_that_agent(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    async with coordinator() as coord, carrying_agent(coord, 0, 2, tmp_path / "a", KEY) as first:
        async with carrying_agent(coord, 1, 2, tmp_path / "b", KEY):
            stream = await connect(first.ranks.url)
            with pytest.raises(HandshakeError):  # rank 3 is node 1's: the hello goes unanswered
                await connect_rank(stream, KEY, 3, WORLD)
            await stream.aclose()
            assert coord.connected_ranks == set()  # it never reached the coordinator
            honest = await rank_through(first, 0)  # the agent's own ranks still get in
            assert isinstance(await honest.receive(), RunSettings)
            second = await connect(first.ranks.url)
            with pytest.raises(DuplicateRank):  # one connection per rank, as at the coordinator
                await connect_rank(second, KEY, 0, WORLD)
            await second.aclose()
            assert coord.connected_ranks == {0}
            await honest.aclose()


async def test_a_rank_that_lies_about_its_id_is_let_go_by_its_agent(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    async with coordinator() as coord, carrying_agent(coord, 0, 2, tmp_path / "a", KEY) as first:
        liar = await rank_through(first, 0)
        honest = await rank_through(first, 1)
        assert isinstance(await liar.receive(), RunSettings)
        assert isinstance(await honest.receive(), RunSettings)
        await liar.send(Heartbeat(1, 0))  # rank 0 speaking as rank 1
        with pytest.raises(ChannelClosed):
            while True:
                await liar.receive()
        await trio.sleep(1)
        assert coord.connected_ranks == {1}  # the honest rank is undisturbed
        await honest.send(Heartbeat(1, 0))
        assert isinstance(await honest.receive(), CoordHeartbeat)
        await liar.aclose()
        await honest.aclose()


@pytest.mark.parametrize(
    ("claim", "why"),
    [
        (RankOpen(2), "node 0's agent opened rank 2, which it does not run"),
        (RanksUp((Heartbeat.TAG,), (HEARTBEAT_1,)), "spoke for rank 1, which it has not opened"),
        (RanksUp((Heartbeat.TAG,), (b"\xff\x00",)), "carried a message that does not decode"),
        (RanksUp((AgentJoin.TAG,), (HEARTBEAT_1,)), "carried a message that does not decode"),
    ],
    ids=["foreign-rank", "unopened-rank", "garbage", "wrong-kind"],
)
async def test_an_agent_that_speaks_for_what_it_does_not_carry_is_refused(
    autojump_clock: MockClock, claim: Message, why: str
) -> None:
    async with coordinator() as coord, agent(coord, 0, 2) as liar, agent(coord, 1, 2) as honest:
        assert await liar.receive() == AssignRanks(0, 2, WORLD)
        assert await honest.receive() == AssignRanks(2, 2, WORLD)
        await honest.send(RankOpen(2))
        assert isinstance(await honest.receive(), RanksDown)  # rank 2's RunSettings
        await liar.send(RankOpen(0))
        assert isinstance(await liar.receive(), RanksDown)
        await liar.send(claim)
        while not isinstance(message := await liar.receive(), AgentRefusal):
            pass
        assert why in message.reason
        await trio.sleep(1)
        errors = {(rank, type(err)) for rank, err in coord.rank_errors}
        assert errors == {(None, AgentRefused), (0, ChannelClosed)}  # the agent, and its rank
        assert coord.connected_ranks == {2}  # the liar's rank went with it; the other stays
        await honest.send(RanksUp((Heartbeat.TAG,), (cbor2.dumps(to_payload(Heartbeat(2, 0))),)))
        down = await honest.receive()
        assert isinstance(down, RanksDown) and down.ranks == (2,)
        assert down.tags == (CoordHeartbeat.TAG,)


async def test_the_ranks_of_one_agent_get_their_heartbeat_together_in_one_frame(
    autojump_clock: MockClock,
) -> None:
    async with coordinator() as coord, agent(coord, 0, 4) as only:
        assert await only.receive() == AssignRanks(0, 4, WORLD)
        for rank in range(4):
            await only.send(RankOpen(rank))
        beats: list[tuple[int, ...]] = []
        with trio.move_on_after(3.5):  # past the interval the ranks first beat in
            while True:
                message = await only.receive()
                assert isinstance(message, RanksDown)
                beats += [r for tag, _, r in message.deliveries() if tag == CoordHeartbeat.TAG]
        assert coord.connected_ranks == {0, 1, 2, 3}
        assert len(beats) >= 2
        assert all(sorted(ranks) == [0, 1, 2, 3] for ranks in beats)  # one payload, one frame
