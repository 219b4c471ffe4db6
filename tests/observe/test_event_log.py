"""The event log of a whole scripted run: every round, the death, the re-form and the redo are
written to events.jsonl with consistent times, and the views' state folds from it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import trio
from trio.testing import MockClock

from flodl.core.coordinator.timeline import EventKind
from flodl.observe.events import EVENTS_NAME, EventLog, read_events
from flodl.observe.hub import open_observer
from flodl.testing import RankScript, open_cluster


async def observed_run(
    tmp_path: Path, scripts: list[RankScript], dataset_size: int = 2000
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``scripts`` to the end under an observer; the log's records and the final state."""
    async with open_cluster(scripts, dataset_size=dataset_size) as cluster:
        coordinator = cluster.coordinator
        async with open_observer(coordinator, tmp_path) as observer:
            await coordinator.wait_finished()
            await cluster.wait_ranks_done()
            state = observer.state()
    return read_events(tmp_path / EVENTS_NAME), state


def of(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == kind]


async def test_a_death_mid_run_is_in_the_log_with_its_regroup_and_redo(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    scripts = [
        RankScript(ms_per_batch=10),
        RankScript(ms_per_batch=17),
        RankScript(ms_per_batch=30, collective_ms=50, die_in_round=3),
    ]
    records, state = await observed_run(tmp_path, scripts)

    assert [r["seq"] for r in records] == list(range(len(records)))  # nothing dropped
    times = [r["t"] for r in records]
    assert times == sorted(times)
    assert {r["v"] for r in records} == {1}
    rounds = of(records, "SyncEnd")
    # Numbered without gaps, but for the rounds a death interrupted: their redo names them.
    numbers = sorted([r["round"] for r in rounds] + [r["redoes"] for r in rounds if r["redo"]])
    assert numbers == list(range(1, len(numbers) + 1))
    (started,) = of(records, "TrainingStarted")
    assert started["members"] == [0, 1, 2] and started["epoch_batches"] == 200
    (dead,) = of(records, "RankDead")
    assert dead["rank"] == 2 and dead["cause"] == "disconnected"
    (reformed,) = of(records, "GroupReformed")
    assert reformed["generation"] == 1 and reformed["members"] == [0, 1]
    assert reformed["t"] >= dead["t"]
    assert reformed["took_s"] == pytest.approx(reformed["t"] - dead["t"], abs=1e-5)
    # Round 3 was in flight when rank 2 died: it is redone on the survivors' group.
    (redo,) = [r for r in rounds if r["redo"]]
    assert redo["redoes"] == 3 and redo["round"] == 4 and redo["generation"] == 1
    assert 3 not in [r["round"] for r in rounds]
    (redo_start,) = [r for r in of(records, "SyncStart") if r.get("redo")]
    assert redo_start["round"] == 4 and redo_start["t"] >= reformed["t"]
    for record in rounds:
        members = ["0", "1", "2"] if record["generation"] == 0 else ["0", "1"]
        assert list(record["ranks"]) == members
    # Round times: each starts after the previous one ended; its window opened as the
    # previous round started (the window's work is handed out then), unless a redo intervened.
    for previous, record in itertools.pairwise(rounds):
        start = record["t"] - record["duration_s"]
        assert start >= previous["t"] - 1e-6
        previous_start = previous["t"] - previous["duration_s"]
        if not previous["redo"] and not record["redo"]:
            assert start - record["window_s"] == pytest.approx(previous_start, abs=1e-6)
        for facts in record["ranks"].values():
            assert 0.0 <= facts["idle_ms"] <= record["window_s"] * 1000.0 + 1e-6
            assert 0.0 <= facts["averaging_ms"] <= record["duration_s"] * 1000.0 + 1e-6
    # The batches the rounds account for are every batch the run trained, less those the dead
    # rank ran in the window of the round it died in (lost with its weights).
    trained = sum(f["batches"] for r in rounds for f in r["ranks"].values())
    (third_start,) = [r for r in of(records, "SyncStart") if r["round"] == 3]
    assert third_start["steps"][2] > 0
    assert trained == rounds[-1]["global_step"] - third_start["steps"][2]
    # The slow rank ran fewer batches than the fast one, and ElChe gave it fewer next.
    second = rounds[1]
    assert second["round"] == 2
    assert 0 < second["ranks"]["2"]["batches"] < second["ranks"]["0"]["batches"]
    assert second["next_counts"]["2"] < second["next_counts"]["0"]
    assert second["ranks"]["0"]["samples_per_s"] == pytest.approx(10 * 1000 / 10, rel=0.01)
    assert second["ranks"]["2"]["samples_per_s"] == pytest.approx(10 * 1000 / 30, rel=0.01)
    assert len(rounds) > 4  # training went on after the redo
    assert of(records, "Shutdown")
    # The state the views show, folded from the same records.
    assert state["status"] == "completed"
    assert [row["state"] for row in state["ranks"]] == ["done", "done", "dead"]
    assert state["progress"] == pytest.approx(1.0)
    assert any("rank 2 dead" in line for line in state["recent"])
    assert any("re-formed" in line for line in state["recent"])


async def test_a_full_queue_drops_and_counts_and_the_log_says_so(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    from flodl.core.coordinator.timeline import TimelineEvent
    from flodl.observe import events

    log = EventLog(tmp_path / "e.jsonl", (0.0, 1000.0))
    for seq in range(events.QUEUE_LIMIT + 5):
        log.offer(seq, TimelineEvent(seq * 0.5, EventKind.THROTTLE, {"rank": 1}))
    assert log.dropped == 5
    log.close()
    await log.run()  # everything queued is written, then the drop count
    lines = (tmp_path / "e.jsonl").read_text().splitlines()
    assert len(lines) == events.QUEUE_LIMIT + 1
    first = json.loads(lines[0])
    assert first == {"v": 1, "seq": 0, "t": 0.0, "unix": 1000.0, "kind": "Throttle", "rank": 1}
    assert json.loads(lines[-1]) == {"v": 1, "kind": "EventsDropped", "count": 5}


async def test_a_cancelled_run_still_writes_what_was_queued(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    from flodl.core.coordinator.timeline import TimelineEvent

    log = EventLog(tmp_path / "e.jsonl", (0.0, 0.0))
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(log.run)
            await trio.sleep(1)
            for seq in range(3):
                log.offer(seq, TimelineEvent(1.0, EventKind.SHUTDOWN, {"why": f"w{seq}"}))
            scope.cancel()  # before the writer ran: it is shielded until close() says so
            log.close()
    await log.finished.wait()
    assert [r["why"] for r in read_events(tmp_path / "e.jsonl")] == ["w0", "w1", "w2"]


def test_nan_and_infinity_are_written_as_null() -> None:
    from flodl.core.coordinator.timeline import TimelineEvent
    from flodl.observe.events import event_record

    event = TimelineEvent(2.0, EventKind.EPOCH_AGGREGATED, {"avg_loss": float("nan"), "x": [1e999]})
    record = event_record(4, event, (1.0, 100.0))
    assert record["avg_loss"] is None and record["x"] == [None]
    assert record["t"] == 1.0 and record["unix"] == 101.0
    json.dumps(record, allow_nan=False)


def test_reading_skips_a_last_line_cut_short_and_names_a_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    path.write_text('{"v":1,"seq":0,"kind":"A"}\n{"v":1,"seq":1,"ki')
    assert read_events(path) == [{"v": 1, "seq": 0, "kind": "A"}]
    path.write_text('{"v":1}\nnot json\n{"v":1}\n')
    with pytest.raises(ValueError, match=r"e.jsonl:2: not a JSON line"):
        read_events(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="not a JSON object"):
        read_events(path)


def test_sequence_numbers_survive_dropping_old_events() -> None:
    from flodl.core.coordinator.timeline import Timeline

    timeline = Timeline(max_events=3)
    for i in range(5):
        timeline.add(float(i), EventKind.THROTTLE, rank=i)
    assert timeline.added == 5 and timeline.dropped == 2
    assert [(seq, e.detail["rank"]) for seq, e in timeline.since(3)] == [(3, 3), (4, 4)]
    assert [seq for seq, _ in timeline.since(0)] == [2, 3, 4]  # 0 and 1 are gone
    assert timeline.since(5) == []


def test_a_long_run_keeps_its_start_and_its_deaths_with_their_recoveries() -> None:
    """Past the bound, round events go; the start, each death and the round after each stay."""
    from flodl.core.coordinator.timeline import Timeline

    timeline = Timeline(max_events=4)
    timeline.add(0.0, EventKind.TRAINING_STARTED, members=[0, 1, 2])
    timeline.add(1.0, EventKind.SYNC_END, round=1)
    timeline.add(2.0, EventKind.RANK_DEAD, rank=2)
    timeline.add(2.1, EventKind.GROUP_REFORMED, members=[0, 1])
    timeline.add(2.2, EventKind.SYNC_START, round=2)
    timeline.add(2.5, EventKind.SYNC_END, round=2)  # the death's recovery
    for step in range(3, 50):
        timeline.add(float(step), EventKind.SYNC_START, round=step)
        timeline.add(step + 0.5, EventKind.SYNC_END, round=step)
    assert timeline.added == 100 and timeline.dropped == 96
    kinds = [e.kind for e in timeline]
    assert kinds[:5] == [
        EventKind.TRAINING_STARTED,
        EventKind.SYNC_END,
        EventKind.RANK_DEAD,
        EventKind.GROUP_REFORMED,
        EventKind.SYNC_END,
    ]
    assert [e.time for e in timeline.of_kind(EventKind.SYNC_END)] == [1.0, 2.5, 48.5, 49.5]
    assert len(timeline) == 9
    assert [seq for seq, _ in timeline.since(0)] == [96, 97, 98, 99]  # the stream: recent only


async def test_a_sink_added_late_gets_the_events_so_far_then_each_new_one(
    autojump_clock: MockClock,
) -> None:
    scripts = [RankScript(ms_per_batch=10), RankScript(ms_per_batch=20)]
    early: list[int] = []
    late: list[int] = []
    async with open_cluster(scripts, dataset_size=400) as cluster:
        coordinator = cluster.coordinator
        coordinator.add_event_sink(lambda seq, event: early.append(seq))
        await trio.sleep(0.5)  # some rounds in
        coordinator.add_event_sink(lambda seq, event: late.append(seq))
        await coordinator.wait_finished()
    assert early == list(range(len(coordinator.timeline)))
    assert late == early


async def test_an_earlier_log_in_the_folder_is_set_aside_not_appended_to(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    (tmp_path / EVENTS_NAME).write_text('{"v":1,"seq":0,"kind":"Old"}\n')
    (tmp_path / "events.1.jsonl").write_text('{"v":1,"seq":0,"kind":"Older"}\n')
    records, _ = await observed_run(tmp_path, [RankScript(), RankScript()], dataset_size=200)
    assert records[0]["kind"] == "RankJoined" and records[0]["seq"] == 0
    assert read_events(tmp_path / "events.2.jsonl") == [{"v": 1, "seq": 0, "kind": "Old"}]
    assert read_events(tmp_path / "events.1.jsonl")[0]["kind"] == "Older"
