"""Smoke run of the coordinator scale bench, ``python -m bench.scale`` (both modes, 8 ranks,
2 s), and checks of its parts: send stamps, clocks, the simulated rank around its RankMachine,
rank partitions, and that load-generator processes are always reaped."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import pytest
import trio

from flodl.wire.codec import FrameDecoder, FrameEncoder
from flodl.wire.messages import (
    Batch,
    Batches,
    Heartbeat,
    JoinResult,
    Message,
    Metrics,
    NewGroupReady,
    NewGroupSession,
    Ready,
    RequestNewGroup,
    SaveReason,
    ShutdownWithSave,
    StartEpoch,
    SyncAck,
    SyncNow,
)

ROOT = Path(__file__).resolve().parents[2]


def load_bench(part: str) -> ModuleType:
    """The bench's module ``bench.scale.<part>``, as ``python -m bench.scale`` from the
    repository root imports it. By name at run time: mypy checks bench/scale/ as the package
    ``scale`` (bench/ is no package), and a static import would show it the files twice."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"bench.scale.{part}")


def test_nearest_rank_quantiles() -> None:
    bench = load_bench("record")
    samples = [0.004, 0.001, 0.003, 0.002]  # sorted: 1, 2, 3, 4 ms
    assert bench.quantile(sorted(samples), 0.50) == 0.002  # ceil(0.5 * 4) = 2nd
    assert bench.quantile(sorted(samples), 0.99) == 0.004  # ceil(0.99 * 4) = 4th
    assert bench.summarize_ms(samples) == {
        "count": 4,
        "p50_ms": 2.0,
        "p99_ms": 4.0,
        "max_ms": 4.0,
    }


def test_ticks_stay_on_the_rank_grid() -> None:
    bench = load_bench("ranks")
    assert bench._next_grid_tick(1.0, 0.03, 0.1) == pytest.approx(1.03)
    assert bench._next_grid_tick(1.03, 0.03, 0.1) == pytest.approx(1.13)  # strictly after
    assert bench._next_grid_tick(0.0, 0.05, 0.1) == pytest.approx(0.05)


def test_send_stamps_round_trip_through_the_fields_the_machine_ignores() -> None:
    bench = load_bench("stamps")
    key = b"stamp-test-key-0123456789abcdef!"
    at = 123456.789012
    sent = [
        Batch(rank=3, batch_ms=100.0, data_ms=0.0, step_count=7, batch_loss=1.0),
        Heartbeat(rank=1, step_count=5),
        Metrics(
            rank=1, epoch=0, avg_loss=1.0, batches_processed=4, samples_processed=4, epoch_ms=1.0
        ),
        SyncAck(rank=2, round=4, step_count=9),
        Ready(rank=0, dataset_size=10, batch_size=1, epochs=1),
        NewGroupReady(rank=0, generation=1, info=b"x"),
    ]
    # The generator's frames, decoded as the coordinator decodes them (MAC and sequence checked).
    decoder = FrameDecoder(key)
    decoder.feed(bench.stamped_frames(FrameEncoder(key), sent, at))
    batch, heartbeat, metrics, ack, *unstamped = decoder
    assert isinstance(batch, Batch) and isinstance(heartbeat, Heartbeat)
    assert isinstance(metrics, Metrics) and isinstance(ack, SyncAck)
    assert batch.batch_loss == at
    # Everything the machine acts on is unchanged.
    assert (batch.rank, batch.step_count, batch.batch_ms) == (3, 7, 100.0)
    assert heartbeat.step_count == 123456789012  # whole microseconds
    assert bench.stamp_of(heartbeat) == pytest.approx(at, abs=1e-6)
    assert bench.stamp_of(metrics) == at
    assert (metrics.epoch, metrics.batches_processed, metrics.epoch_ms) == (0, 4, 1.0)
    assert (ack.round, ack.step_count, ack.divergence, ack.pre_norm) == (4, 9, None, at)
    assert unstamped == sent[4:]
    for message in unstamped:
        assert bench.stamp_of(message) is None


