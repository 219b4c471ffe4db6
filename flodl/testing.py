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
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from flodl.config import CoordinatorConfig
from flodl.coordinator.server import Coordinator, open_coordinator
from flodl.core.common.job import Job
from flodl.core.common.policy import Policy
from flodl.core.common.work import BatchSlice
from flodl.core.rank.effects import (
    Average,
    CancelRound,
    Finish,
    HandOut,
    JoinGroup,
    PrepareGroup,
    Raise,
    RankEffect,
    SaveAndStop,
    SaveCheckpoint,
    SaveOnLoss,
    Send,
    Wait,
    Wake,
)
from flodl.core.rank.machine import MeasuredRound, RankMachine
from flodl.errors import CoordinatorError, FlodlError
from flodl.transports import connect
from flodl.transports.channel import Channel
from flodl.transports.greeting import connect_rank
from flodl.wire.messages import (
    CoordHeartbeat,
    IntentKind,
    JoinResult,
    Message,
    Metrics,
    NewGroupReady,
    NewGroupSession,
    RequestNewGroup,
    Shutdown,
    ShutdownWithSave,
    SyncNow,
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
    die_in_round: int | None = None
    """Close the connection abruptly while averaging this round (a crash in a collective)."""
    silent_after_batches: int | None = None
    """Stop sending anything (heartbeats included) but keep the connection open."""
    hang_collectives: bool = False
    """Enter collectives but never finish them (a hung peer that stays alive)."""
    join_ms: float = 0.0
    """Each group generation takes this long to join (a slow rendezvous or NCCL init); a
    round of that generation waits for the join."""
    fail_joins: bool = False
    """Every join fails (reported as such): the rank's rounds on that generation never run."""
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
    stop_after_batches: int | None = None
    """Stop the training after this many batches, as a script's ``rank.stop(reason)`` does."""


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


class SimulatedGroups:
    """Generation -> SimulatedGroup, shared by the scripted ranks of one cluster."""

    def __init__(self) -> None:
        self._groups: dict[int, SimulatedGroup] = {}

    def get(self, generation: int, size: int) -> SimulatedGroup:
        group = self._groups.get(generation)
        if group is None:
            group = self._groups[generation] = SimulatedGroup(generation, size)
        return group


class ScriptedRank:
    """A rank that follows a :class:`RankScript` over a real Channel.

    Its protocol is the real one: a :class:`~flodl.core.rank.machine.RankMachine` decides, this
    class only performs (training is a sleep, averaging a :class:`SimulatedGroup`, saving instant).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        script: RankScript,
        groups: SimulatedGroups,
        progress: Callable[[], None] = lambda: None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.script = script
        self.record = RankRecord()
        self._progress = progress
        """Called after each batch this rank trains (wakes :meth:`Cluster.until`)."""
        self.lives = 0
        """How many times this rank connected (2 after a rejoin)."""
        self._groups = groups
        self._reset()

    def _reset(self) -> None:
        """Fresh process state: no work, no group, step count 0."""
        self.machine = RankMachine(self.rank, self.world_size, Policy.CADENCE)
        self._group: SimulatedGroup | None = None
        self._joining = -1
        """The newest generation announced to this rank (its join may still be under way)."""
        self._silent = False
        self._abandon: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()
        self.cancel_scope = trio.CancelScope()

    async def run(
        self, url: str, key: bytes, dataset_size: int, batch_size: int, epochs: int
    ) -> None:
        """Connect, train as told, return when shut down (or killed by the script).

        With ``rejoin_after`` set, a rank killed by its script comes back once, as a restarted
        process would: fresh state, same rank id, no scripted crash the second time.
        """
        await trio.sleep(self.script.start_after)
        job = Job(dataset_size, batch_size, epochs)
        await self._live(url, key, job)
        if self.cancel_scope.cancel_called and self.script.rejoin_after is not None:
            await trio.sleep(self.script.rejoin_after)
            self.script = attrs.evolve(self.script, die_after_batches=None, rejoin_after=None)
            self._reset()
            await self._live(url, key, job)

    async def _live(self, url: str, key: bytes, job: Job) -> None:
        self.lives += 1
        with self.cancel_scope:
            stream = await connect(url)
            async with stream:
                channel = await connect_rank(stream, key, self.rank, self.world_size)
                await self._perform(channel, self.machine.announce(job))
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._heartbeat, channel)
                    nursery.start_soon(self._receive, channel, nursery.cancel_scope)
                    await self._train(channel)
                    nursery.cancel_scope.cancel()

    def kill(self) -> None:
        """Crash now: the connection closes without a word."""
        self.cancel_scope.cancel()

    def silence(self) -> None:
        """Stop sending anything from now on (the connection stays open)."""
        self._silent = True

    async def _send(self, channel: Channel, message: Message) -> None:
        if self._silent:
            return
        if isinstance(message, Metrics) and self.script.skip_completion_frames:
            return
        try:
            await channel.send(message)
        except FlodlError as err:
            self.machine.connection_lost(CoordinatorError(f"lost the coordinator: {err}"))
            self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = trio.Event()

    async def _perform(self, channel: Channel, effects: Sequence[RankEffect]) -> None:
        """Carry out the machine's reactions in order."""
        for effect in effects:
            if isinstance(effect, Send):
                await self._send(channel, effect.message)
            elif isinstance(effect, Wake):
                self._notify()
            elif isinstance(effect, CancelRound) and self._abandon is not None:
                self._abandon.cancel()
            elif isinstance(effect, PrepareGroup):
                await self._prepare_group(channel, effect.request)
            elif isinstance(effect, JoinGroup):
                self._joining = effect.session.generation
                if self.script.join_ms > 0 and self._nursery is not None:
                    self._nursery.start_soon(self._join, channel, effect.session)
                else:
                    await self._join(channel, effect.session)

    async def _join(self, channel: Channel, session: NewGroupSession) -> None:
        await trio.sleep(self.script.join_ms / 1000.0)
        if session.generation == self._joining:  # not superseded meanwhile
            joined = not self.script.fail_joins
            if joined:
                self._group = self._groups.get(session.generation, session.new_world_size)
            await self._send(channel, JoinResult(self.rank, session.generation, joined=joined))
            self._notify()

    async def _prepare_group(self, channel: Channel, request: RequestNewGroup) -> None:
        if self.script.die_on_group_request:
            self.kill()
            await trio.lowlevel.checkpoint()
        if self.script.ignore_group_requests:
            return
        info = f"simulated-{request.generation}".encode()
        await self._send(channel, NewGroupReady(self.rank, request.generation, info))

    async def _heartbeat(self, channel: Channel) -> None:
        while not self.cancel_scope.cancel_called:
            await trio.sleep(self.script.heartbeat_interval)
            beat = self.machine.heartbeat()
            if beat is not None:
                await self._send(channel, beat)

    async def _receive(self, channel: Channel, scope: trio.CancelScope) -> None:
        try:
            async for message in channel:
                self.record.received.append(message)
                if isinstance(message, CoordHeartbeat):
                    self.record.beats.append(trio.current_time())
                if isinstance(message, Shutdown | ShutdownWithSave):
                    self.record.ended_by = message
                await self._perform(channel, self.machine.receive(message))
        except FlodlError as err:
            self.machine.connection_lost(CoordinatorError(f"lost the coordinator: {err}"))
            scope.cancel()

    async def _train(self, channel: Channel) -> None:
        """The training loop: batch boundaries and (simulated) batches until the end."""
        machine = self.machine
        while True:
            waited_before = machine.times.idle_s + machine.times.startup_s
            machine.enter_boundary(trio.current_time())
            try:
                batch = await self._boundary(channel)
            finally:
                machine.leave_boundary(trio.current_time())
                self.record.idle_s += machine.times.idle_s + machine.times.startup_s - waited_before
            if batch is None:
                return
            await self._train_batch(channel, batch)

    async def _boundary(self, channel: Channel) -> BatchSlice | None:
        machine = self.machine
        while True:
            wake = self._wake
            effects = machine.boundary(trio.current_time())
            step = effects.pop()
            await self._perform(channel, effects)
            if isinstance(step, HandOut):
                return step.batch
            if isinstance(step, Finish | Raise):
                return None
            if isinstance(step, Wait):
                await wake.wait()
            elif isinstance(step, Average):
                await self._perform(channel, await self._average(step.sync))
            elif isinstance(step, SaveCheckpoint):
                await self._perform(channel, machine.checkpoint_finished(step.request, 0.0, None))
            elif isinstance(step, SaveAndStop):
                await self._perform(
                    channel, machine.save_finished("simulated, nothing saved", 0.0, "simulated")
                )
            elif isinstance(step, SaveOnLoss):
                await self._perform(channel, machine.loss_save_finished("simulated, not saved"))

    async def _train_batch(self, channel: Channel, batch: BatchSlice) -> None:
        script = self.script
        batch_ms = script.ms_per_batch
        if script.ms_per_batch_after is not None:
            change_at, changed_ms = script.ms_per_batch_after
            if self.record.batches >= change_at:
                batch_ms = changed_ms
        started = trio.current_time()
        await trio.sleep((batch_ms + script.data_ms) / 1000.0)
        self.record.busy_s += trio.current_time() - started
        self.record.samples.extend((batch.epoch, p) for p in range(batch.start, batch.stop))
        self.record.batches += 1
        loss = 1.0 / self.record.batches
        done = self.machine.batch_done(loss, script.data_ms, trio.current_time())
        await self._perform(channel, done)
        self._progress()
        if script.stop_after_batches == self.record.batches:
            await self._perform(channel, self.machine.ask(IntentKind.STOP, "scripted stop"))
        if script.die_after_batches is not None and self.record.batches >= script.die_after_batches:
            self.kill()
            await trio.lowlevel.checkpoint()
        if (
            script.silent_after_batches is not None
            and self.record.batches >= script.silent_after_batches
        ):
            self.silence()

    async def _average(self, sync: SyncNow) -> list[RankEffect]:
        started = trio.current_time()
        with trio.CancelScope() as scope:
            self._abandon = scope  # also ends a wait for a join that never comes
            while self._joining == sync.generation and (
                self._group is None or self._group.generation != sync.generation
            ):
                await self._wake.wait()  # its join is under way
            group = self._group
            if group is None or group.generation != sync.generation:
                self._abandon = None
                return self.machine.average_finished(sync, None, 0.0)
            if self.script.hang_collectives:
                await trio.sleep_forever()
            if self.script.die_in_round == sync.round:
                self.kill()
                await trio.sleep_forever()
            await group.enter(sync.round, self.rank)
            await trio.sleep(self.script.collective_ms / 1000.0)
        self._abandon = None
        elapsed = trio.current_time() - started
        self.record.busy_s += elapsed
        if scope.cancelled_caught:
            self.record.abandoned += 1
            return self.machine.average_finished(sync, None, elapsed)
        self.record.syncs += 1
        return self.machine.average_finished(sync, _SIMULATED_ROUND, elapsed)


_SIMULATED_ROUND = MeasuredRound(divergence=0.01, post_norm=1.0, pre_norm=1.0)
"""What every simulated average reports."""


@attrs.define
class Cluster:
    """A running in-memory cluster: the coordinator and its scripted ranks."""

    coordinator: Coordinator
    ranks: list[ScriptedRank]
    url: str
    started_at: float = attrs.field(factory=trio.current_time)
    """Trio time at which the cluster started (timeline times are absolute trio times)."""
    ranks_done: trio.Event = attrs.field(factory=trio.Event)
    _news: trio.Event = attrs.field(factory=trio.Event, init=False)

    def elapsed(self) -> float:
        """Seconds since the cluster started."""
        return trio.current_time() - self.started_at

    def _progressed(self, *_: object) -> None:
        self._news.set()
        self._news = trio.Event()

    async def until(self, condition: Callable[[], bool]) -> None:
        """Return once ``condition()`` holds. It is checked now, then again after every batch a
        scripted rank trains and every event the coordinator records, so the wait wakes when
        something happened, not on a timer. Cancellable; it waits as long as it takes, so bound
        it with a cancel scope where the condition may never come."""
        while not condition():
            await self._news.wait()

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
    freeze_heap: bool = False,
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
    coordinating = open_coordinator(
        url, world_size, key, config, seed=seed, linger=0.0, freeze_heap=freeze_heap
    )
    async with coordinating as coord:
        groups = SimulatedGroups()
        cluster = Cluster(coord, [], coord.url, started_at)
        cluster.ranks.extend(
            ScriptedRank(r, world_size, s, groups, cluster._progressed)
            for r, s in enumerate(scripts)
        )
        ranks = cluster.ranks
        coord.add_event_sink(cluster._progressed)
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
