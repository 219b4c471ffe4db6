"""memory:// transport: registry, buffering, and the fault plan (latency, cut, partition).

Timing tests run under trio's MockClock with autojump, so measured delays are exact.
"""

from __future__ import annotations

import itertools
import math

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.errors import AddressInUse, ConfigError, TransportError
from flodl.transports import Listener, connect, open_listener
from flodl.transports.memory import (
    DEFAULT_NETWORK,
    FaultPlan,
    MemoryNetwork,
    MemoryStream,
    MemoryTransport,
    fault_plan,
    set_fault_plan,
)
from flodl.transports.memory_stream import memory_stream_pair
from flodl.transports.url import parse_url

_names = itertools.count()


def fresh_name() -> str:
    """A name no other test uses in the process-wide network."""
    return f"test-memory-{next(_names)}"


async def connected(name: str) -> tuple[MemoryStream, MemoryStream, Listener]:
    listener = await open_listener(f"memory://{name}")
    client = await connect(f"memory://{name}")
    server = await listener.accept()
    assert isinstance(client, MemoryStream)
    assert isinstance(server, MemoryStream)
    return client, server, listener


async def receive_exactly(stream: trio.abc.ReceiveStream, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = await stream.receive_some()
        assert chunk, "unexpected EOF"
        data += chunk
    return data


# --- registry -----------------------------------------------------------------------------


async def test_connect_without_listener_is_a_transport_error() -> None:
    name = fresh_name()
    with pytest.raises(TransportError, match=f"memory://{name}: nobody is listening"):
        await connect(f"memory://{name}")


async def test_second_listener_on_a_live_name_is_refused_until_the_first_closes() -> None:
    url = f"memory://{fresh_name()}"
    first = await open_listener(url)
    assert first.url == url
    with pytest.raises(AddressInUse, match="a live listener holds it"):
        await open_listener(url)
    await first.aclose()
    async with await open_listener(url) as second:
        client = await connect(url)
        server = await second.accept()
        await client.send_all(b"hi")
        assert await server.receive_some() == b"hi"


async def test_closing_a_listener_ends_unaccepted_connections_and_frees_the_name() -> None:
    name = fresh_name()
    listener = await open_listener(f"memory://{name}")
    client = await connect(f"memory://{name}")
    await listener.aclose()
    assert await client.receive_some() == b""
    with pytest.raises(trio.BrokenResourceError):
        await client.send_all(b"x")
    with pytest.raises(trio.ClosedResourceError):
        await listener.accept()
    with pytest.raises(TransportError):
        await connect(f"memory://{name}")


async def test_closing_a_listener_wakes_a_blocked_accept() -> None:
    listener = await open_listener(f"memory://{fresh_name()}")
    async with trio.open_nursery() as nursery:

        async def blocked_accept() -> None:
            with pytest.raises(trio.ClosedResourceError):
                await listener.accept()

        nursery.start_soon(blocked_accept)
        await trio.testing.wait_all_tasks_blocked()
        await listener.aclose()


async def test_a_private_network_is_isolated_from_the_process_wide_one() -> None:
    name = fresh_name()
    network = MemoryNetwork()
    transport = MemoryTransport(network)
    address = parse_url(f"memory://{name}")
    async with await transport.open_listener(address):
        assert DEFAULT_NETWORK.listener(name) is None
        with pytest.raises(TransportError):
            await connect(f"memory://{name}")
        await transport.connect(address)


async def test_a_thousand_connections_start_no_tasks() -> None:
    name = fresh_name()
    tasks_before = trio.lowlevel.current_statistics().tasks_living
    pairs = []
    async with await open_listener(f"memory://{name}") as listener:
        for _ in range(1000):
            client = await connect(f"memory://{name}")
            pairs.append((client, await listener.accept()))
        assert trio.lowlevel.current_statistics().tasks_living == tasks_before
        for rank, (client, _) in enumerate(pairs):
            await client.send_all(rank.to_bytes(2, "big"))
        for rank, (_, server) in enumerate(pairs):
            assert await server.receive_some() == rank.to_bytes(2, "big")


# --- buffering ----------------------------------------------------------------------------


async def test_send_all_waits_while_more_than_capacity_is_unread(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client, server = memory_stream_pair(capacity=4)
    done_at: list[float] = []

    async def sender() -> None:
        await client.send_all(b"0123456789")  # 10 unread > 4: waits for the reader
        done_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.sleep(5)
        assert done_at == []
        assert await server.receive_some(5) == b"01234"
        await trio.sleep(1)
        assert done_at == []  # 5 still unread
        assert await server.receive_some(1) == b"5"  # 4 unread: room again
    assert done_at == [pytest.approx(trio.current_time())]
    assert await server.receive_some() == b"6789"


async def test_receive_gathers_ready_chunks_up_to_max_bytes() -> None:
    client, server = memory_stream_pair()
    for piece in (b"ab", b"cd", b"ef"):
        await client.send_all(piece)
    assert await server.receive_some(3) == b"abc"
    assert await server.receive_some() == b"def"


# --- latency --------------------------------------------------------------------------------


async def test_latency_delays_each_send_by_exactly_the_plan(
    autojump_clock: trio.testing.MockClock,
) -> None:
    name = fresh_name()
    set_fault_plan(name, FaultPlan(latency=0.05))
    client, server, listener = await connected(name)
    async with listener:
        start = trio.current_time()
        await client.send_all(b"first")
        assert trio.current_time() == start  # sending does not wait for delivery
        await trio.sleep(0.01)
        await client.send_all(b"second")
        assert await server.receive_some() == b"first"
        assert trio.current_time() == start + 0.05
        assert await server.receive_some() == b"second"
        assert trio.current_time() == pytest.approx(start + 0.06, abs=1e-12)
        # The other direction has the same latency; EOF travels with it.
        sent_at = trio.current_time()
        await server.send_all(b"back")
        await server.send_eof()
        assert await client.receive_some() == b"back"
        assert await client.receive_some() == b""
        assert trio.current_time() == sent_at + 0.05


async def test_latency_changed_at_runtime_applies_to_later_sends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    name = fresh_name()
    client, server, listener = await connected(name)
    async with listener:
        start = trio.current_time()
        await client.send_all(b"a")
        assert await server.receive_some() == b"a"
        assert trio.current_time() == start  # perfect link: no delay
        set_fault_plan(name, FaultPlan(latency=2.0))
        assert fault_plan(name) == FaultPlan(latency=2.0)
        await client.send_all(b"b")
        assert await server.receive_some() == b"b"
        assert trio.current_time() == start + 2.0


# --- cut ------------------------------------------------------------------------------------


async def test_cut_delivers_exactly_n_bytes_then_breaks_both_ends() -> None:
    name = fresh_name()
    set_fault_plan(name, FaultPlan(cut_after_bytes=10))
    client, server, listener = await connected(name)
    async with listener:
        await server.send_all(b"reply")  # the other direction has its own budget
        await client.send_all(b"012345")
        with pytest.raises(trio.BrokenResourceError, match="cut after 10 bytes"):
            await client.send_all(b"6789ABC")
        assert await receive_exactly(server, 10) == b"0123456789"
        with pytest.raises(trio.BrokenResourceError):
            await server.receive_some()
        with pytest.raises(trio.BrokenResourceError):
            await server.receive_some()  # stays broken
        with pytest.raises(trio.BrokenResourceError):
            await server.send_all(b"x")
        assert await client.receive_some() == b"reply"  # queued before the cut
        with pytest.raises(trio.BrokenResourceError):
            await client.receive_some()
        with pytest.raises(trio.BrokenResourceError):
            await client.send_all(b"y")


async def test_cut_wakes_a_reader_blocked_on_the_cutting_end() -> None:
    name = fresh_name()
    set_fault_plan(name, FaultPlan(cut_after_bytes=3))
    client, server, listener = await connected(name)
    async with listener:
        outcome: list[str] = []

        async def blocked_receiver() -> None:
            with pytest.raises(trio.BrokenResourceError):
                await server.receive_some()
            outcome.append("broken")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(blocked_receiver)
            await trio.testing.wait_all_tasks_blocked()
            assert outcome == []
            with pytest.raises(trio.BrokenResourceError):
                await server.send_all(b"four")
        assert outcome == ["broken"]
        assert await client.receive_some() == b"fou"  # bytes within the budget arrive
        with pytest.raises(trio.BrokenResourceError):
            await client.receive_some()


async def test_exactly_n_bytes_do_not_cut() -> None:
    client, server = memory_stream_pair()
    client._outgoing.link.set_plan(FaultPlan(cut_after_bytes=4))
    await client.send_all(b"abcd")
    await client.send_eof()
    assert await receive_exactly(server, 4) == b"abcd"
    assert await server.receive_some() == b""


# --- partition ------------------------------------------------------------------------------


async def test_partition_holds_bytes_and_releases_them_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    name = fresh_name()
    client, server, listener = await connected(name)
    async with listener:
        set_fault_plan(name, FaultPlan(partitioned=True))
        for piece in (b"one ", b"two ", b"three"):
            await client.send_all(piece)  # held, not errored
        await server.send_all(b"reverse")
        with trio.move_on_after(3600) as waited:
            await server.receive_some()
        assert waited.cancelled_caught  # an hour of partition delivered nothing
        with trio.move_on_after(3600) as waited_back:
            await client.receive_some()
        assert waited_back.cancelled_caught

        async def heal_later() -> None:
            await trio.sleep(7)
            set_fault_plan(name, FaultPlan(partitioned=False))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(heal_later)
            healed_from = trio.current_time()
            assert await server.receive_some() == b"one two three"
            assert trio.current_time() == healed_from + 7
        assert await client.receive_some() == b"reverse"


async def test_held_bytes_keep_their_latency_after_a_short_partition(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client, server = memory_stream_pair()
    link = client._outgoing.link
    link.set_plan(FaultPlan(latency=10.0, partitioned=True))
    start = trio.current_time()
    await client.send_all(b"x")
    await trio.sleep(4)
    link.set_plan(FaultPlan(latency=10.0, partitioned=False))
    assert await server.receive_some() == b"x"
    assert trio.current_time() == start + 10.0


async def test_connect_waits_for_a_partition_to_heal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    name = fresh_name()
    async with await open_listener(f"memory://{name}") as listener:
        set_fault_plan(name, FaultPlan(partitioned=True))
        with trio.move_on_after(30) as attempt:
            await connect(f"memory://{name}")
        assert attempt.cancelled_caught

        async def heal_later() -> None:
            await trio.sleep(2)
            set_fault_plan(name, FaultPlan())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(heal_later)
            start = trio.current_time()
            client = await connect(f"memory://{name}")
            assert trio.current_time() == start + 2
        server = await listener.accept()  # the cancelled attempt left nothing queued
        await client.send_all(b"ok")
        assert await server.receive_some() == b"ok"
        with trio.move_on_after(1) as extra:
            await listener.accept()
        assert extra.cancelled_caught


async def test_closing_an_end_wakes_its_reader_held_by_a_partition() -> None:
    client, server = memory_stream_pair()
    client._outgoing.link.set_plan(FaultPlan(partitioned=True))
    async with trio.open_nursery() as nursery:

        async def held_reader() -> None:
            with pytest.raises(trio.ClosedResourceError):
                await server.receive_some()

        nursery.start_soon(held_reader)
        await trio.testing.wait_all_tasks_blocked()
        await server.aclose()


# --- plan validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"latency": -0.1},
        {"latency": math.inf},
        {"latency": math.nan},
        {"cut_after_bytes": -1},
        {"cut_after_bytes": 1.5},
        {"cut_after_bytes": True},
        {"partitioned": 1},
    ],
)
def test_invalid_fault_plans_are_config_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises((ConfigError, TypeError)):
        FaultPlan(**kwargs)  # type: ignore[arg-type]


def test_negative_capacity_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="capacity"):
        memory_stream_pair(capacity=-1)


