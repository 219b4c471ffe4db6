"""Resuming a run: the coordinator's side of a checkpoint, what to resume from, and ElChe fitted
to the resumed world (:func:`elche_for_world`, which lives in :mod:`flodl.core.cadence.elche` so the
coordinator core can use it).

Ranks save their own bundles under ``<run_dir>/checkpoints/rank<N>/`` (model + optimizer,
:mod:`flodl.worker.persist`). The coordinator's state (ElChe, guard, epoch, global step, sync
round) is written beside them as ``<run_dir>/checkpoints/coordinator.meta.json`` when a run
ends. ``flodl run --resume PATH`` reads both: every rank loads the same model bundle (the newest
complete one, by global step), and the coordinator restores ElChe fitted to the new world size.
A bundle newer than the coordinator's meta (ranks save their own when their coordinator dies,
see :class:`~flodl.core.rank.effects.SaveOnLoss`) is resumed from its own meta: its epoch,
global step and round, with ElChe calibrated afresh.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import attrs

from flodl.checkpoint.bundle import find_latest
from flodl.checkpoint.files import write_atomically
from flodl.checkpoint.meta import CheckpointMeta
from flodl.core.cadence.elche import elche_for_world
from flodl.core.coordinator.machine import ResumeState
from flodl.errors import CheckpointError

__all__ = [
    "COORDINATOR_META",
    "ResumePlan",
    "checkpoints_dir",
    "elche_for_world",
    "plan_resume",
    "save_coordinator_meta",
]

COORDINATOR_META = "coordinator.meta.json"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_coordinator_meta(run_dir: Path, meta: dict[str, Any]) -> Path:
    """Write the coordinator's meta (``CoordinatorMachine.checkpoint_meta()``) atomically."""
    full = CheckpointMeta.from_coordinator(meta, created_unix=time.time())
    path = checkpoints_dir(run_dir) / COORDINATOR_META
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(full.to_json(), indent=2).encode())
    return path


@attrs.frozen
class ResumePlan:
    """What a resumed run starts from."""

    bundle: Path
    """The model bundle every rank loads."""
    state: ResumeState
    """Where the coordinator starts (epoch, global step, round, ElChe)."""


def plan_resume(path: Path) -> ResumePlan:
    """Find the bundle and coordinator meta to resume from ``path`` (a run dir or its
    ``checkpoints`` dir). Raises CheckpointError naming what is missing."""
    base = path if path.name == "checkpoints" else checkpoints_dir(path)
    if not base.is_dir():
        raise CheckpointError(f"nothing to resume in {path}: no {base} directory")
    bundles = []
    for rank_dir in sorted(base.glob("rank*")):
        latest = find_latest(rank_dir)
        if latest is not None:
            bundles.append((_global_step(latest), latest))
    if not bundles:
        raise CheckpointError(f"no complete checkpoint bundle under {base}")
    # Newest first; among equals, the lowest rank (sorted order) wins.
    best_step = max(step for step, _ in bundles)
    bundle = next(p for step, p in bundles if step == best_step)
    meta_path = base / COORDINATOR_META
    meta = _read_meta(meta_path) if meta_path.exists() else None
    if meta is None or meta.global_step < best_step:
        # The coordinator died before it could write its meta (or wrote it for an earlier
        # point): the bundle's own meta says where the run stood; ElChe starts afresh.
        meta = _read_meta(bundle.parent / f"{bundle.name}.meta.json")
        state = ResumeState(
            epoch=meta.epoch, global_step=meta.global_step, sync_round=meta.sync_round
        )
    else:
        state = ResumeState(
            epoch=meta.epoch,
            global_step=meta.global_step,
            sync_round=meta.sync_round,
            elche_state=meta.elche_state,
        )
    return ResumePlan(bundle=bundle, state=state)


def _read_meta(path: Path) -> CheckpointMeta:
    try:
        return CheckpointMeta.from_json(json.loads(path.read_text()))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from None


def _global_step(stem_path: Path) -> int:
    meta_file = stem_path.parent / f"{stem_path.name}.meta.json"
    try:
        return int(json.loads(meta_file.read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1
