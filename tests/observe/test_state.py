"""RunView: the state the views show, folded from event records."""

from __future__ import annotations

from typing import Any

import pytest

from flodl.observe.state import RunView, describe, is_notable


def record(kind: str, t: float, **detail: Any) -> dict[str, Any]:
    return {"v": 1, "seq": 0, "t": t, "kind": kind, **detail}


def round_end(
    t: float, number: int, ranks: dict[str, dict[str, Any]], **more: Any
) -> dict[str, Any]:
    return record(
        "SyncEnd",
        t,
        round=number,
        generation=more.pop("generation", 0),
        redo=False,
        global_step=more.pop("global_step", 0),
        window_s=more.pop("window_s", 1.0),
        duration_s=more.pop("duration_s", 0.1),
        next_counts=more.pop("next_counts", None),
        ranks=ranks,
    )


def started(t: float = 0.0, members: list[int] | None = None) -> dict[str, Any]:
    return record(
        "TrainingStarted",
        t,
        dataset_size=1000,
        batch_size=10,
        epochs=2,
        first_epoch=0,
        epoch_batches=100,
        members=members or [0, 1],
        policy="cadence",
        generation=0,
    )


def test_rounds_add_up_per_rank_and_progress_and_eta_follow() -> None:
    view = RunView(2)
    view.apply(record("RankJoined", 0.0, rank=0))
    view.apply(record("RankJoined", 0.0, rank=1))
    view.apply(started(1.0))
    facts = {
        "0": {
            "batches": 30,
            "samples_per_s": 1000.0,
            "ms_per_batch": 10.0,
            "idle_ms": 100.0,
            "averaging_ms": 100.0,
            "divergence": 0.1,
        },
        "1": {
            "batches": 20,
            "samples_per_s": 500.0,
            "ms_per_batch": 20.0,
            "idle_ms": 0.0,
            "averaging_ms": 100.0,
            "divergence": 0.2,
        },
    }
    view.apply(
        round_end(
            11.0,
            2,
            facts,
            window_s=0.9,
            duration_s=0.1,
            next_counts={"0": 40, "1": 20},
            global_step=50,
        )
    )
    state = view.snapshot(now_t=11.5, heartbeat_age={0: 0.25, 1: 3.0})
    rows = state["ranks"]
    assert [r["batches"] for r in rows] == [30, 20]
    assert [r["window_batches"] for r in rows] == [40, 20]
    assert rows[0]["idle_share"] == pytest.approx(0.1)
    assert rows[1]["idle_share"] == 0.0
    assert rows[0]["averaging_share"] == pytest.approx(0.1)
    assert [r["heartbeat_age_s"] for r in rows] == [0.25, 3.0]
    assert state["samples_per_s"] == 1500.0
    assert state["progress"] == pytest.approx(50 / 200)
    assert state["eta_s"] == pytest.approx(10.0 * 3)  # 10 s for a quarter
    assert state["status"] == "training" and state["round"] == 2 and state["t"] == 11.5


def test_a_death_and_a_regroup_change_the_rows_and_are_told_in_recent() -> None:
    view = RunView(3)
    view.apply(started(0.0, [0, 1, 2]))
    view.apply(record("RankDead", 5.0, rank=2, cause="disconnected", why="connection closed"))
    view.apply(record("GroupReformed", 5.4, generation=1, members=[0, 1], took_s=0.4))
    view.apply(record("SyncStart", 5.5, round=7, redo=True, redoes=6))
    state = view.snapshot()
    assert [r["state"] for r in state["ranks"]] == ["training", "training", "dead"]
    assert state["generation"] == 1
    assert state["recent"] == [
        "5.0s rank 2 dead: connection closed",
        "5.4s group re-formed in 0.40 s: generation 1, ranks [0, 1]",
        "5.5s round 7 redoes round 6 on the re-formed group",
    ]
    view.apply(record("EpochAggregated", 8.0, epoch=0, avg_loss=0.5))
    view.apply(record("EpochAggregated", 9.0, epoch=1, avg_loss=0.25))
    view.apply(record("Shutdown", 9.5, why="all epochs done"))
    state = view.snapshot()
    assert state["progress"] == 1.0  # every epoch closed
    assert state["last_loss"] == 0.25 and state["status"] == "finished"
    assert [r["state"] for r in state["ranks"]] == ["done", "done", "dead"]


def test_a_run_that_ended_with_a_save_never_shows_its_ranks_done() -> None:
    """Its last Shutdown comes after every rank reported its bundle: the ranks stopped short
    of their epochs, which the views say ("stopped"), not "done"."""
    view = RunView(2)
    view.apply(started(0.0))
    view.apply(record("SaveRequested", 3.0, reason="GRACEFUL", why="stop requested"))
    for rank in (0, 1):
        view.apply(record("CheckpointSaved", 3.1, rank=rank, version=0, elapsed_ms=20.0))
    view.apply(record("Shutdown", 3.1, why="ended with a save (stop requested): ranks 0, 1 saved"))
    state = view.snapshot()
    assert state["status"] == "finished"
    assert [r["state"] for r in state["ranks"]] == ["training", "training"]  # shown "stopped"


def test_which_events_are_notable() -> None:
    assert is_notable(record("RankDead", 1.0, rank=1))
    assert is_notable(record("RankJoined", 1.0, rank=1, rejoin=True))
    assert not is_notable(record("RankJoined", 1.0, rank=1))
    assert not is_notable(record("SyncStart", 1.0, round=3))
    assert not is_notable(record("SyncEnd", 1.0, round=3))
    assert describe(record("CheckpointSaved", 2.0, rank=0, elapsed_ms=12.4, error=None)) == (
        "2.0s rank 0 saved in 12 ms"
    )
    assert "failed to save: disk full" in describe(
        record("CheckpointSaved", 2.0, rank=0, elapsed_ms=1.0, error="disk full")
    )


def test_unknown_kinds_and_ranks_beyond_the_world_do_not_break_the_view() -> None:
    view = RunView(1)
    view.apply(record("SomethingNew", 1.0, x=1))
    view.apply(record("RankJoined", 2.0, rank=3))
    view.apply(record("RankDead", 2.0, rank="bogus"))
    state = view.snapshot()
    assert state["events"] == 3
    assert [r["rank"] for r in state["ranks"]] == [0, 3]
