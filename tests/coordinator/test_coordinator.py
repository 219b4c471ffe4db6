"""The coordinator end to end over the memory transport, with scripted ranks, under MockClock.

Each test drives a real coordinator (trio shell + decision machine) and real Channels; time is
trio's mock clock, so heartbeat timeouts of 10 s and stall ceilings of 300 s take milliseconds.
"""

from __future__ import annotations

import gc
import itertools
import logging
from collections import Counter

import pytest
import trio
from trio.testing import MockClock

from flodl.config import CoordinatorConfig, MaxFailure
from flodl.coordinator.links import FLUSH_CHUNK, OUTBOX_LIMIT
from flodl.coordinator.server import open_coordinator
from flodl.core.coordinator.machine import Status
from flodl.core.coordinator.timeline import EventKind
from flodl.errors import BrokenChannel, ChannelClosed, ProtocolError
from flodl.testing import TEST_KEY, Cluster, RankScript, open_cluster
from flodl.transports import connect
from flodl.transports.greeting import connect_rank
from flodl.wire.messages import (
    Abort,
    Batch,
    DeclareDead,
    Heartbeat,
    NewGroupSession,
    RequestNewGroup,
    RunSettings,
    SaveReason,
    Shutdown,
    ShutdownWithSave,
    Throttle,
)


def fast(n: int, ms: float = 10.0, **kwargs: object) -> list[RankScript]:
    return [RankScript(ms_per_batch=ms, **kwargs) for _ in range(n)]  # type: ignore[arg-type]


def events(cluster: Cluster, kind: EventKind) -> list[dict[str, object]]:
    t0 = cluster.started_at
    return [
        {"time": e.time - t0, **e.detail} for e in cluster.coordinator.timeline if e.kind is kind
    ]


def window_starts(cluster: Cluster) -> list[float]:
    """Start times of rounds that close a window of batches (not the initial round 1, which
    aligns every rank's parameters before any batch, nor redone rounds)."""
    return [
        float(e["time"])  # type: ignore[arg-type]
        for e in events(cluster, EventKind.SYNC_START)
        if any(e.get("steps") or ())  # type: ignore[arg-type]
    ]


async def test_run_completes_and_every_sample_is_trained_once_per_epoch(
    autojump_clock: MockClock,
) -> None:
    scripts = [RankScript(ms_per_batch=10), RankScript(ms_per_batch=10), RankScript(25)]
    async with open_cluster(scripts, dataset_size=3000, batch_size=10, epochs=2) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.COMPLETED
    samples = Counter(s for rank in cluster.ranks for s in rank.record.samples)
    assert len(samples) == 6000
    assert set(samples.values()) == {1}
    assert all(isinstance(rank.record.ended_by, Shutdown) for rank in cluster.ranks)
    # The slow rank ran fewer batches, the fast ones proportionally more.
    batches = [rank.record.batches for rank in cluster.ranks]
    assert batches[2] < batches[0] and batches[2] < batches[1]
    results = cluster.coordinator.machine.epoch_results
    assert [r["epoch"] for r in results] == [0, 1]
    assert [r["samples"] for r in results] == [3000, 3000]


async def test_no_sample_is_dropped_when_the_dataset_is_not_a_multiple_of_the_batch(
    autojump_clock: MockClock,
) -> None:
    """No drop-last: a span's last batch is shorter instead (docs/worker.md)."""
    scripts = [RankScript(ms_per_batch=10), RankScript(ms_per_batch=30)]
    async with open_cluster(scripts, dataset_size=997, batch_size=16, epochs=2) as cluster:
        assert (await cluster.coordinator.wait_finished()).status is Status.COMPLETED
        await cluster.wait_ranks_done()
    samples = Counter(s for rank in cluster.ranks for s in rank.record.samples)
    assert sorted(samples) == [(e, p) for e in range(2) for p in range(997)]
    assert set(samples.values()) == {1}


async def test_window_wait_completes_as_soon_as_completion_frames_arrive(
    autojump_clock: MockClock,
) -> None:
    async with open_cluster(fast(2), dataset_size=400, batch_size=10) as cluster:
        await cluster.coordinator.wait_finished()
    starts = window_starts(cluster)
    assert starts
    # The first window is 10 batches of 10 ms: the round starts as soon as the last
    # completion frame lands (~0.1 s after start), not after the 12 s ceiling.
    assert 0.099 <= starts[0] < 0.2