async def test_a_simulated_rank_is_its_machine_on_the_grid() -> None:
    bench = load_bench("ranks")
    ticks: list[float] = []
    loop = bench.RankLoop(0, 1, 0.05, load_bench("record").Recorder(1), ticks.append)
    now = trio.current_time()

    def kinds(messages: list[Message]) -> list[str]:
        return [type(message).__name__ for message in messages]

    (ready,) = loop.start(now)
    assert ready == Ready(rank=0, dataset_size=10**9, batch_size=1, epochs=1)
    (group,) = loop.receive(RequestNewGroup(generation=1, world_size=1), now)
    assert group == NewGroupReady(rank=0, generation=1, info=b"sim")
    session = NewGroupSession(generation=1, new_rank=0, new_world_size=1, info=b"")
    assert loop.receive(session, now) == [JoinResult(rank=0, generation=1, joined=True)]
    # Waiting at the barrier: SyncNow is acked on receipt.
    assert kinds(loop.receive(SyncNow(round=1, generation=1), now)) == ["SyncAck"]
    # Work: the batch handed out finishes at the rank's next grid tick. Its reports are held
    # (coalescing, as the worker does), so the loop asks to be woken at the last batch only.
    first = bench._next_grid_tick(now, 0.05, 0.1)
    assert loop.receive(StartEpoch(epoch=0, partition_offset=0, partition_size=2), now) == []
    assert ticks == [pytest.approx(first + 0.1)]
    # In the middle of a batch SyncNow waits for the next boundary: a wake there, where the
    # held report goes out before the ack.
    assert loop.receive(SyncNow(round=2, generation=1), now) == []
    assert ticks[-1] == first
    batches, ack = loop.tick(first)
    assert isinstance(batches, Batches) and isinstance(ack, SyncAck)
    assert (batches.step_count, len(batches.batch_ms), ack.round, ack.step_count) == (2, 1, 2, 3)
    # The work runs dry: the last report and the chunk's Metrics, then the rank waits (woken
    # at the last batch's own grid time, which float rounding may put just past first + 0.1).
    assert ticks[-1] == pytest.approx(first + 0.1)
    batches, metrics = loop.tick(ticks[-1])
    assert isinstance(batches, Batches) and batches.batch_ms == pytest.approx((100.0,))
    assert isinstance(metrics, Metrics) and metrics.batches_processed == 2
    # Frames went out since the last beat: this one is skipped, the next is a Heartbeat.
    assert loop.heartbeat(first + 0.2) == []
    assert loop.heartbeat(first + 1.2) == [Heartbeat(rank=0, step_count=4)]
    # A rank waiting for work says goodbye on ShutdownWithSave, and is done.
    goodbye = loop.receive(ShutdownWithSave(reason=SaveReason.GRACEFUL), first + 1.2)
    assert kinds(goodbye) == ["CheckpointResult", "Note", "Exiting"]  # nothing saved, said so
    assert loop.over and loop.heartbeat(first + 2.2) == []


@pytest.mark.skipif(sys.platform != "linux", reason="CLOCK_MONOTONIC is system-wide on Linux")
def test_perf_counter_is_the_monotonic_clock_and_trio_offsets_it() -> None:
    bench = load_bench("stamps")
    assert bench.clock_check() == {
        "perf_counter": "clock_gettime(CLOCK_MONOTONIC)",
        "monotonic": "clock_gettime(CLOCK_MONOTONIC)",
    }

    async def offset_error() -> float:
        offset: float = bench.trio_clock_offset()
        now = time.perf_counter()
        return abs((trio.current_time() - offset) - now)

    assert trio.run(offset_error) < 1e-3


def test_ranks_split_into_contiguous_near_equal_parts() -> None:
    bench = load_bench("generator")
    assert bench.partition_ranks(10, 1) == [range(0, 10)]
    assert bench.partition_ranks(10, 3) == [range(0, 3), range(3, 6), range(6, 10)]
    assert bench.partition_ranks(2, 3) == [range(0, 1), range(1, 2)]  # no empty generator


