"""A rank the coordinator lets go hears why: Abort(reason) reaches it before its connection
closes (a Disconnect effect, a run that could not start). Scripted ranks and a hand-driven one
over a unix socket, under MockClock."""

from __future__ import annotations

from pathlib import Path

import trio
from trio.testing import MockClock

from flodl.core.coordinator.machine import Status
from flodl.core.rank.state import RankState
from flodl.testing import TEST_KEY, RankScript, open_cluster
from flodl.transports import connect
from flodl.wire.codec import FrameDecoder, FrameEncoder
from flodl.wire.handshake import SERVER_HELLO_SIZE, check_server_hello, make_client_hello
from flodl.wire.messages import TO_RANK_TAGS, Abort, Message, Ready


async def _frames_until_hung_up(stream: trio.abc.Stream, decoder: FrameDecoder) -> list[Message]:
    received: list[Message] = []
    with trio.fail_after(30):
        while True:
            try:
                chunk = await stream.receive_some()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return received
            if not chunk:
                return received
            decoder.feed(chunk)
            received.extend(decoder)


WHY = "ranks [1] did not join within the join timeout (300 s); 1 joined, fewer than min_ranks 2"


async def test_a_refused_rank_gets_abort_with_the_reason_before_the_close(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    # Rank 0 is scripted; rank 1's place is taken by a hand-driven peer that describes another
    # job (batch size 5, not 10).
    scripts = [RankScript(ms_per_batch=10), RankScript(start_after=1e6)]
    url = f"unix://{tmp_path}/coordinator.sock"
    async with open_cluster(scripts, dataset_size=400, batch_size=10, url=url) as cluster:
        await trio.sleep(0.5)  # rank 0 said Ready: the run's job is its job
        stream = await connect(cluster.url)
        hello, state = make_client_hello(TEST_KEY, 1, 2, None)
        await stream.send_all(hello)
        reply = b""
        while len(reply) < SERVER_HELLO_SIZE:
            reply += await stream.receive_some(SERVER_HELLO_SIZE - len(reply))
        keys = check_server_hello(reply, state)
        encoder = FrameEncoder(keys.to_coordinator)
        ready = Ready(rank=1, dataset_size=400, batch_size=5, epochs=1)
        await stream.send_all(encoder.encode(ready))
        received = await _frames_until_hung_up(
            stream, FrameDecoder(keys.to_rank, allowed_tags=TO_RANK_TAGS)
        )
        await stream.aclose()
        aborts = [m for m in received if isinstance(m, Abort)]
        assert len(aborts) == 1 and received[-1] == aborts[0], received
        assert aborts[0].reason.startswith("rank 1 describes job Job(")
        assert "batch_size=5" in aborts[0].reason
        # Rank 1 is not coming back: at the join deadline the run fails, and rank 0 is told.
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert (outcome.status, outcome.message) == (Status.FAILED, WHY)
    rank0 = cluster.ranks[0]
    assert Abort(reason=WHY) in rank0.record.received
    assert rank0.machine.life.state is RankState.ABORTED
    assert rank0.machine.tallies()["exit_reason"] == "aborted: " + WHY
