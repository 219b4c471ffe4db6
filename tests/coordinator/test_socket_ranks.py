"""The coordinator over real sockets and over memory:// (each kind read by one shared reader)
behaves the same: same messages to the machine at the same times, the same typed error for
each kind of bad rank, honest ranks served throughout, deaths at once, no fd left open.

Scripted ranks and the coordinator share one trio run under MockClock: unix and tcp sockets
on this host deliver within the send call, so every wait is still inside trio.
"""

from __future__ import annotations

import os
import socket
import struct
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio
from trio.testing import MockClock

from flodl.config import CoordinatorConfig
from flodl.core.coordinator.machine import Status
from flodl.core.coordinator.timeline import EventKind
from flodl.errors import (
    AuthenticationError,
    BrokenChannel,
    FlodlError,
    ProtocolError,
    TruncatedFrame,
    UnknownMessage,
)
from flodl.testing import TEST_KEY, Cluster, RankScript, open_cluster
from flodl.transports import connect
from flodl.transports.socket_stream import SocketStream
from flodl.wire.codec import FrameEncoder
from flodl.wire.handshake import SERVER_HELLO_SIZE, check_server_hello, make_client_hello
from flodl.wire.messages import Batch, Heartbeat, Message, Ready, Shutdown, SyncNow

TRANSPORTS = ("memory", "unix", "tcp")


def address(transport: str, folder: Path) -> str:
    return {
        "memory": f"memory://socket-ranks-{folder.name}",
        "unix": f"unix://{folder}/coordinator.sock",
        "tcp": "tcp://127.0.0.1:0",
    }[transport]


@asynccontextmanager
async def open_cluster_at(
    url: str,
    scripts: Sequence[RankScript],
    *,
    dataset_size: int = 1000,
    batch_size: int = 10,
    config: CoordinatorConfig | None = None,
) -> AsyncIterator[tuple[Cluster, list[tuple[float, int, Message]]]]:
    """flodl.testing.open_cluster at ``url``, with every (now, rank, message) the machine got."""
    seen: list[tuple[float, int, Message]] = []
    async with open_cluster(
        scripts, dataset_size=dataset_size, batch_size=batch_size, config=config, url=url
    ) as cluster:
        machine = cluster.coordinator.machine
        on_message = machine.on_message

        def recording(rank: int, message: Message, now: float) -> list[object]:
            seen.append((now, rank, message))
            return on_message(rank, message, now)  # type: ignore[return-value]

        machine.on_message = recording  # type: ignore[method-assign, assignment]
        yield cluster, seen


async def run_cluster(
    url: str, scripts: Sequence[RankScript], dataset_size: int
) -> tuple[Cluster, list[tuple[float, int, Message]]]:
    async with open_cluster_at(url, scripts, dataset_size=dataset_size) as (cluster, seen):
        await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    return cluster, seen


def rounded(value: object) -> object:
    """``value`` with floats rounded to the nanosecond (the runs start at different clock
    readings, so times since the start differ in the last bits)."""
    if isinstance(value, float):
        return round(value, 9)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v) for v in value]
    return value


def timeline(cluster: Cluster) -> list[str]:
    """The timeline since the start; events of one instant in a canonical order (ranks that
    join at the same instant are admitted in whatever order their connections come)."""
    t0 = cluster.started_at
    events = [
        (round(e.time - t0, 9), e.kind.value, rounded(e.detail))
        for e in cluster.coordinator.timeline
    ]
    return sorted(repr(e) for e in events)


def handled(seen: list[tuple[float, int, Message]], cluster: Cluster, rank: int) -> list[object]:
    """What the machine got from ``rank``: (time since the start, kind, fields), rounded."""
    t0 = cluster.started_at
    return [
        rounded((now - t0, type(m).__name__, attrs.asdict(m))) for now, r, m in seen if r == rank
    ]


