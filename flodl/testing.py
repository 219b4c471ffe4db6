"""Test and simulation helpers: a real coordinator with scripted ranks, all in one trio run.

:func:`open_cluster` starts a real :func:`~flodl.coordinator.open_coordinator` on a
``memory://`` address and ``len(scripts)`` :class:`ScriptedRank` tasks that speak the real wire
protocol to it. Each rank follows its :class:`RankScript`: how long a batch takes, when it dies,
falls silent or hangs. Averaging is simulated by :class:`SimulatedGroup`, which behaves like a
gloo group: a collective completes when every member has entered it, and a member that died
leaves the others blocked until the coordinator's DeclareDead tells them to abandon it.

Everything waits on trio's clock, so under ``trio.testing.MockClock(autojump_threshold=0)`` a
run of minutes of simulated training takes milliseconds and is deterministic::

    async with open_cluster([RankScript(ms_per_batch=10), RankScript(ms_per_batch=25)],
                            dataset_size=2000, batch_size=10, epochs=2) as cluster:
        outcome = await cluster.coordinator.wait_finished()
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from flodl.config import CoordinatorConfig
from flodl.coordinator import Coordinator, open_coordinator
from flodl.errors import ChannelClosed, FlodlError
from flodl.transports import connect
from flodl.transports.channel import Channel, connect_rank
from flodl.wire.messages import (
    Batch,
    CoordHeartbeat,
    DeclareDead,
    EpochAggregated,
    ExtendPartition,
    Heartbeat,
    Message,
    Metrics,
    NewGroupReady,
    NewGroupSession,
    Ready,
    RequestNewGroup,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
)

_names = itertools.count()

TEST_KEY = b"flodl-testing-key-0123456789abcdef"
"""The session key :func:`open_cluster` uses unless given another."""


@attrs.define
class RankScript:
    """How one scripted rank behaves. Times are in trio seconds (milliseconds where named)."""

    ms_per_batch: float = 10.0
    ms_per_batch_after: tuple[int, float] | None = None
    """``(n, ms)``: from its ``n``-th batch on, the rank's batches take ``ms`` (a speed change,
    as when another job starts sharing the machine)."""
    data_ms: float = 0.0
    collective_ms: float = 1.0
    die_after_batches: int | None = None
    """Close the connection abruptly (like a crash) after this many batches."""
    silent_after_batches: int | None = None
    """Stop sending anything (heartbeats included) but keep the connection open."""
    hang_collectives: bool = False
    """Enter collectives but never finish them (a hung peer that stays alive)."""
    heartbeat_interval: float = 1.0
    rejoin_after: float | None = None
    """After a scripted crash, reconnect as the same rank after this many seconds (a restart)."""
    start_after: float = 0.0
    """Seconds to wait before connecting (e.g. to let another client take the rank first)."""
    skip_completion_frames: bool = False
    """Never send the per-chunk Metrics (the coordinator's window wait then hits its ceiling)."""
    ignore_group_requests: bool = False
    """Never answer RequestNewGroup (a silent generator)."""
    die_on_group_request: bool = False
    """Crash when asked to generate a group."""


@attrs.define
class RankRecord:
    """What a scripted rank observed, for assertions."""

    batches: int = 0
    syncs: int = 0
    idle_s: float = 0.0
    busy_s: float = 0.0
    received: list[Message] = attrs.field(factory=list)
    samples: list[tuple[int, int]] = attrs.field(factory=list)
    """(epoch, position in the epoch order) of every sample trained."""
    ended_by: Message | None = None
    abandoned: int = 0
    beats: list[float] = attrs.field(factory=list)
    """Trio times at which a CoordHeartbeat arrived."""

    def count(self, kind: type[Message]) -> int:
        return sum(1 for m in self.received if isinstance(m, kind))


class SimulatedGroup:
    """Collectives among the members of one group generation, gloo-like.

    ``enter(rank)`` returns when every member has entered the current collective; nobody can
    finish without everyone, so a dead member blocks the others until they give up.
    """

    def __init__(self, generation: int, size: int) -> None:
        self.generation = generation
        self.size = size
        self._arrived: dict[int, set[int]] = {}
        self._done: dict[int, trio.Event] = {}

    async def enter(self, round_: int, rank: int) -> None:
        arrived = self._arrived.setdefault(round_, set())
        done = self._done.setdefault(round_, trio.Event())
        arrived.add(rank)
        if len(arrived) >= self.size:
            done.set()
        await done.wait()


class _Groups:
    """Generation -> SimulatedGroup, shared by the scripted ranks of one cluster."""

    def __init__(self) -> None:
        self._groups: dict[int, SimulatedGroup] = {}

    def get(self, generation: int, size: int) -> SimulatedGroup:
        group = self._groups.get(generation)
        if group is None:
            group = self._groups[generation] = SimulatedGroup(generation, size)
        return group


class ScriptedRank:
    """A rank that follows a :class:`RankScript` over a real Channel."""

    def __init__(self, rank: int, world_size: int, script: RankScript, groups: _Groups) -> None:
        self.rank = rank
        self.world_size = world_size
        self.script = script
        self.record = RankRecord()
        self.lives = 0
        """How many times this rank connected (2 after a rejoin)."""
        self._groups = groups
        self._reset()

    def _reset(self) -> None:
        """Fresh process state: no work, no group, step count 0."""
        self._work: deque[tuple[int, int, int]] = deque()  # (epoch, offset, size)
        self._inbox_send, self._inbox = trio.open_memory_channel[Message](math.inf)
        self._step_count = 0
        self._group: SimulatedGroup | None = None
        self._silent = False
        self._throttled = False
        self._batch_size = 1
        self._abandon: trio.CancelScope | None = None
        self.cancel_scope = trio.CancelScope()

    async def run(
        self, url: str, key: bytes, dataset_size: int, batch_size: int, epochs: int
    ) -> None:
        """Connect, train as told, return when shut down (or killed by the script).

        With ``rejoin_after`` set, a rank killed by its script comes back once, as a restarted
        process would: fresh state, same rank id, no scripted crash the second time.
        """
        await trio.sleep(self.script.start_after)
        await self._live(url, key, dataset_size, batch_size, epochs)
        if self.cancel_scope.cancel_called and self.script.rejoin_after is not None:
            await trio.sleep(self.script.rejoin_after)
            self.script = attrs.evolve(self.script, die_after_batches=None, rejoin_after=None)
            self._reset()
            await self._live(url, key, dataset_size, batch_size, epochs)

    async def _live(
        self, url: str, key: bytes, dataset_size: int, batch_size: int, epochs: int
    ) -> None:
        self._batch_size = batch_size
        self.lives += 1
        with self.cancel_scope:
            stream = await connect(url)
            async with stream:
                channel = await connect_rank(stream, key, self.rank, self.world_size)
                await channel.send(
                    Ready(
                        rank=self.rank,
                        dataset_size=dataset_size,
                        batch_size=batch_size,
                        epochs=epochs,
                    )
                )
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._heartbeat, channel)
                    nursery.start_soon(self._receive, channel, nursery.cancel_scope)
                    await self._obey(channel)
                    nursery.cancel_scope.cancel()

    def kill(self) -> None:
        """Crash now: the connection closes without a word."""
        self.cancel_scope.cancel()

    def silence(self) -> None:
        """Stop sending anything from now on (the connection stays open)."""
        self._silent = True

    async def _send(self, channel: Channel, message: Message) -> None:
        if not self._silent:
            await channel.send(message)

    async def _heartbeat(self, channel: Channel) -> None:
        while not self.cancel_scope.cancel_called:
            await trio.sleep(self.script.heartbeat_interval)
            await self._send(channel, Heartbeat(rank=self.rank, step_count=self._step_count))

    async def _receive(self, channel: Channel, scope: trio.CancelScope) -> None:
        try:
            async for message in channel:
                self.record.received.append(message)
                if isinstance(message, CoordHeartbeat):
                    self.record.beats.append(trio.current_time())
                if isinstance(message, DeclareDead) and self._abandon is not None:
                    self._abandon.cancel()
                if isinstance(message, Shutdown | ShutdownWithSave):
                    self.record.ended_by = message
                    scope.cancel()
                    return
                if not isinstance(message, CoordHeartbeat | EpochAggregated | SetGlobalStep):
                    # Work and control share one queue: like the real worker, a rank acts on
                    # them in arrival order (a SyncNow before the window it came with).
                    self._inbox_send.send_nowait(message)
        except (ChannelClosed, FlodlError, trio.BrokenResourceError):
            scope.cancel()

    def _queue_work(self, message: StartEpoch | ExtendPartition) -> None:
        if isinstance(message, StartEpoch):
            span = (message.epoch, message.partition_offset, message.partition_size)
        else:
            span = (message.epoch, message.offset, message.size)
        self._work.append(span)

    async def _obey(self, channel: Channel) -> None:
        """Handle queued messages in order; train while there is work and nothing queued."""
        clock_mark = trio.current_time()
        while not self.cancel_scope.cancel_called:
            pending = self._inbox.statistics().current_buffer_used
            if pending == 0 and self._work and not self._throttled:
                start = trio.current_time()
                self.record.idle_s += start - clock_mark
                await self._train_chunk(channel)
                clock_mark = trio.current_time()
                self.record.busy_s += clock_mark - start
                continue
            message = await self._inbox.receive()
            handled_at = trio.current_time()
            await self._control(channel, message)
            if isinstance(message, SyncNow):
                self.record.idle_s += handled_at - clock_mark
                clock_mark = trio.current_time()
                self.record.busy_s += clock_mark - handled_at

    async def _train_chunk(self, channel: Channel) -> None:
        script = self.script
        wall_start = trio.current_time()
        batches = 0
        samples = 0
        epoch = self._work[0][0]
        while self._work and not self._throttled:
            epoch, offset, size = self._work.popleft()
            position = offset
            end = offset + size
            while position < end:
                batch = min(self._batch_size, end - position)
                batch_ms = script.ms_per_batch
                if script.ms_per_batch_after is not None:
                    change_at, changed_ms = script.ms_per_batch_after
                    if self.record.batches >= change_at:
                        batch_ms = changed_ms
                await trio.sleep((batch_ms + script.data_ms) / 1000.0)
                self.record.samples.extend((epoch, p) for p in range(position, position + batch))
                position += batch
                batches += 1
                samples += batch
                self.record.batches += 1
                self._step_count += 1
                await self._send(
                    channel,
                    Batch(
                        rank=self.rank,
                        batch_ms=batch_ms,
                        data_ms=script.data_ms,
                        step_count=self._step_count,
                        batch_loss=1.0 / self.record.batches,
                    ),
                )
                await self._after_batch()
                await self._drain_throttle(channel)
        wall_ms = (trio.current_time() - wall_start) * 1000.0
        if script.skip_completion_frames:
            return
        await self._send(
            channel,
            Metrics(
                rank=self.rank,
                epoch=epoch,
                avg_loss=1.0 / max(self.record.batches, 1),
                batches_processed=batches,
                samples_processed=samples,
                epoch_ms=wall_ms,
            ),
        )

    async def _after_batch(self) -> None:
        script = self.script
        if script.die_after_batches is not None and self.record.batches >= script.die_after_batches:
            self.kill()
            await trio.lowlevel.checkpoint()
        if (
            script.silent_after_batches is not None
            and self.record.batches >= script.silent_after_batches
        ):
            self.silence()

    async def _drain_throttle(self, channel: Channel) -> None:
        # Control messages that arrived during a batch are handled between batches.
        pending = self._inbox.statistics().current_buffer_used
        for _ in range(pending):
            await self._control(channel, self._inbox.receive_nowait())

    async def _control(self, channel: Channel, message: Message) -> None:
        if isinstance(message, StartEpoch | ExtendPartition):
            self._queue_work(message)
        elif isinstance(message, Throttle):
            self._throttled = True
        elif isinstance(message, RequestNewGroup):
            if self.script.die_on_group_request:
                self.kill()
                await trio.lowlevel.checkpoint()
            if self.script.ignore_group_requests:
                return
            info = f"simulated-{message.generation}".encode()
            reply = NewGroupReady(rank=self.rank, generation=message.generation, info=info)
            await self._send(channel, reply)
        elif isinstance(message, NewGroupSession):
            self._group = self._groups.get(message.generation, message.new_world_size)
        elif isinstance(message, SyncNow):
            self._throttled = False
            await self._average(channel, message)

    async def _average(self, channel: Channel, sync: SyncNow) -> None:
        group = self._group
        if group is None or group.generation != sync.generation:
            return
        with trio.CancelScope() as scope:
            self._abandon = scope
            if self.script.hang_collectives:
                await trio.sleep_forever()
            await group.enter(sync.round, self.rank)
            await trio.sleep(self.script.collective_ms / 1000.0)
        self._abandon = None
        if scope.cancelled_caught:
            self.record.abandoned += 1
            return
        self._step_count += 1
        self.record.syncs += 1
        await self._send(
            channel,
            SyncAck(
                rank=self.rank,
                round=sync.round,
                step_count=self._step_count,
                divergence=0.01,
                post_norm=1.0,
                pre_norm=1.0,
            ),
        )