async def test_window_wait_hits_its_ceiling_when_completion_frames_never_come(
    autojump_clock: MockClock,
) -> None:
    scripts = [
        RankScript(ms_per_batch=10),
        RankScript(ms_per_batch=10, skip_completion_frames=True),
    ]
    config = CoordinatorConfig(heartbeat_timeout=10.0)
    async with open_cluster(scripts, dataset_size=400, batch_size=10, config=config) as cluster:
        await cluster.coordinator.wait_finished()
    starts = window_starts(cluster)
    # Ceiling = heartbeat_timeout + 2 s after the trigger (~0.1 s after start).
    assert 12.1 <= starts[0] < 12.2


async def test_heartbeat_keeps_beating_during_every_wait(
    autojump_clock: MockClock,
) -> None:
    # A silent generator makes the coordinator wait 5 s per rendezvous try, and a missing
    # completion frame makes it wait 12 s per window: the beacon must not pause for either.
    scripts = [
        RankScript(ms_per_batch=10, skip_completion_frames=True),
        RankScript(ms_per_batch=10, ignore_group_requests=True),
        RankScript(ms_per_batch=10),
    ]
    config = CoordinatorConfig(heartbeat_interval=1.0, heartbeat_timeout=10.0)
    async with open_cluster(scripts, dataset_size=600, batch_size=10, config=config) as cluster:
        await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    # The run spent 5 s waiting for a silent generator and 12 s in a window-completion wait
    # with no progress; the beacon never paused: no gap between beats above one interval.
    assert cluster.elapsed() > 17.0
    for scripted in cluster.ranks:
        beats = scripted.record.beats
        assert len(beats) >= int(cluster.elapsed()) - 1
        gaps = [b - a for a, b in itertools.pairwise(beats)]
        assert max(gaps) <= 1.0 + 1e-6
        assert beats[0] - cluster.started_at <= 1.0 + 1e-6


async def test_each_rank_beats_once_per_interval_at_a_phase_of_its_own(
    autojump_clock: MockClock,
) -> None:
    # 18 ranks, 16 slots of 1/16 s: rank r beats at (r % 16) / 16 s past each whole second
    # (ranks 16 and 17 share the slots of ranks 0 and 1), so no slot holds more than two.
    scripts = [RankScript(ms_per_batch=100) for _ in range(18)]
    config = CoordinatorConfig(heartbeat_interval=1.0, heartbeat_timeout=10.0)
    async with open_cluster(scripts, dataset_size=200_000, batch_size=10, config=config) as cluster:
        with trio.move_on_after(5.5):
            await cluster.coordinator.wait_finished()
        cluster.coordinator.request_stop(save=False)
        await cluster.wait_ranks_done()
    for rank, scripted in enumerate(cluster.ranks):
        beats = [b - cluster.started_at for b in scripted.record.beats]
        assert len(beats) >= 5
        assert {round(b % 1.0, 9) for b in beats} == {(rank % 16) / 16}
        assert all(b - a == pytest.approx(1.0) for a, b in itertools.pairwise(beats))


async def test_silent_rank_is_declared_dead_exactly_at_the_timeout(
    autojump_clock: MockClock,
) -> None:
    scripts = [*fast(2), RankScript(ms_per_batch=10, silent_after_batches=5)]
    config = CoordinatorConfig(heartbeat_timeout=10.0)
    async with open_cluster(scripts, dataset_size=3000, batch_size=10, config=config) as cluster:
        await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    (dead,) = events(cluster, EventKind.RANK_DEAD)
    assert dead["rank"] == 2 and dead["cause"] == "silent"
    # Its 5th batch report at 5 x 10 ms, after the 1 ms initial round (RankScript.collective_ms).
    last_seen = 0.001 + 0.05
    assert dead["time"] == pytest.approx(last_seen + 10.0, abs=1e-6)
    assert cluster.coordinator.machine.outcome.status is Status.COMPLETED
    assert all(r.record.count(DeclareDead) == 1 for r in cluster.ranks[:2])
    # The silent rank still reads: it is let go at once, so that a paused process that wakes
    # up ends instead of training on outside the group; nothing else reaches it after that.
    silent = cluster.ranks[2].record
    assert isinstance(silent.received[-1], Abort), silent.received[-3:]
    assert "declared dead: silent past the heartbeat timeout" in silent.received[-1].reason
    assert silent.ended_by is None