# --- property: whatever the plan does over time, bytes arrive whole and in order ------------

_pauses = st.floats(min_value=0.0, max_value=5.0)


@settings(max_examples=60, deadline=None)
@given(
    writes=st.lists(st.one_of(st.binary(min_size=1, max_size=300), _pauses), max_size=30),
    plans=st.lists(
        st.one_of(
            st.builds(
                FaultPlan,
                latency=st.sampled_from([0.0, 0.001, 0.5, 3.0]),
                partitioned=st.booleans(),
            ),
            _pauses,
        ),
        max_size=20,
    ),
    capacity=st.sampled_from([0, 1, 64, 65536]),
    read_size=st.integers(min_value=1, max_value=500),
)
def test_bytes_arrive_in_order_through_any_plan_changes(
    writes: list[bytes | float], plans: list[FaultPlan | float], capacity: int, read_size: int
) -> None:
    sent = b"".join(step for step in writes if isinstance(step, bytes))

    async def scenario() -> None:
        client, server = memory_stream_pair(capacity=capacity)
        link = client._outgoing.link
        received = bytearray()

        async def writer() -> None:
            for step in writes:
                if isinstance(step, bytes):
                    await client.send_all(step)
                else:
                    await trio.sleep(step)
            await client.send_eof()

        async def saboteur() -> None:
            for step in plans:
                if isinstance(step, FaultPlan):
                    link.set_plan(step)
                else:
                    await trio.sleep(step)
            link.set_plan(FaultPlan())  # heal at the end, so everything held arrives

        async def reader() -> None:
            while chunk := await server.receive_some(read_size):
                assert len(chunk) <= read_size
                received.extend(chunk)

        # A stuck scenario fails (mock time jumps to the deadline) instead of hanging.
        with trio.fail_after(10_000):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                nursery.start_soon(saboteur)
                nursery.start_soon(reader)
        assert bytes(received) == sent

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
