"""What a run's summary may claim it saved, checked against real bundles on disk: a completed
run's final bundles (a rank whose disk refused its final save is named, with its error), and a
rank's own bundle saved on losing its coordinator."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import attrs
import torch

from flodl.checkpoint import CheckpointMeta, save_bundle
from flodl.checkpoint.meta import LOSS_REASON
from flodl.coordinator.signals import StopSignals
from flodl.core.coordinator.ending import Outcome, Status
from flodl.core.coordinator.timeline import EventKind, Timeline
from flodl.launch.exit_status import run_succeeded
from flodl.launch.saves import account_saves
from flodl.wire.messages import SaveReason

FULL_DISK = "could not write checkpoint ...: [Errno 28] No space left on device"


@attrs.define
class Record:
    """What account_saves reads of the coordinator's machine."""

    outcome: Outcome
    global_step: int = 100
    timeline: Timeline = attrs.field(factory=Timeline)
    lost: frozenset[int] = frozenset()
    members: tuple[int, ...] = (0, 1)
    stats: list[Any] = attrs.field(factory=list)
    """Per rank, when it joined and was lost (``joined_at``, ``lost_at``)."""

    def lost_ranks(self) -> frozenset[int]:
        return self.lost


@attrs.define
class Spawned:
    """A rank process as the launcher keeps it (the parts account_saves reads)."""

    rank: int
    started_unix: float = attrs.field(factory=lambda: time.time() - 60)
    exit_code: int | None = 0


def save(run_dir: Path, rank: int, step: int, reason: str) -> Path:
    meta = CheckpointMeta(
        epoch=1,
        global_step=step,
        sync_round=4,
        world_size_at_save=2,
        save_reason=reason,
        elche_state=None,
        guard_state=None,
        created_unix=time.time(),
        flodl_version="test",
    )
    state = {"w": torch.ones(3)}
    directory = run_dir / "checkpoints" / f"rank{rank}"
    return save_bundle(directory, f"s{step}", model_state=state, optimizer_state=None, meta=meta)


def account(record: Record, run_dir: Path, ranks: int = 2) -> Any:
    spawned: Any = [Spawned(rank) for rank in range(ranks)]
    return account_saves(record, spawned, run_dir, StopSignals())  # type: ignore[arg-type]


def completed(**fields: Any) -> Record:
    """A completed run that trained (its group formed)."""
    record = Record(Outcome(Status.COMPLETED, None, "all epochs done"), **fields)
    record.timeline.add(0.5, EventKind.TRAINING_STARTED, members=list(record.members))
    return record


def test_a_completed_run_names_the_rank_whose_final_save_failed(tmp_path: Path) -> None:
    record = completed()
    kept = save(tmp_path, 0, 100, SaveReason.CHECKPOINT.name)
    save(tmp_path, 1, 60, SaveReason.CHECKPOINT.name)  # an older periodic bundle only
    record.timeline.add(9.0, EventKind.CHECKPOINT_SAVED, rank=1, version=3, error=FULL_DISK)
    saves = account(record, tmp_path)
    assert saves.status == "completed"
    assert saves.bundles == {0: str(kept), 1: None}
    assert saves.missing == {1: FULL_DISK}
    assert saves.message == "all epochs done; the final bundle saved by rank 0; not by rank 1"
    summary = {"status": "completed", "saved": saves.to_json(), "ranks": []}
    assert run_succeeded(summary)  # the trained model is on disk, on rank 0


def test_a_completed_run_whose_final_bundle_no_rank_saved_did_not_do_its_work(
    tmp_path: Path,
) -> None:
    record = completed()
    saves = account(record, tmp_path)
    assert saves.missing == {0: "no final bundle written", 1: "no final bundle written"}
    assert "saved by no rank: the model is lost" in saves.message
    summary = {"status": "completed", "saved": saves.to_json(), "ranks": []}
    assert not run_succeeded(summary)


def test_only_the_group_at_the_end_of_a_run_that_trained_owes_a_final_bundle(
    tmp_path: Path,
) -> None:
    save(tmp_path, 0, 100, SaveReason.CHECKPOINT.name)
    # Rank 1 was lost; rank 2 came back as the run ended, too late to be in its group.
    record = completed(lost=frozenset({1}), members=(0, 1))
    saves = account(record, tmp_path, ranks=3)
    assert saves.missing == {} and saves.message == "all epochs done"
    # A script that never joined flodl: nothing trained, nothing owed.
    plain = Record(Outcome(Status.COMPLETED, None, "every rank exited 0"))
    assert account(plain, tmp_path / "plain").missing == {}


def test_a_bundle_saved_on_losing_the_coordinator_counts_as_saved(tmp_path: Path) -> None:
    record = Record(Outcome(Status.SAVED, SaveReason.SINGLE_SURVIVOR, "silent"))
    joined = attrs.make_class("Stats", {"joined_at": attrs.field(), "lost_at": attrs.field()})
    record.stats = [joined(0.0, None), joined(0.0, None)]
    record.timeline.add(1.0, EventKind.SAVE_REQUESTED, reason="SINGLE_SURVIVOR", why="silent")
    save(tmp_path, 0, 90, LOSS_REASON)
    save(tmp_path, 1, 90, SaveReason.SINGLE_SURVIVOR.name)
    saves = account(record, tmp_path)
    assert saves.status == "saved" and saves.missing == {}
    assert saves.message == "silent; saved: ranks 0, 1 (rank 0 on losing the coordinator)"