async def test_dropped_connection_is_dead_at_once_and_survivors_finish(
    autojump_clock: MockClock,
) -> None:
    scripts = [*fast(2), RankScript(ms_per_batch=10, die_after_batches=7)]
    async with open_cluster(scripts, dataset_size=3000, batch_size=10) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    (dead,) = events(cluster, EventKind.RANK_DEAD)
    assert dead["cause"] == "disconnected"
    assert dead["time"] == pytest.approx(0.001 + 0.07, abs=1e-6)  # 1 ms initial round
    (reformed,) = events(cluster, EventKind.GROUP_REFORMED)
    assert reformed["members"] == [0, 1]
    # The generator answers between two of its batches: at most one batch (10 ms) later.
    assert 0.071 <= float(reformed["time"]) <= 0.081 + 1e-6  # type: ignore[arg-type]
    assert outcome.status is Status.COMPLETED
    # The dead rank's unfinished samples went to the survivors: nothing lost, nothing twice
    # (the dead rank's finished batches count as seen, as in floDl).
    samples = Counter(s for rank in cluster.ranks for s in rank.record.samples)
    assert len(samples) == 3000 and set(samples.values()) == {1}
    survivors_sessions = [r.record.count(NewGroupSession) for r in cluster.ranks[:2]]
    assert survivors_sessions == [2, 2]


async def saved_on_reduce_stall(
    scripts: list[RankScript], config: CoordinatorConfig
) -> tuple[Cluster, float]:
    """Run ``scripts`` to a REDUCE_STALL save: the cluster, and the seconds from the first
    SyncStart to the save request."""
    async with open_cluster(scripts, dataset_size=3000, batch_size=10, config=config) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.SAVED and outcome.save_reason is SaveReason.REDUCE_STALL
    (save,) = events(cluster, EventKind.SAVE_REQUESTED)
    (start,) = events(cluster, EventKind.SYNC_START)
    return cluster, float(save["time"]) - float(start["time"])  # type: ignore[arg-type]


async def test_stall_ceiling_fires_once_with_reduce_stall(
    autojump_clock: MockClock,
) -> None:
    scripts = [*fast(2), RankScript(ms_per_batch=10, hang_collectives=True)]
    config = CoordinatorConfig(heartbeat_timeout=10.0)  # default ceiling: max(100, 300) = 300 s
    cluster, waited = await saved_on_reduce_stall(scripts, config)
    assert waited == pytest.approx(300.0, abs=1e-6)
    for rank in cluster.ranks:
        assert rank.record.count(ShutdownWithSave) == 1
        assert rank.record.ended_by == ShutdownWithSave(reason=SaveReason.REDUCE_STALL)


async def test_forming_a_slow_group_is_no_reduce_stall(autojump_clock: MockClock) -> None:
    # Joining takes each rank 4 s (a slow rendezvous or NCCL init), past the 3 s ceiling: the
    # first round waits for it, and the ceiling counts from the last join.
    config = CoordinatorConfig(reduce_stall_ceiling=3.0)
    scripts = fast(3, join_ms=4000.0)
    async with open_cluster(scripts, dataset_size=600, batch_size=10, config=config) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.COMPLETED, outcome
    start = events(cluster, EventKind.SYNC_START)[0]
    end = events(cluster, EventKind.SYNC_END)[0]
    assert float(end["time"]) - float(start["time"]) >= 4.0  # type: ignore[arg-type]


async def test_the_stall_ceiling_counts_from_the_last_join(autojump_clock: MockClock) -> None:
    config = CoordinatorConfig(reduce_stall_ceiling=3.0)
    scripts = [*fast(2, join_ms=2000.0), RankScript(join_ms=2000.0, hang_collectives=True)]
    _, waited = await saved_on_reduce_stall(scripts, config)
    assert waited == pytest.approx(2.0 + 3.0, abs=0.01)


