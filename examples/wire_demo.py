"""The flodl wire in action: a coordinator, three ranks of unequal speed, and one impostor.

The coordinator admits ranks with ``serve_ranks`` on ``tcp://127.0.0.1:0``. Each rank runs
"batches" (sleeps of 2, 4 and 6 ms), reports every one as a ``Batch``, sends a ``Heartbeat``
every 100 ms, and answers each ``SyncNow`` with a ``SyncAck``. The coordinator asks for a sync
every 25 batches of a rank and times the round trip. An impostor holding the wrong session key
tries to join and is turned away. Every frame is authenticated with HMAC-SHA256.

Run: ``python examples/wire_demo.py [--seconds 2]``. Exit status 0 when every rank exchanged
messages and the impostor was refused.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
from collections import Counter

import attrs
import trio

from flodl.coordinator.admission import serve_ranks
from flodl.errors import WrongKey
from flodl.transports import connect, open_listener
from flodl.transports.channel import Channel
from flodl.transports.greeting import connect_rank
from flodl.wire.messages import (
    Batch,
    CoordHeartbeat,
    Exiting,
    Heartbeat,
    Message,
    SyncAck,
    SyncNow,
)

WORLD = 3
HEARTBEAT_EVERY = 0.1
SYNC_EVERY = 25


@attrs.define
class RankStats:
    """What the coordinator saw of one rank."""

    received: Counter[str] = attrs.field(factory=Counter)
    sent: Counter[str] = attrs.field(factory=Counter)
    sync_rtts: list[float] = attrs.field(factory=list)


@attrs.define
class Coordinator:
    """A toy coordinator: counts traffic and times SyncNow -> SyncAck round trips."""

    stats: dict[int, RankStats] = attrs.field(factory=dict)
    refused: list[str] = attrs.field(factory=list)
    finished: set[int] = attrs.field(factory=set)
    all_finished: trio.Event = attrs.field(factory=trio.Event)
    someone_refused: trio.Event = attrs.field(factory=trio.Event)

    async def serve(self, rank: int, channel: Channel) -> None:
        stats = self.stats[rank] = RankStats()
        pending: dict[int, float] = {}
        next_round = 0

        async def send(message: Message) -> None:
            await channel.send(message)
            stats.sent[type(message).__name__] += 1

        async def heartbeat() -> None:
            while True:
                await send(CoordHeartbeat())
                await trio.sleep(HEARTBEAT_EVERY)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(heartbeat)
            async for message in channel:
                stats.received[type(message).__name__] += 1
                if isinstance(message, Batch) and message.step_count % SYNC_EVERY == 0:
                    pending[next_round] = trio.current_time()
                    await send(SyncNow(round=next_round, generation=0))
                    next_round += 1
                elif isinstance(message, SyncAck) and message.round in pending:
                    stats.sync_rtts.append(trio.current_time() - pending.pop(message.round))
                elif isinstance(message, Exiting):
                    break
            nursery.cancel_scope.cancel()
        self.finished.add(rank)
        if len(self.finished) == WORLD:
            self.all_finished.set()

    def on_rank_error(self, rank: int | None, error: BaseException) -> None:
        who = "an unnamed connection" if rank is None else f"rank {rank}"
        self.refused.append(f"{type(error).__name__} from {who}")
        self.someone_refused.set()


async def run_rank(url: str, key: bytes, rank: int, seconds: float) -> int:
    """One rank: batches at its own speed, heartbeats, sync acks. Returns batches run.

    The helper tasks are never cancelled in the middle of a send (that would leave half a
    frame on the wire and poison the channel): they stop once ``done`` is set, and the
    receiving task ends when the coordinator closes the connection after ``Exiting``.
    """
    channel = await connect_rank(await connect(url), key, rank, WORLD)
    steps = 0
    done = trio.Event()
    async with channel, trio.open_nursery() as nursery:

        async def heartbeat() -> None:
            while not done.is_set():
                await channel.send(Heartbeat(rank=rank, step_count=steps))
                with trio.move_on_after(HEARTBEAT_EVERY):
                    await done.wait()

        async def answer_syncs() -> None:
            async for message in channel:
                if isinstance(message, SyncNow) and not done.is_set():
                    await channel.send(SyncAck(rank=rank, round=message.round, step_count=steps))

        nursery.start_soon(heartbeat)
        nursery.start_soon(answer_syncs)
        batch_seconds = 0.002 * (rank + 1)  # unequal speeds: 2, 4, 6 ms per batch
        deadline = trio.current_time() + seconds
        while trio.current_time() < deadline:
            started = trio.current_time()
            await trio.sleep(batch_seconds)
            steps += 1
            elapsed_ms = (trio.current_time() - started) * 1000
            await channel.send(
                Batch(
                    rank=rank,
                    batch_ms=elapsed_ms,
                    data_ms=0.0,
                    step_count=steps,
                    batch_loss=1.0 / steps,
                )
            )
        done.set()
        await channel.send(Exiting(rank=rank))
    return steps


async def run_impostor(url: str) -> str:
    """Try to join with a key of our own; how it ended."""
    async with await connect(url) as stream:
        try:
            await connect_rank(stream, secrets.token_bytes(32), 0, WORLD)
        except WrongKey as err:
            return f"rejected ({type(err).__name__}: {err})"
    return "ADMITTED (this is a bug)"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:6.2f}"


async def main(seconds: float) -> int:
    key = secrets.token_bytes(32)
    coordinator = Coordinator()
    async with await open_listener("tcp://127.0.0.1:0") as listener:
        async with trio.open_nursery() as nursery:
            await nursery.start(
                lambda task_status: serve_ranks(
                    listener,
                    key,
                    WORLD,
                    coordinator.serve,
                    on_rank_error=coordinator.on_rank_error,
                    task_status=task_status,
                )
            )
            print(f"coordinator listening on {listener.url}; {WORLD} ranks for {seconds:g} s")
            batches: dict[int, int] = {}

            async def rank_task(rank: int) -> None:
                batches[rank] = await run_rank(listener.url, key, rank, seconds)

            async with trio.open_nursery() as ranks:
                for rank in range(WORLD):
                    ranks.start_soon(rank_task, rank)
                impostor = await run_impostor(listener.url)
            with trio.fail_after(5):  # let the coordinator finish its books
                await coordinator.all_finished.wait()
                await coordinator.someone_refused.wait()
            nursery.cancel_scope.cancel()

    header = f"{'rank':>4} {'batches':>7} {'rank->coord':>11} {'coord->rank':>11} {'syncs':>5}"
    print(header + "  sync round trip ms (median / max)")
    ok = True
    for rank in range(WORLD):
        stats = coordinator.stats.get(rank, RankStats())
        rtts = stats.sync_rtts
        timing = f"{ms(statistics.median(rtts))} / {ms(max(rtts))}" if rtts else "  (none)"
        print(
            f"{rank:>4} {batches.get(rank, 0):>7} {sum(stats.received.values()):>11} "
            f"{sum(stats.sent.values()):>11} {len(rtts):>5}  {timing}"
        )
        ok = ok and stats.received["Batch"] > 0 and stats.received["Heartbeat"] > 0
    print(f"impostor with a wrong key: {impostor}")
    print(f"coordinator dropped: {', '.join(coordinator.refused) or 'nothing'}")
    ok = (
        ok
        and impostor.startswith("rejected")
        and coordinator.refused == ["WrongKey from an unnamed connection"]
    )
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="how long the ranks train")
    args = parser.parse_args()
    sys.exit(trio.run(main, args.seconds))
