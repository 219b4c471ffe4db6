"""Test peers for the admission server: an echoing coordinator, honest ranks, raw hostile bytes."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from flodl.coordinator.admission import serve_ranks
from flodl.transports import connect, open_listener
from flodl.transports.channel import Channel
from flodl.transports.greeting import connect_rank
from flodl.wire import codec
from flodl.wire.handshake import (
    SERVER_HELLO_SIZE,
    SessionKeys,
    check_server_hello,
    make_client_hello,
)
from flodl.wire.messages import Heartbeat, SyncNow

KEY = b"admission-test-key-0123456789abc"
OTHER_KEY = b"not-the-session-key-0123456789ab"
SIGNATURE = bytes(range(100, 132))
WORLD = 3
WAIT = 10.0
"""Upper bound on any single wait in these tests (real clock): a hang fails instead of stalling."""


@attrs.define
class EchoServer:
    """serve_ranks answering Heartbeat(rank, n) with SyncNow(round=n, generation=rank)."""

    url: str
    errors: trio.MemoryReceiveChannel[tuple[int | None, BaseException]]
    finished: trio.MemoryReceiveChannel[int]

    async def next_error(self) -> tuple[int | None, BaseException]:
        """The next (rank, error) the server reported."""
        with trio.fail_after(WAIT):
            return await self.errors.receive()

    async def next_finished(self) -> int:
        """The rank whose handler returned next."""
        with trio.fail_after(WAIT):
            return await self.finished.receive()

    async def connect(self) -> trio.abc.Stream:
        return await connect(self.url)

    async def join(self, rank: int, key: bytes = KEY, world: int = WORLD) -> Channel:
        """An honest rank's channel (with the server's signature)."""
        stream = await self.connect()
        return await connect_rank(stream, key, rank, world, SIGNATURE)


@asynccontextmanager
async def echo_server(
    url: str = "tcp://127.0.0.1:0", handshake_timeout: float = 5.0
) -> AsyncIterator[EchoServer]:
    """Run an echoing serve_ranks on ``url`` for the duration of the block."""
    error_in, error_out = trio.open_memory_channel[tuple[int | None, BaseException]](math.inf)
    done_in, done_out = trio.open_memory_channel[int](math.inf)

    async def handler(rank: int, channel: Channel) -> None:
        try:
            async for message in channel:
                assert isinstance(message, Heartbeat)
                await channel.send(SyncNow(round=message.step_count, generation=rank))
        finally:
            done_in.send_nowait(rank)

    def on_error(rank: int | None, error: BaseException) -> None:
        error_in.send_nowait((rank, error))

    async with await open_listener(url) as listener, trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: serve_ranks(
                listener,
                KEY,
                WORLD,
                handler,
                signature=SIGNATURE,
                handshake_timeout=handshake_timeout,
                on_rank_error=on_error,
                task_status=task_status,
            )
        )
        yield EchoServer(url=listener.url, errors=error_out, finished=done_out)
        nursery.cancel_scope.cancel()


async def exchange(channel: Channel, rank: int, step: int) -> None:
    """One round trip through the echo server; fails unless the answer is exact."""
    with trio.fail_after(WAIT):
        await channel.send(Heartbeat(rank=rank, step_count=step))
        assert await channel.receive() == SyncNow(round=step, generation=rank)


async def raw_handshake(
    stream: trio.abc.Stream, rank: int, key: bytes = KEY, world: int = WORLD
) -> SessionKeys:
    """Handshake by hand (sans-IO functions), leaving the stream for raw frames."""
    hello, state = make_client_hello(key, rank, world, SIGNATURE)
    await stream.send_all(hello)
    reply = await receive_exactly(stream, SERVER_HELLO_SIZE)
    return check_server_hello(reply, state)


async def receive_exactly(stream: trio.abc.Stream, size: int) -> bytes:
    data = b""
    with trio.fail_after(WAIT):
        while len(data) < size:
            chunk = await stream.receive_some(size - len(data))
            assert chunk, f"stream ended after {len(data)} of {size} bytes"
            data += chunk
    return data


def raw_frame(key: bytes, tag: int, payload: bytes, seq: int, length: int | None = None) -> bytes:
    """A frame built from the codec's parts: correct MAC over any payload and header."""
    size = len(payload) if length is None else length
    header = codec._HEADER.pack(codec.FRAME_MAGIC, codec.PROTOCOL_VERSION, tag, size, seq)
    return header + codec._Mac(key).digest(header, payload) + payload


async def expect_dropped(stream: trio.abc.Stream) -> bytes:
    """Read until the server hangs up; every byte it sent first. Fails if it never does."""
    received = b""
    with trio.fail_after(WAIT):
        while True:
            try:
                chunk = await stream.receive_some()
            except trio.BrokenResourceError:
                return received
            if not chunk:
                return received
            received += chunk