async def test_a_failed_join_is_recorded_and_its_round_stalls_from_it(
    autojump_clock: MockClock,
) -> None:
    # Rank 2's join fails after 2 s: the round it cannot take part in stalls one ceiling later.
    config = CoordinatorConfig(reduce_stall_ceiling=3.0)
    scripts = [*fast(2), RankScript(join_ms=2000.0, fail_joins=True)]
    cluster, waited = await saved_on_reduce_stall(scripts, config)
    assert waited == pytest.approx(2.0 + 3.0, abs=0.01)
    (failed,) = events(cluster, EventKind.JOIN_FAILED)
    assert (failed["rank"], failed["generation"]) == (2, 0)


async def test_no_shutdown_while_a_round_is_unsettled(
    autojump_clock: MockClock,
) -> None:
    scripts = fast(2, collective_ms=500.0)
    async with open_cluster(scripts, dataset_size=3000, batch_size=10) as cluster:
        coordinator = cluster.coordinator
        # Stop is asked for while the first round's collective (500 ms) is in flight.
        await trio.sleep(0.15)
        assert not coordinator.machine.cycle.settled
        coordinator.request_stop(save=False)
        assert not coordinator.machine.finished
        outcome = await coordinator.wait_finished()
        stopped_at = cluster.elapsed()
        await cluster.wait_ranks_done()
    (end,) = events(cluster, EventKind.SYNC_END)
    assert outcome.status is Status.COMPLETED
    assert stopped_at >= float(end["time"])  # type: ignore[arg-type]
    assert all(isinstance(r.record.ended_by, Shutdown) for r in cluster.ranks)


async def test_silent_generator_is_retried_after_five_seconds(
    autojump_clock: MockClock,
) -> None:
    # Rank 0 is the first choice (lowest local rank) and never answers.
    scripts = [RankScript(ms_per_batch=10, ignore_group_requests=True), *fast(2)]
    async with open_cluster(scripts, dataset_size=600, batch_size=10) as cluster:
        await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    asked = [r.record.count(RequestNewGroup) for r in cluster.ranks]
    assert asked == [1, 1, 0]
    assert window_starts(cluster)[0] == pytest.approx(5.0 + 0.1, abs=0.01)


async def test_generator_death_is_retried_at_once(autojump_clock: MockClock) -> None:
    scripts = [RankScript(ms_per_batch=10, die_on_group_request=True), *fast(2)]
    async with open_cluster(scripts, dataset_size=600, batch_size=10) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.COMPLETED
    assert [r.record.count(RequestNewGroup) for r in cluster.ranks] == [1, 1, 0]
    sessions = [m for m in cluster.ranks[1].record.received if isinstance(m, NewGroupSession)]
    assert sessions[0].new_world_size == 2 and sessions[0].new_rank == 0
    assert cluster.elapsed() < 1.0  # no 5 s retry wait: the death was seen at once


async def test_rendezvous_exhaustion_saves(autojump_clock: MockClock) -> None:
    scripts = [RankScript(ms_per_batch=10, ignore_group_requests=True) for _ in range(2)]
    async with open_cluster(scripts, dataset_size=600, batch_size=10) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.SAVED
    assert outcome.save_reason is SaveReason.SINGLE_SURVIVOR
    assert cluster.elapsed() == pytest.approx(10.0, abs=0.01)  # two tries of 5 s each
    assert all(
        r.record.ended_by == ShutdownWithSave(SaveReason.SINGLE_SURVIVOR) for r in cluster.ranks
    )


async def test_death_during_the_rendezvous_is_folded_into_the_new_group(
    autojump_clock: MockClock,
) -> None:
    # Rank 3 dies first; while its replacement group is being generated by a silent
    # generator (rank 0, retried after 5 s), rank 2 goes silent and is declared dead too.
    scripts = [
        RankScript(ms_per_batch=10, ignore_group_requests=False),
        RankScript(ms_per_batch=10),
        RankScript(ms_per_batch=10, silent_after_batches=12),
        RankScript(ms_per_batch=10, die_after_batches=12),
    ]
    config = CoordinatorConfig(heartbeat_timeout=2.0, heartbeat_interval=0.5)
    async with open_cluster(scripts, dataset_size=4000, batch_size=10, config=config) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.COMPLETED
    dead = sorted(int(e["rank"]) for e in events(cluster, EventKind.RANK_DEAD))  # type: ignore[call-overload]
    assert dead == [2, 3]
    final = [m for m in cluster.ranks[0].record.received if isinstance(m, NewGroupSession)][-1]
    assert final.new_world_size == 2