async def test_a_generator_that_cannot_connect_fails_the_run_and_is_reaped() -> None:
    bench = load_bench("generator")
    with tempfile.TemporaryDirectory() as folder:
        nobody = f"unix://{folder}/nobody.sock"
        processes: list[trio.Process] = []
        early = pytest.RaisesExc(RuntimeError, match="exited early with code 1")
        with pytest.RaisesGroup(early, flatten_subgroups=True):
            async with bench.open_generators(nobody, 2, 0, 1, None) as children:
                processes += [child.process for child in children]
                await trio.sleep_forever()
    (process,) = processes
    assert process.returncode == 1


async def test_a_stuck_generator_is_killed_when_the_run_is_cancelled() -> None:
    bench = load_bench("generator")
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/silent.sock"
        silent = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await silent.bind(path)
        silent.listen(8)  # connections queue, but nobody answers the handshake
        processes: list[trio.Process] = []
        with silent, trio.move_on_after(1.0) as scope:
            async with bench.open_generators(f"unix://{path}", 2, 0, 1, None) as children:
                processes += [child.process for child in children]
                await trio.sleep_forever()
    assert scope.cancelled_caught
    (process,) = processes
    assert process.returncode == -9  # killed, and reaped (returncode is known)


def test_both_modes_with_eight_ranks_for_two_seconds(tmp_path: Path) -> None:
    output = tmp_path / "coordinator.json"
    command = [sys.executable, "-m", "bench.scale", "--ranks", "8", "--seconds", "2", "--output"]
    done = subprocess.run(
        [*command, str(output)], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(output.read_text())
    # Every connection ended cleanly but the killed rank's: the coordinator may write to it
    # (say ExtendPartition) before it reads the close, and logs that send's broken pipe.
    killed = result["modes"]["split"]["counts"][0]["membership_change"]["killed_rank"]
    disconnects = [line for line in done.stderr.splitlines() if "disconnected" in line]
    assert all(line.startswith(f"rank {killed} disconnected") for line in disconnects), disconnects
    assert set(result["modes"]) == {"split", "inprocess"}
    split, inprocess = result["modes"]["split"], result["modes"]["inprocess"]
    for section in (split, inprocess):
        assert section["environment"]["cpu_count"] >= 1
        assert "on_message" in section["latency_definition"]
        (row,) = section["counts"]
        assert row["ranks"] == 8
        # Every message the machine processed had its send time.
        assert row["latency"]["count"] == row["messages"] == sum(row["messages_by_kind"].values())
        lat = row["latency"]
        assert 0.0 <= lat["p50_ms"] <= lat["p99_ms"] <= lat["max_ms"]
        # 8 ranks x 2 s: at most 10 batch reports/s each (a grid tick may straddle the
        # window's ends, and held reports from before it come in it) and at least 60% of that
        # (barrier waits; a busy CI machine measured 69%). Coalesced: no Batch frame, and fewer
        # frames than reports; every rank sends some frame at least every two heartbeat
        # intervals.
        assert 96 <= row["batch_reports"] <= 200
        for kinds in (row["messages_by_kind"], row["offered_by_kind"]):
            assert "Batch" not in kinds
            assert 8 <= kinds["Batches"] + kinds.get("Heartbeat", 0) < row["batch_reports"]
        assert row["cpu_us_per_rank_s"] > 0
        assert row["nominal_messages_per_s"] == 88
        assert row["rounds_started"] >= 2  # warm-up waits for round 2
        assert row["cpu_us_per_message"] > 0
        assert section["max_ranks_meeting_target"] == (8 if row["meets_target"] else 0)
        assert section["cpu_us_per_message"] == row["cpu_us_per_message"]
    (in_row,) = inprocess["counts"]
    assert in_row["unmatched_messages"] == 0
    assert 8 <= in_row["sent_to_ranks_by_kind"]["CoordHeartbeat"] <= 24
    (split_row,) = split["counts"]
    assert split_row["unstamped_messages"] == 0
    regroup = split_row["membership_change"]  # rank 4 killed after the window
    assert regroup["committed"] and regroup["killed_rank"] == 4
    assert regroup["members_after"] == 7 and 0 <= regroup["decision_s"] < 5.0
    assert split_row["verdict"] in {"meets", "misses", "generator_limited"}
    (generator,) = split_row["generators"]
    assert (generator["first_rank"], generator["ranks"]) == (0, 8)
    assert generator["sent_by_kind"] == split_row["offered_by_kind"]
    assert 8 <= generator["received_by_kind"]["CoordHeartbeat"] <= 24
    assert generator["lag"]["count"] > 0
    if split["pinning"].startswith("os.sched_setaffinity"):  # the coordinator has a core alone
        assert 0 < len(generator["cores"]) < split["environment"]["usable_cores"]
    with pytest.raises(ProcessLookupError):  # the bench reaped its generator
        os.kill(generator["pid"], 0)
    # The headline keys: split mode for the keys, the in-process figures alongside.
    assert result["max_ranks_meeting_target"] == split["max_ranks_meeting_target"]
    assert result["cpu_us_per_message"] == split_row["cpu_us_per_message"]
    assert result["inprocess_max_ranks_meeting_target"] == inprocess["max_ranks_meeting_target"]
    assert result["inprocess_cpu_us_per_message"] == in_row["cpu_us_per_message"]
    assert (
        result["inprocess_coordinator_cpu_us_per_message"]
        == (in_row["coordinator_cpu_us_per_message"])
    )


def test_the_agents_layout_carries_every_rank_through_its_host(tmp_path: Path) -> None:
    output = tmp_path / "coordinator.json"
    command = [sys.executable, "-m", "bench.scale", "--mode", "agents", "--agent-ranks", "16"]
    done = subprocess.run(
        [*command, "--per-host", "4", "--seconds", "2", "--output", str(output)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(output.read_text())
    assert set(result["modes"]) == {"agents"}
    section = result["modes"]["agents"]
    assert section["per_host"] == 4
    (row,) = section["counts"]
    assert row["layout"] == "4 agents x 4 ranks"
    # The ranks' own messages reach the machine through their agents, each with its send time.
    assert row["unstamped_messages"] == 0
    assert row["latency"]["count"] == row["messages"] == sum(row["messages_by_kind"].values())
    assert 16 * 2 * 6 <= row["batch_reports"] <= 16 * 2 * 10 * 1.25  # as for 8 ranks above
    (generator,) = row["generators"]
    assert generator["sent_by_kind"] == row["offered_by_kind"]
    # Rank 8 (node 2) killed, reported by its agent: the group re-forms without it alone.
    regroup = row["membership_change"]
    assert regroup["committed"] and regroup["killed_rank"] == 8 and regroup["members_after"] == 15
    # Then node 1's agent killed: its four ranks are gone together.
    lost = row["host_loss"]
    assert lost["committed"] and (lost["killed_node"], lost["ranks_lost"]) == (1, 4)
    assert lost["members_after"] == 11 and lost["kill_to_all_dead_s"] is not None


def test_a_count_that_could_not_warm_up_is_a_row_saying_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = load_bench("report")
    stuck = RuntimeError("16384 ranks: no warm-up within 448 s (phase joining, 11322 connected)")
    row = bench.failed_row(16384, ExceptionGroup("nursery", [ExceptionGroup("inner", [stuck])]))
    assert row["verdict"] == "no_warmup" and not row["meets_target"]
    assert row["error"] == f"RuntimeError: {stuck}"  # the one error inside the groups
    bench.print_table("agents", [row], header=False)
    assert "16384 not measured: RuntimeError: 16384 ranks: no warm-up" in capsys.readouterr().out
    section = bench.mode_section("agents", [row], 10.0, 0)
    assert section["max_ranks_meeting_target"] == 0 and section["cpu_us_per_message"] is None