async def test_sockets_and_memory_give_the_machine_the_same_run(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    scripts = [
        RankScript(ms_per_batch=10),
        RankScript(ms_per_batch=17),
        RankScript(ms_per_batch=30),
        RankScript(ms_per_batch=10, die_after_batches=25),
    ]
    runs = {t: await run_cluster(address(t, tmp_path), scripts, 3000) for t in TRANSPORTS}
    reference, reference_seen = runs["memory"]
    assert reference.coordinator.machine.outcome.status is Status.COMPLETED
    assert len(reference_seen) > 300  # 300 batch reports, heartbeats, acks...
    for transport in ("unix", "tcp"):
        cluster, seen = runs[transport]
        assert timeline(cluster) == timeline(reference), transport
        # Per rank: the same messages, in the order sent, at the same times.
        for rank in range(len(scripts)):
            assert handled(seen, cluster, rank) == handled(reference_seen, reference, rank)
    (dead,) = [e for e in reference.coordinator.timeline if e.kind is EventKind.RANK_DEAD]
    assert dead.detail["cause"] == "disconnected"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_every_rank_is_read_by_one_shared_reader_and_an_end_is_a_death_at_once(
    autojump_clock: MockClock, tmp_path: Path, transport: str
) -> None:
    url = address(transport, tmp_path)
    async with open_cluster_at(url, with_a_raw_rank_2(), dataset_size=400) as (cluster, seen):
        stream, ready = await raw_ready_rank_2(cluster.url)
        await trio.sleep(0.5)
        readers = list(cluster.coordinator._readers.values())
        assert [reader.channels for reader in readers] == [3]  # one reader, every rank
        assert isinstance(stream, trio.abc.HalfCloseableStream)
        await stream.send_eof()  # a clean end at a frame boundary: no error, dead at once
        ended_at = trio.current_time()
        await trio.testing.wait_all_tasks_blocked()
        assert [reader.channels for reader in readers] == [2]
        outcome = await cluster.coordinator.wait_finished()
        await stream.aclose()
        cluster.ranks[2].kill()
    assert outcome.status is Status.COMPLETED
    assert cluster.coordinator.rank_errors == []
    (dead,) = [e for e in cluster.coordinator.timeline if e.kind is EventKind.RANK_DEAD]
    assert dead.detail["rank"] == 2 and dead.detail["cause"] == "disconnected"
    assert dead.time == ended_at
    assert [m for _, r, m in seen if r == 2] == [ready]


# --- bad ranks --------------------------------------------------------------------------------

RawRank = Callable[[trio.abc.Stream, FrameEncoder], Awaitable[None]]


async def _garbage(stream: trio.abc.Stream, encoder: FrameEncoder) -> None:
    await stream.send_all(b"\x00" * 64)


async def _forged(stream: trio.abc.Stream, encoder: FrameEncoder) -> None:
    frame = bytearray(encoder.encode(Heartbeat(rank=1, step_count=5)))
    frame[-1] ^= 1
    await stream.send_all(bytes(frame))


async def _truncated(stream: trio.abc.Stream, encoder: FrameEncoder) -> None:
    frame = encoder.encode(Heartbeat(rank=1, step_count=5))
    await stream.send_all(frame[: len(frame) // 2])
    assert isinstance(stream, trio.abc.HalfCloseableStream)
    await stream.send_eof()  # (a close with the coordinator's beats unread would be a reset)


async def _wrong_direction(stream: trio.abc.Stream, encoder: FrameEncoder) -> None:
    await stream.send_all(encoder.encode(SyncNow(round=1, generation=0)))


async def _lying(stream: trio.abc.Stream, encoder: FrameEncoder) -> None:
    lie = Batch(rank=0, batch_ms=1.0, data_ms=0.0, step_count=1, batch_loss=0.5)
    await stream.send_all(encoder.encode(lie))


BAD_RANKS: dict[str, tuple[RawRank, type[FlodlError], str]] = {
    "garbage": (_garbage, ProtocolError, "bad frame magic"),
    "forged": (_forged, AuthenticationError, "failed authentication"),
    "truncated": (_truncated, TruncatedFrame, ""),
    "wrong-direction": (_wrong_direction, UnknownMessage, "unknown message tag"),
    "lying": (_lying, ProtocolError, "claiming to be rank 0"),
}


async def raw_rank(url: str, rank: int, world_size: int) -> tuple[trio.abc.Stream, FrameEncoder]:
    """A connection past the handshake, for writing frames by hand."""
    stream = await connect(url)
    hello, state = make_client_hello(TEST_KEY, rank, world_size, None)
    await stream.send_all(hello)
    reply = b""
    while len(reply) < SERVER_HELLO_SIZE:
        chunk = await stream.receive_some(SERVER_HELLO_SIZE - len(reply))
        assert chunk
        reply += chunk
    keys = check_server_hello(reply, state)
    return stream, FrameEncoder(keys.to_coordinator)


def with_a_raw_rank_2() -> list[RankScript]:
    """Ranks 0 and 1 scripted; rank 2's place is taken by :func:`raw_ready_rank_2`."""
    return [RankScript(ms_per_batch=10), RankScript(ms_per_batch=10), RankScript(start_after=1e6)]


async def raw_ready_rank_2(url: str) -> tuple[trio.abc.Stream, Ready]:
    """Rank 2 of 3, joined by hand: past the handshake, its Ready sent; then silent."""
    stream, encoder = await raw_rank(url, 2, 3)
    ready = Ready(rank=2, dataset_size=400, batch_size=10, epochs=1)
    await stream.send_all(encoder.encode(ready))
    return stream, ready


async def hung_up(stream: trio.abc.Stream) -> None:
    """Read until the coordinator hangs up."""
    with trio.fail_after(30):
        while True:
            try:
                if not await stream.receive_some():
                    return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", sorted(BAD_RANKS))
async def test_a_bad_rank_is_dropped_with_its_error_and_honest_ranks_go_on(
    autojump_clock: MockClock, tmp_path: Path, transport: str, case: str
) -> None:
    misbehave, expected, words = BAD_RANKS[case]
    # The bad peer holds rank 1 first, speaks honestly, then misbehaves; the honest rank 1
    # joins after it is gone. Rank 0 trains throughout.
    scripts = [RankScript(ms_per_batch=10), RankScript(ms_per_batch=10, start_after=1.0)]
    url = address(transport, tmp_path)
    async with open_cluster_at(url, scripts, dataset_size=400) as (cluster, seen):
        stream, encoder = await raw_rank(cluster.url, 1, 2)
        await trio.sleep(0.3)
        await stream.send_all(encoder.encode(Heartbeat(rank=1, step_count=1)))
        await trio.sleep(0.1)
        await misbehave(stream, encoder)
        dropped_at = trio.current_time()
        await hung_up(stream)
        await stream.aclose()
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.COMPLETED
    ((rank, error),) = cluster.coordinator.rank_errors
    assert rank == 1 and type(error) is expected and words in str(error)
    impostor = [m for now, r, m in seen if r == 1 and now <= dropped_at]
    assert impostor == [Heartbeat(rank=1, step_count=1)]  # its good frame; nothing bad got in
    # Rank 0 was served before the bad peer misbehaved and after.
    assert any(r == 0 and now < dropped_at for now, r, _ in seen)
    assert any(r == 0 and now > dropped_at for now, r, _ in seen)
    samples = Counter(s for r in cluster.ranks for s in r.record.samples)
    assert len(samples) == 400 and set(samples.values()) == {1}
    assert all(isinstance(r.record.ended_by, Shutdown) for r in cluster.ranks)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_a_reset_connection_is_a_death_at_once(
    autojump_clock: MockClock, tmp_path: Path, transport: str
) -> None:
    url = address(transport, tmp_path)
    async with open_cluster_at(url, with_a_raw_rank_2(), dataset_size=400) as (cluster, _):
        stream, _ = await raw_ready_rank_2(cluster.url)
        assert isinstance(stream, SocketStream)
        await trio.sleep(2.0)  # what the coordinator sends it stays unread
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()  # closed with unread data: the coordinator's side is reset
        reset_at = trio.current_time() - cluster.started_at
        outcome = await cluster.coordinator.wait_finished()
        cluster.ranks[2].kill()
    assert outcome.status is Status.COMPLETED
    ((rank, error),) = cluster.coordinator.rank_errors
    assert rank == 2 and isinstance(error, BrokenChannel)
    (dead,) = [e for e in cluster.coordinator.timeline if e.kind is EventKind.RANK_DEAD]
    assert dead.detail["rank"] == 2 and dead.detail["cause"] == "disconnected"
    assert dead.time - cluster.started_at == reset_at


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_closing_or_cancelling_the_coordinator_leaks_no_fd(
    autojump_clock: MockClock, tmp_path: Path, transport: str
) -> None:
    before = open_fds()
    scripts = [RankScript(ms_per_batch=10) for _ in range(4)]
    (tmp_path / "a").mkdir()
    await run_cluster(address(transport, tmp_path / "a"), scripts, 400)  # to completion
    assert open_fds() == before
    (tmp_path / "b").mkdir()
    with trio.move_on_after(0.5):  # cancelled mid-run, every rank connected
        async with open_cluster_at(address(transport, tmp_path / "b"), scripts, dataset_size=10**6):
            await trio.sleep_forever()
    assert open_fds() == before