async def test_down_to_one_survivor_saves_single_survivor(
    autojump_clock: MockClock,
) -> None:
    scripts = [RankScript(ms_per_batch=10), RankScript(ms_per_batch=10, die_after_batches=5)]
    async with open_cluster(scripts, dataset_size=3000, batch_size=10) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.save_reason is SaveReason.SINGLE_SURVIVOR
    assert cluster.ranks[0].record.ended_by == ShutdownWithSave(SaveReason.SINGLE_SURVIVOR)


async def test_max_failure_saves_before_the_backend_limit(
    autojump_clock: MockClock,
) -> None:
    scripts = [*fast(3), RankScript(ms_per_batch=10, die_after_batches=5)]
    config = CoordinatorConfig(max_failure=MaxFailure.absolute(1))
    async with open_cluster(scripts, dataset_size=3000, batch_size=10, config=config) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.save_reason is SaveReason.MAX_FAILURE


async def test_all_ranks_lost_without_a_collective_backend(
    autojump_clock: MockClock,
) -> None:
    scripts = [RankScript(ms_per_batch=10, die_after_batches=3) for _ in range(2)]
    config = CoordinatorConfig(collective=False)
    async with open_cluster(scripts, dataset_size=3000, batch_size=10, config=config) as cluster:
        outcome = await cluster.coordinator.wait_finished()
    assert outcome.save_reason is SaveReason.ALL_RANKS_LOST


async def test_eight_unequal_ranks_calibrate_to_their_speeds_and_barely_idle(
    autojump_clock: MockClock,
) -> None:
    speeds = [1.0 + 1.5 * i / 7 for i in range(8)]  # 1.0 ... 2.5x
    scripts = [RankScript(ms_per_batch=25.0 / s, collective_ms=1.0) for s in speeds]
    # Counts are whole batches: a rank whose count rounds down waits up to half a batch at
    # each window's end. Windows of 20 slow batches keep that under 5%; at the default 10 it
    # is 3-6% here, and the anchor does not grow for it (only the average counts as overhead).
    config = CoordinatorConfig(anchor=20)
    async with open_cluster(
        scripts, dataset_size=200_000, batch_size=10, epochs=1, config=config
    ) as cluster:
        machine = cluster.coordinator.machine
        # Let ElChe calibrate, then measure idle over a later stretch of windows.
        await cluster.until(lambda: machine.cycle.round >= 8)
        counts = machine.counts()
        idle0 = [r.record.idle_s for r in cluster.ranks]
        t0 = cluster.elapsed()
        await cluster.until(lambda: machine.cycle.round >= 20)
        idle = [r.record.idle_s - i for r, i in zip(cluster.ranks, idle0, strict=True)]
        elapsed = cluster.elapsed() - t0
        cluster.coordinator.request_stop(save=False)
        await cluster.coordinator.wait_finished()
    slow = counts[0]
    for rank, speed in enumerate(speeds):
        expected = slow * speed
        assert abs(counts[rank] - expected) <= max(0.05 * expected, 1.0), (rank, counts)
    for rank in range(8):
        assert idle[rank] / elapsed < 0.05, (rank, idle[rank] / elapsed)


