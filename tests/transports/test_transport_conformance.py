"""Every transport's streams pass trio's generic stream checks (half-closeable included)."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from flodl.transports import connect, open_listener
from flodl.transports.memory import FaultPlan, MemoryNetwork, MemoryTransport
from flodl.transports.memory_stream import MemoryStream, memory_stream_pair
from flodl.transports.url import parse_url

Pair = tuple[trio.abc.HalfCloseableStream, trio.abc.HalfCloseableStream]


async def _connected_pair(url: str) -> Pair:
    """Client and server ends of one connection through the public connect/open_listener."""
    async with await open_listener(url) as listener:
        client = await connect(listener.url)
        server = await listener.accept()
    assert isinstance(client, trio.abc.HalfCloseableStream)
    assert isinstance(server, trio.abc.HalfCloseableStream)
    return client, server


async def _fill(stream: trio.abc.Stream) -> None:
    """Send until the kernel buffers are full, so the next send_all blocks.

    Shrinking SO_SNDBUF/SO_RCVBUF instead would make the clogged checks wait on TCP's
    zero-window persist timer (about a second each).
    """

    async def sender() -> None:
        while True:
            await stream.send_all(b"x" * 65536)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()


async def _clogged(url: str) -> Pair:
    client, server = await _connected_pair(url)
    await _fill(client)
    await _fill(server)
    return client, server


async def test_tcp_streams_conform() -> None:
    async def maker() -> Pair:
        return await _connected_pair("tcp://127.0.0.1:0")

    async def clogged_maker() -> Pair:
        return await _clogged("tcp://127.0.0.1:0")

    await trio.testing.check_half_closeable_stream(maker, clogged_maker)


async def test_unix_streams_conform(tmp_path: Path) -> None:
    url = f"unix://{tmp_path}/conformance.sock"

    async def maker() -> Pair:
        return await _connected_pair(url)

    async def clogged_maker() -> Pair:
        return await _clogged(url)

    await trio.testing.check_half_closeable_stream(maker, clogged_maker)


async def test_memory_streams_conform_through_connect() -> None:
    async def maker() -> Pair:
        return await _connected_pair("memory://conformance")

    network = MemoryNetwork()
    lockstep = MemoryTransport(network, capacity=0)

    async def clogged_maker() -> Pair:
        address = parse_url("memory://conformance-lockstep")
        async with await lockstep.open_listener(address) as listener:
            client = await lockstep.connect(address)
            server = await listener.accept()
        return client, server

    await trio.testing.check_half_closeable_stream(maker, clogged_maker)


async def test_memory_streams_conform_with_latency(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    network.set_fault_plan("slow", FaultPlan(latency=0.25))

    async def maker() -> tuple[MemoryStream, MemoryStream]:
        return memory_stream_pair(network.link("slow"))

    async def clogged_maker() -> tuple[MemoryStream, MemoryStream]:
        return memory_stream_pair(network.link("slow"), capacity=0)

    await trio.testing.check_half_closeable_stream(maker, clogged_maker)