@attrs.define
class Cluster:
    """A running in-memory cluster: the coordinator and its scripted ranks."""

    coordinator: Coordinator
    ranks: list[ScriptedRank]
    url: str
    started_at: float = attrs.field(factory=trio.current_time)
    """Trio time at which the cluster started (timeline times are absolute trio times)."""
    ranks_done: trio.Event = attrs.field(factory=trio.Event)

    def elapsed(self) -> float:
        """Seconds since the cluster started."""
        return trio.current_time() - self.started_at

    async def wait_ranks_done(self) -> None:
        """Wait until every scripted rank's task has returned (shut down, crashed or cut)."""
        await self.ranks_done.wait()


@asynccontextmanager
async def open_cluster(
    scripts: Sequence[RankScript],
    *,
    dataset_size: int = 1000,
    batch_size: int = 10,
    epochs: int = 1,
    config: CoordinatorConfig | None = None,
    key: bytes = TEST_KEY,
    seed: int = 0,
    url: str | None = None,
) -> AsyncIterator[Cluster]:
    """A coordinator at ``url`` (default: a fresh ``memory://`` name; ``unix://`` and
    ``tcp://127.0.0.1:0`` run the ranks over real sockets) with one scripted rank per script.

    The ranks start at the block's first checkpoint, so the block may first wrap the
    coordinator's machine (say, to record what it receives). On exit from the block every
    rank task is cancelled and the coordinator closed.
    """
    url = url if url is not None else f"memory://flodl-cluster-{next(_names)}"
    world_size = len(scripts)
    started_at = trio.current_time()
    async with open_coordinator(url, world_size, key, config, seed=seed, linger=0.0) as coord:
        groups = _Groups()
        ranks = [ScriptedRank(r, world_size, s, groups) for r, s in enumerate(scripts)]
        cluster = Cluster(coord, ranks, coord.url, started_at)
        async with trio.open_nursery() as nursery:
            remaining = len(ranks)

            async def run_rank(rank: ScriptedRank) -> None:
                nonlocal remaining
                try:
                    await rank.run(coord.url, key, dataset_size, batch_size, epochs)
                finally:
                    remaining -= 1
                    if remaining == 0:
                        cluster.ranks_done.set()

            for rank in ranks:
                nursery.start_soon(run_rank, rank)
            yield cluster
            nursery.cancel_scope.cancel()
