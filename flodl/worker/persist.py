"""Saving this rank's model and optimizer through :mod:`flodl.checkpoint` (no pickle).

Each rank writes its own bundle under ``<run_dir>/checkpoints/rank<N>/`` (ranks may hold
different parameters when a run stops mid-window, so none overwrites another's), with a
stem that sorts by global step. Synchronous: call it from a worker thread.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from flodl.errors import CheckpointError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@attrs.frozen
class SavePoint:
    """Where the run stood when this rank saved (goes into the bundle's meta)."""

    epoch: int
    global_step: int
    sync_round: int
    world_size: int
    reason: str | None
    """A SaveReason name, or None for a save that was not asked for by a shutdown."""


def checkpoint_dir(run_dir: Path, rank: int) -> Path:
    return run_dir / "checkpoints" / f"rank{rank}"


def save_rank_bundle(
    run_dir: Path,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    point: SavePoint,
    *,
    stem: str | None = None,
    keep: int | None = None,
    outer_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save model + optimizer state (+ the outer optimizer's, when given) + meta; return the
    bundle's path (``<dir>/<stem>``).

    With ``keep``, the bundles older than the ``keep`` newest are removed once this one is
    complete (:func:`flodl.checkpoint.prune.prune_bundles`; a removal that fails is logged).
    Raises CheckpointError if the bundle cannot be written.
    """
    try:
        from flodl.checkpoint import CheckpointMeta, save_bundle
    except ImportError as err:  # pragma: no cover - only while flodl.checkpoint is missing
        raise CheckpointError(f"flodl.checkpoint is not available: {err}") from err
    from flodl import __version__

    meta = CheckpointMeta(
        epoch=point.epoch,
        global_step=point.global_step,
        sync_round=point.sync_round,
        world_size_at_save=max(point.world_size, 1),
        save_reason=point.reason,
        elche_state=None,
        guard_state=None,
        created_unix=time.time(),
        flodl_version=__version__,
    )
    optimizer_state: dict[str, Any] | None = (
        None if optimizer is None else dict(optimizer.state_dict())
    )
    directory = checkpoint_dir(run_dir, rank)
    path = save_bundle(
        directory,
        stem or f"flodl-step{point.global_step:09d}",
        model_state=dict(model.state_dict()),
        optimizer_state=optimizer_state,
        meta=meta,
        config={"rank": rank, "world_size": point.world_size},
        outer_state=outer_state,
    )
    if keep is not None:
        from flodl.checkpoint.prune import prune_bundles

        try:
            prune_bundles(directory, keep)
        except OSError as err:
            log.warning("rank %d: could not remove old bundles in %s: %s", rank, directory, err)
    return path


def resume_source(path: Path, rank: int) -> Path:
    """Where rank ``rank`` resumes from: ``path/checkpoints/rank<N>`` when ``path`` is a run
    directory holding one, else ``path`` itself (a bundle directory, stem or meta file)."""
    candidate = checkpoint_dir(path, rank)
    return candidate if candidate.is_dir() else path


@attrs.frozen
class Restored:
    """What a resumed rank took from its bundle besides the model and optimizer."""

    global_step: int
    outer_state: dict[str, torch.Tensor]
    """The outer optimizer's tensors (empty when the bundle holds none)."""


def restore_rank_bundle(
    path: Path,
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> Restored:
    """Load this rank's newest bundle under ``path`` into ``model`` (and ``optimizer``).

    Returns the bundle's global step and outer state, which the worker gives its outer
    optimizer once the coordinator said which it runs. Raises CheckpointError when there is
    no readable bundle or its tensors do not fit the model.
    """
    from flodl.checkpoint import load_bundle

    bundle = load_bundle(resume_source(path, rank))
    try:
        model.load_state_dict(bundle.model_state)
        if optimizer is not None and bundle.optimizer_state is not None:
            optimizer.load_state_dict(bundle.optimizer_state)
    except (RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"checkpoint {bundle.path} does not fit this model: {err}") from err
    return Restored(bundle.meta.global_step, dict(bundle.outer_state))
