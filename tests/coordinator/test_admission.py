"""serve_ranks: handshake deadlines, rank uniqueness, isolation of failures, clean shutdown."""

from __future__ import annotations

import logging
import uuid

import pytest
import trio
import trio.testing

from flodl.coordinator.admission import AcceptsStreams, serve_ranks
from flodl.errors import BrokenChannel, ConfigError, DuplicateRank, HandshakeTimeout, WrongKey
from flodl.transports import connect, open_listener
from flodl.transports.channel import Channel
from flodl.transports.greeting import connect_rank
from flodl.wire import handshake as hs
from tests.wire.peers import (
    KEY,
    OTHER_KEY,
    SIGNATURE,
    WORLD,
    echo_server,
    exchange,
    expect_dropped,
)


def memory_url() -> str:
    return f"memory://admission-{uuid.uuid4().hex[:12]}"


async def test_silent_clients_are_dropped_at_the_deadline_while_others_are_admitted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with (
        echo_server(memory_url(), handshake_timeout=3.0) as server,
        await server.join(0) as honest,
    ):
        start = trio.current_time()
        async with await server.connect() as silent, await server.connect() as partial:
            hello, _ = hs.make_client_hello(KEY, 2, WORLD, SIGNATURE)
            await partial.send_all(hello[:50])
            await trio.sleep(2.0)
            # The two stalled handshakes block nobody: a newcomer gets in at once.
            async with await server.join(1) as newcomer:
                await exchange(newcomer, 1, 1)
            assert trio.current_time() - start == pytest.approx(2.0)
            reports = [await server.next_error(), await server.next_error()]
            assert trio.current_time() - start == pytest.approx(3.0)
            assert [type(err) for _, err in reports] == [HandshakeTimeout, HandshakeTimeout]
            assert [rank for rank, _ in reports] == [None, None]
            assert "within 3.0 s" in str(reports[0][1])
            assert await expect_dropped(silent) == b""
            assert await expect_dropped(partial) == b""
        await exchange(honest, 0, 2)
        assert trio.current_time() - start == pytest.approx(3.0)


async def test_two_connections_racing_for_one_rank_admit_exactly_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with echo_server(memory_url()) as server:
        outcomes: list[Channel | BaseException] = []

        async def claim_rank_1() -> None:
            try:
                outcomes.append(await server.join(1))
            except DuplicateRank as err:
                outcomes.append(err)

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(claim_rank_1)
        channels = [o for o in outcomes if isinstance(o, Channel)]
        assert len(channels) == 1
        assert sum(isinstance(o, DuplicateRank) for o in outcomes) == 3
        for _ in range(3):
            rank, err = await server.next_error()
            assert type(err) is DuplicateRank and rank is None
        await exchange(channels[0], 1, 7)
        await channels[0].aclose()


async def test_rank_is_free_again_once_its_handler_returns() -> None:
    async with echo_server() as server:
        async with await server.join(2) as first:
            await exchange(first, 2, 1)
        assert await server.next_finished() == 2
        async with await server.join(2) as second:
            await exchange(second, 2, 2)


async def test_handler_bug_propagates_and_stops_serving() -> None:
    async def buggy(rank: int, channel: Channel) -> None:
        raise RuntimeError(f"bug while serving rank {rank}")

    async with await open_listener(memory_url()) as listener:
        with pytest.RaisesGroup(RuntimeError, flatten_subgroups=True):
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_ranks, listener, KEY, WORLD, buggy)
                stream = await connect(listener.url)
                async with stream:
                    await connect_rank(stream, KEY, 0, WORLD)
                    await trio.sleep_forever()


async def test_closed_listener_ends_accepting_after_admitted_ranks_finish() -> None:
    served: list[int] = []
    returned = trio.Event()

    async def handler(rank: int, channel: Channel) -> None:
        async for _ in channel:
            pass
        served.append(rank)

    async def run(listener: AcceptsStreams, task_status: trio.TaskStatus[None]) -> None:
        await serve_ranks(listener, KEY, WORLD, handler, task_status=task_status)
        returned.set()

    listener = await open_listener(memory_url())
    async with trio.open_nursery() as nursery:
        await nursery.start(run, listener)
        channel = await connect_rank(await connect(listener.url), KEY, 1, WORLD)
        await listener.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert not returned.is_set()  # rank 1 is still being served
        await channel.aclose()
        with trio.fail_after(5):
            await returned.wait()
    assert served == [1]


async def test_cancelling_serve_ranks_closes_every_stream() -> None:
    async with await open_listener(memory_url()) as listener:
        async with trio.open_nursery() as nursery:

            async def handler(rank: int, channel: Channel) -> None:
                await trio.sleep_forever()

            await nursery.start(serve_ranks, listener, KEY, WORLD, handler)
            admitted = await connect(listener.url)
            await connect_rank(admitted, KEY, 0, WORLD)
            silent = await connect(listener.url)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        async with admitted, silent:
            assert await expect_dropped(admitted) == b""
            assert await expect_dropped(silent) == b""


async def test_errors_are_logged_when_no_callback_is_given(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with await open_listener(memory_url()) as listener, trio.open_nursery() as nursery:

        async def handler(rank: int, channel: Channel) -> None:
            pass

        await nursery.start(serve_ranks, listener, KEY, WORLD, handler)
        with caplog.at_level(logging.WARNING, logger="flodl.coordinator.admission"):
            async with await connect(listener.url) as stream:
                with pytest.raises(WrongKey):
                    await connect_rank(stream, OTHER_KEY, 0, WORLD)
                await expect_dropped(stream)
        nursery.cancel_scope.cancel()
    assert "dropped a connection: WrongKey" in caplog.text


@pytest.mark.parametrize(
    ("key", "timeout", "signature"),
    [(b"short", 1.0, None), (KEY, 0.0, None), (KEY, 1.0, b"not 32 bytes")],
)
async def test_bad_settings_are_config_errors(
    key: bytes, timeout: float, signature: bytes | None
) -> None:
    async def handler(rank: int, channel: Channel) -> None:
        pass

    async with await open_listener(memory_url()) as listener:
        with pytest.raises(ConfigError):
            await serve_ranks(
                listener, key, WORLD, handler, handshake_timeout=timeout, signature=signature
            )


async def test_handler_nursery_groups_of_connection_errors_stay_per_connection() -> None:
    errors: list[tuple[int | None, BaseException]] = []

    async def handler(rank: int, channel: Channel) -> None:
        async with trio.open_nursery() as nursery:  # errors come out wrapped in a group
            nursery.start_soon(channel.receive)
            await trio.testing.wait_all_tasks_blocked()
            raise BrokenChannel(f"rank {rank} went away")

    async with await open_listener(memory_url()) as listener, trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: serve_ranks(
                listener,
                KEY,
                WORLD,
                handler,
                on_rank_error=lambda rank, err: errors.append((rank, err)),
                task_status=task_status,
            )
        )
        for rank in (0, 1):
            async with await connect(listener.url) as stream:
                await connect_rank(stream, KEY, rank, WORLD)
                assert await expect_dropped(stream) == b""
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert [(rank, type(err)) for rank, err in errors] == [(0, BrokenChannel), (1, BrokenChannel)]
    assert str(errors[1][1]) == "rank 1 went away"
