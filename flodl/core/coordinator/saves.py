"""When ranks save a checkpoint: on request, on a schedule, and once at the end of the run.

The coordinator asks a rank to save with ``Checkpoint(version, target_rank)``; the rank saves
at its next batch boundary and answers ``CheckpointResult``. :class:`SaveSchedule` decides
when, at each settled averaging round (when every live rank holds the averaged parameters):

* a rank that sent ``Intent(CHECKPOINT_NOW)`` is asked (itself: it asked for its own bundle);
* every ``every_rounds`` settled rounds and whenever ``every_epochs`` more epochs are done
  since the last scheduled save, the lowest live member is asked (one bundle stands for all,
  as every member holds the same averaged weights), never twice at the same global step;
* the last round of the run asks nobody: the final save follows it.

The final save (:meth:`SaveSchedule.final`) asks every live member, once every epoch is done,
and the run's ``Shutdown`` waits until each has answered, is gone, or ``deadline`` seconds
passed. Pure: no clocks, no I/O.
"""

from __future__ import annotations

from collections.abc import Collection

from flodl.core.coordinator.effects import Send
from flodl.wire.messages import Checkpoint, CheckpointResult

__all__ = ["SaveSchedule"]


class SaveSchedule:
    """The checkpoints to ask for (module docstring). ``None`` turns a schedule off."""

    def __init__(
        self,
        *,
        every_rounds: int | None,
        every_epochs: int | None,
        deadline: float,
        first_epoch: int = 0,
        first_step: int = 0,
    ) -> None:
        self._every_rounds = every_rounds
        self._every_epochs = every_epochs
        self._deadline = deadline
        self._asked: set[int] = set()
        self._version = 0
        self._rounds_since = 0
        self._epoch_mark = first_epoch
        self._saved_step = first_step
        self._final: dict[int, int] | None = None
        """Rank -> version of the final save still awaited (None: not asked yet)."""
        self.final_until: float | None = None
        """The final save is given up on after this (None: not asked yet, or over)."""

    @property
    def final_requested(self) -> bool:
        """The final save was asked for (every epoch is done)."""
        return self._final is not None

    def ask(self, rank: int) -> None:
        """``rank`` sent ``Intent(CHECKPOINT_NOW)``: it saves after the next settled round."""
        self._asked.add(rank)

    def _request(self, rank: int) -> Send:
        self._version += 1
        return Send(rank, Checkpoint(version=self._version, target_rank=rank))

    def settled(
        self, members: Collection[int], *, epoch: int, global_step: int, last: bool
    ) -> list[Send]:
        """A round settled with live ``members`` at ``epoch`` and ``global_step``; ``last``:
        no work is left, the final save comes next."""
        self._rounds_since += 1
        if last:
            self._asked.clear()
            return []
        targets = self._asked & set(members)
        self._asked.clear()
        if members and global_step > self._saved_step and self._scheduled(epoch):
            targets.add(min(members))
            self._rounds_since = 0
            self._epoch_mark = epoch
            self._saved_step = global_step
        return [self._request(rank) for rank in sorted(targets)]

    def _scheduled(self, epoch: int) -> bool:
        rounds, epochs = self._every_rounds, self._every_epochs
        by_rounds = rounds is not None and self._rounds_since >= rounds
        by_epochs = epochs is not None and epoch - self._epoch_mark >= epochs
        return by_rounds or by_epochs

    def final(self, members: Collection[int], now: float) -> list[Send] | None:
        """Every epoch is done: the requests for the final save the first time; then [] while
        a live member's answer is awaited; None once the run may shut down.

        After the first call ``members`` is only asked whether awaited ranks are in it, so a
        view whose ``in`` is O(1) keeps each call O(1) while the answers come in."""
        if self._final is None:
            self._final = {}
            requests = []
            for rank in sorted(members):
                requests.append(self._request(rank))
                self._final[rank] = self._version
            self.final_until = now + self._deadline
            return requests or None
        if not any(rank in members for rank in self._final) or (
            self.final_until is not None and now >= self.final_until
        ):
            self.final_until = None
            return None
        return []

    def on_result(self, result: CheckpointResult) -> bool:
        """A rank answered; True when it was the final save of a rank still awaited."""
        pending = self._final
        if pending is None or pending.get(result.rank) != result.version:
            return False
        del pending[result.rank]
        return True
