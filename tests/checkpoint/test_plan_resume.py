"""What a resume starts from: the newest bundle, and the coordinator's meta only when it
describes that bundle's point (ranks save their own bundles when their coordinator dies)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl.checkpoint.resume import plan_resume, save_coordinator_meta
from flodl.worker.persist import SavePoint, save_rank_bundle

torch = pytest.importorskip("torch")


def _save(run_dir: Path, rank: int, step: int, epoch: int, reason: str | None) -> Path:
    model = torch.nn.Linear(2, 2)
    point = SavePoint(epoch=epoch, global_step=step, sync_round=3, world_size=2, reason=reason)
    return save_rank_bundle(run_dir, rank, model, None, point)


def _coordinator_meta(step: int, epoch: int) -> dict[str, object]:
    return {
        "schema_version": 3,
        "epoch": epoch,
        "global_step": step,
        "sync_round": 9,
        "world_size_at_save": 2,
        "save_reason": None,
        "elche_state": {"anchor": 0},
        "guard_state": None,
    }


def test_bundles_newer_than_the_coordinators_meta_resume_from_their_own(tmp_path: Path) -> None:
    save_coordinator_meta(tmp_path, _coordinator_meta(step=40, epoch=1))
    _save(tmp_path, 0, 40, 1, None)
    lost = _save(tmp_path, 1, 90, 3, "COORDINATOR_LOST")
    plan = plan_resume(tmp_path)
    assert plan.bundle == lost
    state = plan.state
    assert (state.epoch, state.global_step, state.sync_round) == (3, 90, 3)
    assert state.elche_state is None  # calibrated afresh


def test_without_any_coordinator_meta_the_bundle_says_where_the_run_stood(tmp_path: Path) -> None:
    _save(tmp_path, 0, 12, 2, "COORDINATOR_LOST")
    state = plan_resume(tmp_path).state
    assert (state.epoch, state.global_step) == (2, 12)


def test_a_coordinator_meta_at_the_bundles_point_is_used(tmp_path: Path) -> None:
    save_coordinator_meta(tmp_path, _coordinator_meta(step=40, epoch=2))
    _save(tmp_path, 0, 40, 1, None)
    state = plan_resume(tmp_path).state
    assert (state.epoch, state.sync_round, state.elche_state) == (2, 9, {"anchor": 0})
