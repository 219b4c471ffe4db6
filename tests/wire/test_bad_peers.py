"""Hostile or confused peers are dropped with the exact error; an honest rank never notices.

Each case runs against one echoing serve_ranks over real TCP on 127.0.0.1: an honest rank 0
exchanges messages, the bad peer does its thing, the server must report exactly the expected
error type (and rank), hang up on the bad peer, and keep serving rank 0.
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Awaitable, Callable

import cbor2
import pytest
import trio

from flodl.errors import (
    AuthenticationError,
    DuplicateRank,
    FrameTooLarge,
    HandshakeError,
    HandshakeVersionMismatch,
    MessageValidationError,
    ProtocolError,
    RankOutOfRange,
    ReplayedHello,
    SequenceError,
    SignatureMismatch,
    TruncatedFrame,
    UnknownMessage,
    WorldSizeMismatch,
    WrongKey,
)
from flodl.transports.greeting import connect_rank
from flodl.wire import handshake as hs
from flodl.wire.codec import PROTOCOL_VERSION, FrameDecoder, FrameEncoder
from flodl.wire.handshake import SERVER_HELLO_SIZE, HelloStatus
from flodl.wire.messages import Heartbeat, SyncNow
from tests.wire.peers import (
    KEY,
    OTHER_KEY,
    SIGNATURE,
    WORLD,
    EchoServer,
    echo_server,
    exchange,
    expect_dropped,
    raw_frame,
    raw_handshake,
    receive_exactly,
)

BadPeer = Callable[[EchoServer, trio.abc.Stream], Awaitable[None]]
HEARTBEAT = 66  # Heartbeat.TAG


def heartbeat(step: int) -> Heartbeat:
    return Heartbeat(rank=1, step_count=step)


async def truncated_frame(server: EchoServer, stream: trio.abc.Stream) -> None:
    keys = await raw_handshake(stream, 1)
    frame = FrameEncoder(keys.to_coordinator).encode(heartbeat(1))
    await stream.send_all(frame[:-5])
    assert isinstance(stream, trio.abc.HalfCloseableStream)
    await stream.send_eof()


async def flipped_payload_bit(server: EchoServer, stream: trio.abc.Stream) -> None:
    keys = await raw_handshake(stream, 1)
    frame = bytearray(FrameEncoder(keys.to_coordinator).encode(heartbeat(1)))
    frame[-1] ^= 0x01
    await stream.send_all(frame)


async def forged_mac(server: EchoServer, stream: trio.abc.Stream) -> None:
    keys = await raw_handshake(stream, 1)
    frame = FrameEncoder(keys.to_coordinator).encode(heartbeat(1))
    await stream.send_all(frame[:20] + bytes(32) + frame[52:])


async def wrong_key(server: EchoServer, stream: trio.abc.Stream) -> None:
    with pytest.raises(WrongKey):
        await connect_rank(stream, OTHER_KEY, 1, WORLD, SIGNATURE)


async def replayed_frame(server: EchoServer, stream: trio.abc.Stream) -> None:
    keys = await raw_handshake(stream, 1)
    frame = FrameEncoder(keys.to_coordinator).encode(heartbeat(1))
    await stream.send_all(frame)
    await stream.send_all(frame)


async def reordered_frames(server: EchoServer, stream: trio.abc.Stream) -> None:
    keys = await raw_handshake(stream, 1)
    encoder = FrameEncoder(keys.to_coordinator)
    first, second = encoder.encode(heartbeat(1)), encoder.encode(heartbeat(2))
    await stream.send_all(second + first)


async def oversized_length(server: EchoServer, stream: trio.abc.Stream) -> None:
    keys = await raw_handshake(stream, 1)
    await stream.send_all(raw_frame(keys.to_coordinator, HEARTBEAT, b"", 0, length=2**31))


async def garbage_cbor(server: EchoServer, stream: trio.abc.Stream) -> None:
    keys = await raw_handshake(stream, 1)
    await stream.send_all(raw_frame(keys.to_coordinator, HEARTBEAT, b"\xff\x00junk", 0))


async def deeply_nested_cbor(server: EchoServer, stream: trio.abc.Stream) -> None:
    keys = await raw_handshake(stream, 1)
    payload = b"\x81" * 200 + b"\x00"  # [[[[...0...]]]], 200 levels
    await stream.send_all(raw_frame(keys.to_coordinator, HEARTBEAT, payload, 0))


async def unknown_tag(server: EchoServer, stream: trio.abc.Stream) -> None:
    keys = await raw_handshake(stream, 1)
    await stream.send_all(raw_frame(keys.to_coordinator, 120, cbor2.dumps({}), 0))


async def wrong_field_type(server: EchoServer, stream: trio.abc.Stream) -> None:
    keys = await raw_handshake(stream, 1)
    payload = cbor2.dumps({"rank": 1, "step_count": "seven"})
    await stream.send_all(raw_frame(keys.to_coordinator, HEARTBEAT, payload, 0))


async def wrong_direction(server: EchoServer, stream: trio.abc.Stream) -> None:
    keys = await raw_handshake(stream, 1)
    frame = FrameEncoder(keys.to_coordinator).encode(SyncNow(round=1, generation=0))
    await stream.send_all(frame)


async def wrong_version(server: EchoServer, stream: trio.abc.Stream) -> None:
    body = struct.pack("<IHHII", hs.CLIENT_HELLO_MAGIC, PROTOCOL_VERSION + 1, 0, 1, WORLD)
    await stream.send_all(body + SIGNATURE + bytes(32))
    reply = await receive_exactly(stream, SERVER_HELLO_SIZE)
    status = struct.unpack_from("<IHH", reply)[2]
    assert status == HelloStatus.VERSION_MISMATCH


async def world_size_mismatch(server: EchoServer, stream: trio.abc.Stream) -> None:
    with pytest.raises(WorldSizeMismatch, match=f"coordinator's {WORLD}"):
        await connect_rank(stream, KEY, 1, WORLD + 2, SIGNATURE)


async def rank_out_of_range(server: EchoServer, stream: trio.abc.Stream) -> None:
    with pytest.raises(RankOutOfRange):
        await connect_rank(stream, KEY, WORLD, WORLD, SIGNATURE)


async def duplicate_rank(server: EchoServer, stream: trio.abc.Stream) -> None:
    with pytest.raises(DuplicateRank):
        await connect_rank(stream, KEY, 0, WORLD, SIGNATURE)  # the honest rank holds 0


async def signature_mismatch(server: EchoServer, stream: trio.abc.Stream) -> None:
    with pytest.raises(SignatureMismatch):
        await connect_rank(stream, KEY, 1, WORLD, bytes(range(1, 33)))


async def http_get(server: EchoServer, stream: trio.abc.Stream) -> None:
    await stream.send_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert await expect_dropped(stream) == b""  # no reply to a stranger


CASES: list[tuple[BadPeer, type[BaseException], int | None]] = [
    (truncated_frame, TruncatedFrame, 1),
    (flipped_payload_bit, AuthenticationError, 1),
    (forged_mac, AuthenticationError, 1),
    (wrong_key, WrongKey, None),
    (replayed_frame, SequenceError, 1),
    (reordered_frames, SequenceError, 1),
    (oversized_length, FrameTooLarge, 1),
    (garbage_cbor, ProtocolError, 1),
    (deeply_nested_cbor, ProtocolError, 1),
    (unknown_tag, UnknownMessage, 1),
    (wrong_field_type, MessageValidationError, 1),
    (wrong_direction, UnknownMessage, 1),
    (wrong_version, HandshakeVersionMismatch, None),
    (world_size_mismatch, WorldSizeMismatch, None),
    (rank_out_of_range, RankOutOfRange, None),
    (duplicate_rank, DuplicateRank, None),
    (signature_mismatch, SignatureMismatch, None),
    (http_get, ProtocolError, None),
]


@pytest.mark.parametrize(
    ("bad_peer", "error", "reported_rank"), CASES, ids=[c[0].__name__ for c in CASES]
)
async def test_bad_peer_is_dropped_with_exact_error_and_honest_rank_carries_on(
    bad_peer: BadPeer, error: type[BaseException], reported_rank: int | None
) -> None:
    async with echo_server() as server, await server.join(0) as honest:
        await exchange(honest, 0, 1)
        async with await server.connect() as stream:
            await bad_peer(server, stream)
            rank, reported = await server.next_error()
            assert type(reported) is error, repr(reported)
            assert rank == reported_rank
            await expect_dropped(stream)
        for step in range(2, 5):
            await exchange(honest, 0, step)
        # The server still admits newcomers, including the bad peer's rank.
        async with await server.join(1) as newcomer:
            await exchange(newcomer, 1, 9)


async def test_oversized_frame_is_refused_without_buffering_it() -> None:
    announced = 2**31
    junk = bytes(256 * 1024)
    async with (
        echo_server() as server,
        await server.join(0) as honest,
        await server.connect() as stream,
    ):
        keys = await raw_handshake(stream, 1)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            await stream.send_all(raw_frame(keys.to_coordinator, HEARTBEAT, b"", 0, announced))
            try:
                for _ in range(8):  # 2 MiB of "payload" after the header
                    await stream.send_all(junk)
            except trio.BrokenResourceError:
                pass  # the server hung up mid-flood: expected
            rank, reported = await server.next_error()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert type(reported) is FrameTooLarge and rank == 1
        assert peak < 2 * 1024 * 1024 < announced // 1000
        await expect_dropped(stream)
        await exchange(honest, 0, 1)


async def test_recorded_session_replayed_into_a_new_one_is_rejected() -> None:
    async with echo_server() as server, await server.join(0) as honest:
        # Record every byte a genuine rank 1 sends in a whole session.
        async with await server.connect() as stream:
            hello, state = hs.make_client_hello(KEY, 1, WORLD, SIGNATURE)
            await stream.send_all(hello)
            keys = hs.check_server_hello(await receive_exactly(stream, SERVER_HELLO_SIZE), state)
            encoder = FrameEncoder(keys.to_coordinator)
            frames = encoder.encode(heartbeat(5)) + encoder.encode(heartbeat(6))
            await stream.send_all(frames)
            answers = FrameDecoder(keys.to_rank)
            answers.feed(await expect_dropped_after_eof(stream))
            assert [m.round for m in answers if isinstance(m, SyncNow)] == [5, 6]
        assert await server.next_finished() == 1
        # Replay the hello verbatim: its nonce is spent, so it is refused unanswered and
        # holds no rank id (the genuine rank 1 can come back at once).
        async with await server.connect() as replay:
            await replay.send_all(hello + frames)
            rank, reported = await server.next_error()
            assert type(reported) is ReplayedHello and rank is None
            assert await expect_dropped(replay) == b""
        async with await server.join(1) as genuine:
            await exchange(genuine, 1, 1)
        await exchange(honest, 0, 1)


async def test_a_recorded_session_fails_in_a_coordinator_that_never_saw_its_hello() -> None:
    # A fresh coordinator (same key) has no record of the nonce: the hello verifies, but the
    # session's keys are mixed from a new server nonce, so the recorded frames fail.
    async with echo_server() as first:
        async with await first.connect() as stream:
            hello, state = hs.make_client_hello(KEY, 1, WORLD, SIGNATURE)
            await stream.send_all(hello)
            keys = hs.check_server_hello(await receive_exactly(stream, SERVER_HELLO_SIZE), state)
            frames = FrameEncoder(keys.to_coordinator).encode(heartbeat(5))
            await stream.send_all(frames)
    async with echo_server() as server, await server.join(0) as honest:
        async with await server.connect() as replay:
            await replay.send_all(hello)
            reply = await receive_exactly(replay, SERVER_HELLO_SIZE)
            assert struct.unpack_from("<IHH", reply)[2] == HelloStatus.ACCEPTED
            await replay.send_all(frames)
            rank, reported = await server.next_error()
            assert type(reported) is AuthenticationError and rank == 1
            assert await expect_dropped(replay) == b""
        await exchange(honest, 0, 1)


async def expect_dropped_after_eof(stream: trio.abc.Stream) -> bytes:
    """Half-close, then everything the server sends until it closes too."""
    assert isinstance(stream, trio.abc.HalfCloseableStream)
    await stream.send_eof()
    return await expect_dropped(stream)


async def test_peer_that_hangs_up_mid_hello_is_reported() -> None:
    async with echo_server() as server:
        async with await server.connect() as stream:
            hello, _ = hs.make_client_hello(KEY, 1, WORLD, SIGNATURE)
            await stream.send_all(hello[:50])
        rank, reported = await server.next_error()
        assert type(reported) is HandshakeError and rank is None
        assert "(50 of 112 bytes of its hello)" in str(reported)
