"""One rank's batches: what is queued, what is out, what is reserved, what the next Metrics says.

Part of the rank machine (:mod:`flodl.core.rank.machine`), pure like it. The machine decides *when*
(a boundary, a message, the loop taking a batch); this class keeps *what*: the spans queued
(:class:`~flodl.core.common.work.WorkQueue`), the batch handed out and not done, the batch reserved
ahead for a training thread, and the tallies of the current *chunk*, the run of batches that
one ``Metrics`` completion frame reports when the work runs dry or the epoch changes.
"""

from __future__ import annotations

import math

import attrs

from flodl.core.common.job import Job
from flodl.core.common.work import BatchSlice, WorkMessage, WorkQueue
from flodl.core.rank.effects import HandOut, Send, Wait
from flodl.errors import OutOfTurn, ProtocolError
from flodl.wire.messages import Metrics

__all__ = ["RankWork"]


@attrs.define
class _Chunk:
    """Tallies of the batches since the work last ran dry."""

    epoch: int
    started_at: float
    batches: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    losses: int = 0
    idle_s: float = 0.0

    def metrics(self, rank: int, now: float) -> Metrics:
        return Metrics(
            rank=rank,
            epoch=self.epoch,
            avg_loss=self.loss_sum / self.losses if self.losses else math.nan,
            batches_processed=self.batches,
            samples_processed=self.samples,
            epoch_ms=max(now - self.started_at, 0.0) * 1000.0,
            scalars=(("idle_ms", self.idle_s * 1000.0),),
        )


class RankWork:
    """See the module docstring. Methods return at once and never send anything."""

    def __init__(self, rank: int, job: Job) -> None:
        self.rank = rank
        self.queue = WorkQueue(job.batch_size, job.dataset_size)
        self.current: BatchSlice | None = None
        """The batch handed out and not reported done."""
        self.reserved: BatchSlice | None = None
        """The batch reserved ahead (see :meth:`reserve`)."""
        self.epoch = 0
        """The epoch of the batch handed out last."""
        self._chunk: _Chunk | None = None
        self._handed_out_at = 0.0

    def add_now(self, message: WorkMessage) -> bool:
        """Queue work; False (nothing queued) when it is bad: the boundary raises it then."""
        try:
            self.queue.add(message)
        except ProtocolError:
            return False
        return True

    def next_step(self, now: float, throttled: bool) -> list[Send | HandOut | Wait]:
        """Hand out the next batch (the reserved one first), or wait; the chunk's Metrics
        goes first when the epoch changes or, at the barrier, when the work ran dry."""
        effects: list[Send | HandOut | Wait] = []
        if not throttled:
            reserved = self.reserved
            if reserved is not None:
                self.reserved = None
                return [self._hand_out(reserved, now, reserved=True)]
            batch = self.queue.next_batch()
            if batch is not None:
                if self._chunk is not None and self._chunk.epoch != batch.epoch:
                    effects += self._close_chunk(now)  # tallies are per epoch
                return [*effects, self._hand_out(batch, now)]
        if self.queue.empty and self.reserved is None:
            effects += self._close_chunk(now)
        return [*effects, Wait()]

    def _hand_out(self, batch: BatchSlice, now: float, reserved: bool = False) -> HandOut:
        if self._chunk is None:
            self._chunk = _Chunk(epoch=batch.epoch, started_at=now)
        self.epoch = batch.epoch
        self.current = batch
        self._handed_out_at = now
        return HandOut(batch, reserved)

    def _close_chunk(self, now: float) -> list[Send | HandOut | Wait]:
        chunk, self._chunk = self._chunk, None
        return [] if chunk is None else [Send(chunk.metrics(self.rank, now))]

    def reserve(self) -> BatchSlice | None:
        """Reserve the next batch if it continues the current chunk (same epoch)."""
        chunk = self._chunk
        if chunk is None or self.reserved is not None or self.queue.head_epoch != chunk.epoch:
            return None
        self.reserved = self.queue.next_batch()
        return self.reserved

    def take_reserved(self, now: float) -> None:
        """The reserved batch is the current one now (the previous one must be done)."""
        batch = self.reserved
        if batch is None:
            raise OutOfTurn("take_reserved() with no batch reserved")
        assert self.current is None
        self.reserved = None
        self.current = batch
        self._handed_out_at = now
        self.epoch = batch.epoch

    def finish(self, loss: float, now: float) -> float:
        """The current batch is done with ``loss``: tally it; its milliseconds since the
        hand-out. OutOfTurn when no batch is out."""
        current = self.current
        if current is None:
            raise OutOfTurn("batch_done() without a batch handed out by next_batch()")
        self.current = None
        chunk = self._chunk
        if chunk is not None:
            chunk.batches += 1
            chunk.samples += current.size
            if math.isfinite(loss):
                chunk.loss_sum += loss
                chunk.losses += 1
        return max(now - self._handed_out_at, 0.0) * 1000.0

    def count_idle(self, waited: float, since: float) -> None:
        """``waited`` seconds lost from ``since``: the chunk's idle time if it was open then."""
        chunk = self._chunk
        if chunk is not None and since >= chunk.started_at:
            chunk.idle_s += waited
