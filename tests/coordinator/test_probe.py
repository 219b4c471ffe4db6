"""The coordinator's probe (flodl.coordinator.probe): told of every machine call, steers nothing.

Real coordinators over the memory transport with scripted ranks, under MockClock.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import trio
from trio.testing import MockClock

from flodl.config import CoordinatorConfig
from flodl.coordinator import open_coordinator
from flodl.coordinator.probe import MachineEvent, ShellProbe
from flodl.core.coordinator.machine import Status
from flodl.core.coordinator.timeline import EventKind
from flodl.errors import BrokenChannel, ChannelClosed
from flodl.testing import TEST_KEY, RankScript, open_cluster
from flodl.transports import connect
from flodl.transports.greeting import connect_rank
from flodl.wire.messages import Batch, Heartbeat, Message, Ready, RunSettings


class Recording(ShellProbe):
    """Keeps everything it is told."""

    def __init__(self) -> None:
        self.messages: list[tuple[int, Message, float, float]] = []
        self.ticks: list[tuple[float, float, float]] = []
        self.events: list[tuple[MachineEvent, int | None, float, float]] = []

    def message_handled(self, rank: int, message: Message, now: float, cpu_s: float) -> None:
        self.messages.append((rank, message, now, cpu_s))

    def ticked(self, now: float, deadline: float, cpu_s: float) -> None:
        self.ticks.append((now, deadline, cpu_s))

    def event_handled(
        self, event: MachineEvent, rank: int | None, now: float, cpu_s: float
    ) -> None:
        self.events.append((event, rank, now, cpu_s))

    def of_rank(self, rank: int) -> list[Message]:
        return [message for r, message, _, _ in self.messages if r == rank]


class OnlyMessages(ShellProbe):
    """Defines one callback; the others are the Protocol's defaults, which do nothing."""

    def __init__(self) -> None:
        self.seen: list[Message] = []

    def message_handled(self, rank: int, message: Message, now: float, cpu_s: float) -> None:
        self.seen.append(message)


class Raising(ShellProbe):
    def __init__(self) -> None:
        self.calls = 0

    def message_handled(self, rank: int, message: Message, now: float, cpu_s: float) -> None:
        self.calls += 1
        raise RuntimeError("a probe with a bug")


async def test_every_message_the_machine_handled_is_reported_with_its_time(
    autojump_clock: MockClock,
) -> None:
    probe = Recording()
    scripts = [RankScript(ms_per_batch=10), RankScript(ms_per_batch=10), RankScript(25)]
    async with open_cluster(scripts, dataset_size=600, batch_size=10) as cluster:
        cluster.coordinator.set_probe(probe)  # before the ranks start (the block's first step)
        assert (await cluster.coordinator.wait_finished()).status is Status.COMPLETED
        await cluster.wait_ranks_done()
    for scripted in cluster.ranks:
        seen = probe.of_rank(scripted.rank)
        assert isinstance(seen[0], Ready)
        # Every batch the rank trained was reported to the machine, and so to the probe.
        assert sum(isinstance(m, Batch) for m in seen) == scripted.record.batches > 0
    # Times are the `now` handed to the machine: in order, and CPU times are durations.
    times = [now for _, _, now, _ in probe.messages]
    assert times == sorted(times)
    assert all(cpu_s >= 0.0 for *_, cpu_s in probe.messages)
    # What the machine counted of each rank is what the probe was told.
    batches = Counter(r for r, m, _, _ in probe.messages if isinstance(m, Batch))
    assert sum(batches.values()) == 600 // 10
    # Each rank connected once before its first message, and disconnected once.
    for rank in range(3):
        connects = [now for e, r, now, _ in probe.events if e == "connect" and r == rank]
        assert len(connects) == 1
        first = next(now for r, _, now, _ in probe.messages if r == rank)
        assert connects[0] <= first
        assert [e for e, r, _, _ in probe.events if r == rank].count("disconnect") == 1


