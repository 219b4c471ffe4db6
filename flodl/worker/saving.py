"""Saving a rank's bundle when the rank machine asks: a Checkpoint request or a save-and-stop."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import trio

from flodl.checkpoint.meta import LOSS_REASON
from flodl.core.rank.effects import RankEffect
from flodl.core.rank.machine import RankMachine
from flodl.errors import CheckpointError
from flodl.wire.messages import Checkpoint
from flodl.worker.persist import SavePoint, save_rank_bundle
from flodl.worker.records import record_death

if TYPE_CHECKING:
    import torch

    from flodl.averaging.outer import OuterOptimizer

__all__ = ["BundleSaver"]


class BundleSaver:
    """Writes this rank's bundles under ``run_dir`` in a worker thread; remembers the latest."""

    def __init__(
        self,
        machine: RankMachine,
        run_dir: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        keep: int | None = None,
        outer: OuterOptimizer | None = None,
    ) -> None:
        self._machine = machine
        self._outer = outer
        self._keep = keep
        self._run_dir = run_dir
        self._model = model
        self._optimizer = optimizer
        self.latest: str | None = None
        """The path of the newest bundle written (for the report and the death record)."""
        self.checkpoint_ms: list[float] = []
        """How long each Checkpoint's save held this rank, in milliseconds."""

    async def save(self, reason: str | None, stem: str | None = None) -> Path:
        """Save a bundle at the machine's current point; CheckpointError if it cannot."""
        machine = self._machine
        point = SavePoint(
            epoch=machine.epoch,
            global_step=machine.global_step,
            sync_round=machine.syncs,
            world_size=machine.world_size,
            reason=reason,
        )
        path = await trio.to_thread.run_sync(
            lambda: save_rank_bundle(
                self._run_dir,
                machine.rank,
                self._model,
                self._optimizer,
                point,
                stem=stem,
                keep=self._keep,
                outer_state=None if self._outer is None else self._outer.state_dict(),
            )
        )
        self.latest = str(path)
        return path

    async def checkpoint(self, request: Checkpoint) -> list[RankEffect]:
        """The SaveCheckpoint step: a versioned bundle; the machine's CheckpointResult."""
        started = trio.current_time()
        error: str | None = None
        path: str | None = None
        try:
            stem = f"flodl-step{self._machine.global_step:09d}-v{request.version:06d}"
            path = str(await self.save("CHECKPOINT", stem=stem))
        except CheckpointError as err:
            error = str(err)
        elapsed_ms = (trio.current_time() - started) * 1000.0
        self.checkpoint_ms.append(elapsed_ms)
        return self._machine.checkpoint_finished(request, elapsed_ms, error, path)

    async def save_on_loss(self) -> list[RankEffect]:
        """The SaveOnLoss step: this rank's own bundle, as the coordinator is gone; the
        outcome names the step it holds (the weights of the last round, plus the local
        batches since)."""
        machine = self._machine
        held = (
            f"global step {machine.global_step} as of the last round, plus "
            f"{machine.since_average} local batches"
        )
        stem = f"flodl-step{machine.global_step:09d}-lost"
        try:
            path = await self.save(LOSS_REASON, stem=stem)
        except CheckpointError as err:
            return machine.loss_save_finished(f"could not save this rank's weights: {err}")
        effects = machine.loss_save_finished(f"saved this rank's weights ({held}) to {path}")
        why = str(machine.life.error)
        record_death(self._run_dir, machine.rank, machine.world_size, why, str(path))
        return effects

    async def save_and_stop(self, reason: str) -> list[RankEffect]:
        """The SaveAndStop step: the bundle (or why it failed); the machine's report of it
        and goodbye."""
        started = trio.current_time()
        error: str | None = None
        path: str | None = None
        try:
            path = str(await self.save(reason))
            outcome = f"saved to {path}"
        except CheckpointError as err:
            error = str(err)
            outcome = f"the save failed: {err}"
        elapsed_ms = (trio.current_time() - started) * 1000.0
        return self._machine.save_finished(outcome, elapsed_ms, error, path)