async def test_a_rank_lying_about_its_id_is_dropped_and_honest_ranks_go_on(
    autojump_clock: MockClock,
) -> None:
    scripts = [RankScript(ms_per_batch=10), RankScript(ms_per_batch=10, start_after=1.0)]
    async with open_cluster(scripts, dataset_size=400, batch_size=10) as cluster:
        # An impostor takes rank 1 first and then reports batches as rank 0.
        stream = await connect(cluster.url)
        channel = await connect_rank(stream, TEST_KEY, 1, 2)
        lie = Batch(rank=0, batch_ms=1.0, data_ms=0.0, step_count=1, batch_loss=0.5)
        assert isinstance(await channel.receive(), RunSettings)  # the first message, always
        await channel.send(lie)
        with pytest.raises((ChannelClosed, BrokenChannel)):
            await channel.receive()
        await stream.aclose()
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.COMPLETED
    ((rank, error),) = cluster.coordinator.rank_errors
    assert rank == 1 and isinstance(error, ProtocolError)
    assert "claiming to be rank 0" in str(error)
    assert all(isinstance(r.record.ended_by, Shutdown) for r in cluster.ranks)


async def test_a_restarted_rank_rejoins_at_the_next_round(autojump_clock: MockClock) -> None:
    scripts = [*fast(2), RankScript(ms_per_batch=10, die_after_batches=7, rejoin_after=0.5)]
    async with open_cluster(scripts, dataset_size=6000, batch_size=10) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.COMPLETED
    reformed = events(cluster, EventKind.GROUP_REFORMED)
    assert [e["members"] for e in reformed] == [[0, 1], [0, 1, 2]]
    rejoined = [e for e in events(cluster, EventKind.RANK_JOINED) if e.get("rejoin")]
    assert [e["rank"] for e in rejoined] == [2]
    # It rejoined at a round boundary after its restart, and trained again afterwards.
    assert float(reformed[1]["time"]) >= float(rejoined[0]["time"])  # type: ignore[arg-type]
    comeback = cluster.ranks[2]
    assert comeback.lives == 2 and comeback.record.batches > 0
    assert comeback.record.syncs >= 1
    samples = Counter(s for rank in cluster.ranks for s in rank.record.samples)
    assert len(samples) == 6000 and set(samples.values()) == {1}
    assert cluster.coordinator.machine.members == (0, 1, 2)


@pytest.mark.parametrize("restart_s", [0.0, 0.05])
async def test_a_rank_restarted_within_the_window_it_died_in_rejoins_and_the_run_goes_on(
    autojump_clock: MockClock, restart_s: float
) -> None:
    # Rank 2 dies 5 batches into a 10-batch window and is back before the survivors end it
    # (a warm restart): the group grows at the window's end, and the joiner, handed nothing in
    # that window by its new process, must not be waited for as if its old one's batches were
    # still to come.
    scripts = [
        *fast(2, ms=27.0),
        RankScript(ms_per_batch=27.0, die_after_batches=15, rejoin_after=restart_s),
    ]
    async with open_cluster(scripts, dataset_size=1440, batch_size=16, epochs=4) as cluster:
        with trio.fail_after(600):  # a run that waits for the joiner never ends
            outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.COMPLETED
    reformed = events(cluster, EventKind.GROUP_REFORMED)
    assert [e["members"] for e in reformed] == [[0, 1], [0, 1, 2]]
    comeback = cluster.ranks[2]
    assert comeback.lives == 2 and comeback.record.batches > 15  # it trained after it came back
    samples = Counter(s for rank in cluster.ranks for s in rank.record.samples)
    assert len(samples) == 4 * 1440 and set(samples.values()) == {1}


@pytest.mark.parametrize(("cap_epochs", "expected_total"), [(1.0, 20), (3.0, 60), (None, 60)])
async def test_window_cap_is_one_epoch_by_default_and_a_setting(
    autojump_clock: MockClock, cap_epochs: float | None, expected_total: int
) -> None:
    # 20 batches per epoch; two equal ranks at anchor 30 want 60 batches per window.
    config = CoordinatorConfig(anchor=30, window_cap_epochs=cap_epochs)
    async with open_cluster(fast(2), dataset_size=200, batch_size=10, epochs=6, config=config) as c:
        await c.coordinator.wait_finished()
        counts = c.coordinator.machine.counts()
    assert sum(counts.values()) == expected_total