async def test_a_message_the_machine_does_not_handle_is_not_reported(
    autojump_clock: MockClock,
) -> None:
    probe = Recording()
    scripts = [RankScript(ms_per_batch=10), RankScript(ms_per_batch=10, start_after=1.0)]
    async with open_cluster(scripts, dataset_size=400, batch_size=10) as cluster:
        cluster.coordinator.set_probe(probe)
        stream = await connect(cluster.url)
        channel = await connect_rank(stream, TEST_KEY, 1, 2)
        assert isinstance(await channel.receive(), RunSettings)
        sent_at = []
        for step in range(3):
            sent_at.append(trio.current_time())
            await channel.send(Heartbeat(rank=1, step_count=step))
            await trio.sleep(0.25)
        # Claims rank 0: dropped before the machine sees it.
        await channel.send(Heartbeat(rank=0, step_count=9))
        with pytest.raises((ChannelClosed, BrokenChannel)):
            while True:  # what was sent to it meanwhile (beats), then the end
                await channel.receive()
        await stream.aclose()
        assert (await cluster.coordinator.wait_finished()).status is Status.COMPLETED
        await cluster.wait_ranks_done()
    impostor = [
        (message, now)
        for rank, message, now, _ in probe.messages
        if rank == 1 and now < cluster.started_at + 1.0
    ]
    assert [m for m, _ in impostor] == [Heartbeat(rank=1, step_count=s) for s in range(3)]
    # Memory transport, mock clock: read at the instant it was sent.
    assert [now for _, now in impostor] == sent_at


async def test_each_tick_reports_the_deadline_the_deadline_task_slept_for(
    autojump_clock: MockClock,
) -> None:
    probe = Recording()
    scripts = [RankScript(ms_per_batch=10), RankScript(ms_per_batch=10, silent_after_batches=5)]
    config = CoordinatorConfig(heartbeat_timeout=10.0)
    async with open_cluster(scripts, dataset_size=3000, batch_size=10, config=config) as cluster:
        cluster.coordinator.set_probe(probe)
        await cluster.coordinator.wait_finished()
    (dead,) = [e for e in cluster.coordinator.timeline if e.kind is EventKind.RANK_DEAD]
    assert probe.ticks
    # The mock clock wakes the task exactly at its deadline.
    assert all(now == deadline and cpu_s >= 0.0 for now, deadline, cpu_s in probe.ticks)
    # The silence death was decided by a tick at the deadline it was armed for.
    assert dead.time in {now for now, _, _ in probe.ticks}


async def test_a_probe_given_at_opening_sees_the_first_message_and_defaults_do_nothing(
    autojump_clock: MockClock,
) -> None:
    probe = OnlyMessages()
    ready = Ready(rank=0, dataset_size=10, batch_size=1, epochs=1)
    opening = open_coordinator("memory://probe-opening", 1, TEST_KEY, linger=0.0, probe=probe)
    async with opening as coord:
        stream = await connect(coord.url)
        async with stream:
            channel = await connect_rank(stream, TEST_KEY, 0, 1)
            assert isinstance(await channel.receive(), RunSettings)
            await channel.send(ready)
            await trio.sleep(1.0)  # the connect, beats, maybe ticks: the defaults take them
        await coord.wait_all_hung_up()  # the disconnect too
    assert probe.seen == [ready]


async def test_a_probe_that_raises_is_logged_and_detached_and_the_run_goes_on(
    autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    probe = Raising()
    with caplog.at_level(logging.ERROR, logger="flodl.coordinator"):
        async with open_cluster([RankScript(), RankScript()], dataset_size=400) as cluster:
            cluster.coordinator.set_probe(probe)
            assert (await cluster.coordinator.wait_finished()).status is Status.COMPLETED
            await cluster.wait_ranks_done()
    assert probe.calls == 1
    (record,) = [r for r in caplog.records if "probe" in r.getMessage()]
    assert "RuntimeError: a probe with a bug; it is detached" in record.getMessage()
    samples = Counter(s for rank in cluster.ranks for s in rank.record.samples)
    assert len(samples) == 400 and set(samples.values()) == {1}
