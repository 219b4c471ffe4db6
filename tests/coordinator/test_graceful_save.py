"""A stop with a save that was asked for (Ctrl-C, SIGTERM, a rank's Intent) stops the training
and waits for a last round: nothing more is handed out, the window in progress is trained, a
last round averages it, and ShutdownWithSave goes out once that round has settled, so every
rank saves the same model and none is stopped in the middle of a collective (which would
strand its peers in it for the collective timeout). A save waited for past the heartbeat
timeout goes out anyway. Real coordinator and channels, scripted ranks, MockClock."""

from __future__ import annotations

import trio
from trio.testing import MockClock

from flodl.config import CoordinatorConfig
from flodl.core.coordinator.machine import Status
from flodl.core.coordinator.timeline import EventKind, TimelineEvent
from flodl.testing import Cluster, RankScript, open_cluster
from flodl.wire.messages import SaveReason, ShutdownWithSave

CONFIG = CoordinatorConfig(heartbeat_timeout=10.0)


def round_started(cluster: Cluster, *, window: bool = True) -> trio.Event:
    """Set as a round starts: the first that closes a window of batches, or (``window``
    False) any, the initial one included."""
    started = trio.Event()

    def sink(_seq: int, event: TimelineEvent) -> None:
        if event.kind is EventKind.SYNC_START and (
            not window or any(event.detail.get("steps") or ())
        ):
            started.set()

    cluster.coordinator.add_event_sink(sink)
    return started


def times_of(cluster: Cluster, kind: EventKind) -> list[float]:
    return [e.time for e in cluster.coordinator.timeline if e.kind is kind]


def assert_every_batch_averaged(cluster: Cluster) -> None:
    """Every batch trained was in a round that settled before the save: the ranks saved one
    model."""
    trained = sum(rank.record.batches for rank in cluster.ranks)
    starts = [e for e in cluster.coordinator.timeline if e.kind is EventKind.SYNC_START]
    assert sum(sum(e.detail["steps"]) for e in starts) == trained
    assert len(starts) == len(times_of(cluster, EventKind.SYNC_END))


async def test_a_stop_asked_for_mid_round_saves_after_a_last_round(
    autojump_clock: MockClock,
) -> None:
    scripts = [RankScript(ms_per_batch=10, collective_ms=2000) for _ in range(3)]
    async with open_cluster(scripts, dataset_size=20_000, config=CONFIG) as cluster:
        await round_started(cluster).wait()
        asked_at = trio.current_time()
        cluster.coordinator.request_stop(save=True)
        assert not cluster.coordinator.machine.finished  # held for the last round
        await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    machine = cluster.coordinator.machine
    assert (machine.outcome.status, machine.outcome.save_reason) == (
        Status.SAVED,
        SaveReason.GRACEFUL,
    )
    assert machine.outcome.message == "stop requested"
    (stop,) = [e for e in cluster.coordinator.timeline if e.kind is EventKind.STOP_REQUESTED]
    assert stop.detail["save"] is True
    (saved_at,) = times_of(cluster, EventKind.SAVE_REQUESTED)
    last_round_end = max(times_of(cluster, EventKind.SYNC_END))
    # The round in flight (2 s), the rest of the window, then the last round (2 s).
    assert asked_at + 2.0 < last_round_end == saved_at < asked_at + CONFIG.heartbeat_timeout
    assert_every_batch_averaged(cluster)
    for scripted in cluster.ranks:
        assert isinstance(scripted.record.ended_by, ShutdownWithSave)
        assert scripted.record.abandoned == 0  # nobody left a collective half done


async def test_a_stop_held_for_a_round_that_never_settles_goes_out_after_the_heartbeat_timeout(
    autojump_clock: MockClock,
) -> None:
    # The hung rank never finishes the initial round, which is in flight when the stop comes.
    scripts = [RankScript(ms_per_batch=10), RankScript(ms_per_batch=10, hang_collectives=True)]
    async with open_cluster(scripts, dataset_size=20_000, config=CONFIG) as cluster:
        await round_started(cluster, window=False).wait()
        asked_at = trio.current_time()
        cluster.coordinator.request_stop(save=True)
        await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    outcome = cluster.coordinator.machine.outcome
    assert outcome.save_reason is SaveReason.GRACEFUL
    assert "had not settled within the heartbeat timeout" in outcome.message
    (saved_at,) = times_of(cluster, EventKind.SAVE_REQUESTED)
    assert saved_at - asked_at == 10.0
    assert all(isinstance(r.record.ended_by, ShutdownWithSave) for r in cluster.ranks)


async def test_a_stop_asked_for_between_rounds_saves_after_the_windows_last_round(
    autojump_clock: MockClock,
) -> None:
    scripts = [RankScript(ms_per_batch=10, collective_ms=1) for _ in range(2)]
    async with open_cluster(scripts, dataset_size=20_000, config=CONFIG) as cluster:
        ended = trio.Event()

        def sink(_seq: int, event: TimelineEvent) -> None:
            if event.kind is EventKind.SYNC_END and event.detail.get("round", 0) >= 2:
                ended.set()

        cluster.coordinator.add_event_sink(sink)
        await ended.wait()
        asked_at = trio.current_time()
        cluster.coordinator.request_stop(save=True)
        assert not cluster.coordinator.machine.finished  # the window in progress is trained
        await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    (saved_at,) = times_of(cluster, EventKind.SAVE_REQUESTED)
    assert saved_at == max(times_of(cluster, EventKind.SYNC_END)) > asked_at
    assert_every_batch_averaged(cluster)


async def test_a_saved_run_records_each_ranks_report_and_then_its_end(
    autojump_clock: MockClock,
) -> None:
    """After ShutdownWithSave each rank reports its bundle (version 0); the last report ends
    the timeline with Shutdown naming who saved, as a completed run's timeline ends. The
    simulated ranks save nothing and say so."""
    scripts = [RankScript(ms_per_batch=10) for _ in range(3)]
    async with open_cluster(scripts, dataset_size=20_000, config=CONFIG) as cluster:
        ended = trio.Event()

        def sink(_seq: int, event: TimelineEvent) -> None:
            if event.kind is EventKind.SHUTDOWN:
                ended.set()

        cluster.coordinator.add_event_sink(sink)
        await round_started(cluster).wait()
        cluster.coordinator.request_stop(save=True)
        await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
        with trio.fail_after(5):
            await ended.wait()
    events = list(cluster.coordinator.timeline)
    kinds = [e.kind for e in events]
    after_save = events[kinds.index(EventKind.SAVE_REQUESTED) + 1 :]
    reports = [e for e in after_save if e.kind is EventKind.CHECKPOINT_SAVED]
    assert sorted(e.detail["rank"] for e in reports) == [0, 1, 2]
    assert {(e.detail["version"], e.detail["error"]) for e in reports} == {(0, "simulated")}
    assert after_save[-1].kind is EventKind.SHUTDOWN and kinds.count(EventKind.SHUTDOWN) == 1
    assert after_save[-1].detail["why"] == (
        "ended with a save (stop requested): ranks none saved; ranks 0, 1, 2 could not save"
    )
    assert cluster.coordinator.machine.outcome.status is Status.SAVED  # the end is unchanged