async def test_throttled_run_with_unequal_ranks_completes(autojump_clock: MockClock) -> None:
    # A rank more than max_batch_diff batches ahead is throttled (and exempt from the count
    # trigger), so the window must still close, and every sample still be trained once.
    scripts = [RankScript(ms_per_batch=10), RankScript(ms_per_batch=30)]
    config = CoordinatorConfig(max_batch_diff=2)
    async with open_cluster(scripts, dataset_size=2000, batch_size=10, config=config) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.COMPLETED
    assert events(cluster, EventKind.SYNC_END)
    assert sum(r.record.count(Throttle) for r in cluster.ranks) >= 1
    samples = Counter(s for rank in cluster.ranks for s in rank.record.samples)
    assert len(samples) == 2000 and set(samples.values()) == {1}


@pytest.mark.parametrize("relax_up", [False, True])
async def test_relax_up_grows_the_anchor_by_one_per_stable_round(
    autojump_clock: MockClock, relax_up: bool
) -> None:
    # NoGuard judges every round stable; the overhead target is far above what a window's
    # fill batch costs, so auto-tune never grows the anchor: only relax_up can.
    config = CoordinatorConfig(
        guard="none", relax_up=relax_up, overhead_target=0.5, window_cap_epochs=None
    )
    async with open_cluster(fast(2), dataset_size=20_000, batch_size=10, config=config) as c:
        machine = c.coordinator.machine
        await c.until(lambda: machine.cycle.round >= 6)
        anchor, rounds = machine.elche.anchor, machine.cycle.round
        c.coordinator.request_stop(save=False)
        await c.coordinator.wait_finished()
    # Round 1 aligns the parameters and closes no window; each later one judges the window
    # it closes as it starts.
    assert anchor == (10 + rounds - 1 if relax_up else 10)


@pytest.mark.parametrize("freeze_heap", [False, True])
async def test_a_coordinator_that_owns_its_process_freezes_the_heap_while_training(
    autojump_clock: MockClock, freeze_heap: bool
) -> None:
    assert gc.get_freeze_count() == 0
    frozen: list[int] = []
    async with open_cluster(fast(2), dataset_size=400, freeze_heap=freeze_heap) as cluster:
        await cluster.coordinator.wait_finished()
        frozen.append(gc.get_freeze_count())
        assert cluster.coordinator.heap_frozen is freeze_heap
    assert (frozen[0] > 0) is freeze_heap
    assert gc.get_freeze_count() == 0  # unfrozen when the coordinator closed


async def test_a_world_larger_than_a_flush_chunk_gets_every_message_in_order(
    autojump_clock: MockClock,
) -> None:
    # Round starts to more than FLUSH_CHUNK ranks are written over several scheduler steps by
    # the flush task; every rank must still get its work, SyncNow and Shutdown, in order.
    world = FLUSH_CHUNK + 44
    async with open_cluster(fast(world), dataset_size=world * 40, batch_size=2) as cluster:
        outcome = await cluster.coordinator.wait_finished()
        await cluster.wait_ranks_done()
    assert outcome.status is Status.COMPLETED
    samples = Counter(s for rank in cluster.ranks for s in rank.record.samples)
    assert len(samples) == world * 40 and set(samples.values()) == {1}
    assert all(isinstance(rank.record.ended_by, Shutdown) for rank in cluster.ranks)
    assert cluster.coordinator.machine.cycle.round >= 3


async def test_a_rank_that_never_reads_is_disconnected_once_its_outbox_is_full(
    autojump_clock: MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # A rank that sends heartbeats but never reads gets one coordinator beat per second; once
    # OUTBOX_LIMIT of them are queued it is let go, with one warning (not one per message).
    config = CoordinatorConfig(join_timeout=3 * OUTBOX_LIMIT)
    async with open_coordinator("memory://outbox-full", 2, TEST_KEY, config, linger=0) as coord:
        stream = await connect(coord.url)
        channel = await connect_rank(stream, TEST_KEY, 0, 2)
        with caplog.at_level(logging.WARNING, logger="flodl.coordinator"):
            with pytest.raises((ChannelClosed, BrokenChannel)):
                for _ in range(2 * OUTBOX_LIMIT):
                    await channel.send(Heartbeat(rank=0, step_count=0))
                    await trio.sleep(1.0)
        await stream.aclose()
    warnings = [r.getMessage() for r in caplog.records if "cannot keep up" in r.getMessage()]
    assert warnings == [f"rank 0 cannot keep up ({OUTBOX_LIMIT} messages queued): disconnecting"]
