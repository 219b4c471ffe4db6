"""The rank runtime: one trio task group that speaks the work protocol for a training script.

:func:`open_worker` connects to the coordinator, completes the handshake and runs three
background tasks for as long as the block lasts:

* the **receiver**, the only reader of the connection. Messages that do not touch the
  parameters take effect at once (RequestNewGroup is answered immediately, DeclareDead
  cancels the collective in flight, Throttle / SetGlobalStep / Shutdown set flags); the rest
  (work spans, SyncNow, Checkpoint) queue in arrival order for the next batch boundary. If no
  frame at all arrives for ``heartbeat_timeout`` seconds, or the connection breaks, the rank
  writes a death record (see :mod:`flodl.worker.records`) and every later call raises
  :class:`CoordinatorError`;
* the **heartbeat**, which sends ``Heartbeat`` every ``heartbeat_interval`` whatever the
  training loop does;
* the **group joiner**, which joins each new group generation (NewGroupSession; see
  :mod:`flodl.worker.membership`).

The training loop calls :meth:`Worker.next_batch` and :meth:`Worker.batch_done`. Parameters
are only ever read or written inside :meth:`Worker.next_batch` (the *batch boundary*), so a
training step and an average never overlap: a SyncNow that arrives mid-step waits for the
boundary. Under the Async policy the boundary only takes a snapshot; the collective runs in the
background and its result is blended in (EASGD) at a later boundary.

Work protocol details (what :mod:`flodl.core.machine` relies on): one ``Batch`` per finished
batch; ``step_count`` counts batches and finished averages; when the work queue runs dry, one
``Metrics`` for the chunk just finished (its completion frame); ``SyncAck`` after each
average; ``Exiting`` after Shutdown.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from flodl.core.cycle import Policy
from flodl.errors import (
    BackendError,
    CheckpointError,
    ConfigError,
    CoordinatorError,
    FlodlError,
    ProtocolError,
    ShutdownRequested,
    TransportError,
)
from flodl.transports import connect
from flodl.transports.channel import Channel, connect_rank
from flodl.wire.messages import (
    Batch,
    Checkpoint,
    CheckpointResult,
    CoordHeartbeat,
    DeclareDead,
    EpochAggregated,
    Exiting,
    ExtendPartition,
    Heartbeat,
    Message,
    Metrics,
    NewGroupReady,
    NewGroupSession,
    Note,
    Ready,
    RequestNewGroup,
    SaveConsensusModel,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
)
from flodl.worker.config import WorkerConfig
from flodl.worker.membership import GroupMembership, Standing
from flodl.worker.persist import SavePoint, restore_rank_bundle, save_rank_bundle
from flodl.worker.records import (
    report_path,
    tensors_sha256,
    write_death_record,
    write_json_atomic,
)
from flodl.worker.spans import BatchSlice, EpochOrders, Span, WorkQueue
from flodl.worker.staging import StagedBatch

if TYPE_CHECKING:
    import torch

    from flodl.backends import AverageResult, Backend, PendingAverage

log = logging.getLogger("flodl.worker")

__all__ = ["Assignment", "Worker", "open_worker"]


@attrs.frozen
class Assignment:
    """One batch to train: positions ``[start, stop)`` of ``epoch``'s order and their indices."""

    epoch: int
    start: int
    stop: int
    indices: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.stop - self.start


@attrs.frozen
class Job:
    """What this rank trains: samples per epoch, batch size, epochs (sent as ``Ready``)."""

    dataset_size: int
    batch_size: int
    epochs: int


@attrs.define
class _Chunk:
    """The run of batches since the work queue was last empty (reported by one Metrics)."""

    epoch: int
    started_at: float
    batches: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    losses: int = 0
    idle_s: float = 0.0


@attrs.define
class _BackgroundRound:
    """An Async-policy round reducing a snapshot of ``batches`` batches."""

    sync: SyncNow
    pending: PendingAverage
    batches: int


class _Wakeup:
    """Wakes every task waiting for "something changed". Take :meth:`event` before checking
    conditions, then wait on it: a change in between is never missed."""

    def __init__(self, on_notify: Callable[[], None] | None = None) -> None:
        self._event = trio.Event()
        self._on_notify = on_notify

    def event(self) -> trio.Event:
        return self._event

    def notify(self, *, boundary_needed: bool = True) -> None:
        """Wake the waiters; ``boundary_needed`` (the default) also runs ``on_notify``."""
        if boundary_needed and self._on_notify is not None:
            self._on_notify()
        self._event.set()
        self._event = trio.Event()


class Worker:
    """A connected rank. Obtain one from :func:`open_worker`; all methods run in its trio run."""

    def __init__(
        self,
        config: WorkerConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        backend: Backend,
    ) -> None:
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.backend = backend
        self.job: Job | None = None
        self.step_count = 0
        """Batches finished plus averages finished (what Batch/SyncAck/Heartbeat carry)."""
        self.batches = 0
        self.syncs = 0
        self.global_step = 0
        """The run's global step as last set by the coordinator (SetGlobalStep)."""
        self.idle_s = 0.0
        """Seconds lost at batch boundaries while training: waiting for work or for the round
        to start, throttled. Averaging is counted apart, in ``averaging_s``."""
        self.averaging_s = 0.0
        """Seconds spent averaging (SyncNow to SyncAck; Async: blending a landed round in)."""
        self.startup_s = 0.0
        """Time from the handshake to the first batch (group formation, waiting for peers to
        start): kept apart from ``idle_s``, which is time lost while training."""
        self._first_batch_at: float | None = None
        self.final_metrics: dict[str, float] = {}
        self.exit_reason: str | None = None
        self.last_epoch: EpochAggregated | None = None
        """The latest epoch summary the coordinator broadcast."""
        self.param_hashes: list[dict[str, Any]] = []
        """With ``debug_param_hashes``: ``{round, generation, sha256}`` after each average."""
        self.checkpoint_path: str | None = None
        self._channel: Channel | None = None
        self._nursery: trio.Nursery | None = None
        self._started_at = trio.current_time()
        self._since_average = 0
        self._queue: WorkQueue | None = None
        self._orders: EpochOrders | None = None
        self._inbox: deque[Message] = deque()
        self._staged: StagedBatch[Assignment] = StagedBatch()
        """The batch after the current one, takeable by a training thread (see staging.py);
        any change that needs a boundary makes it untakeable."""
        self._wakeup = _Wakeup(self._staged.invalidate)
        self._current: Assignment | None = None
        self._reports: deque[Batch] = deque()
        """Batch reports recorded and not yet handed to the channel (see batch_done_soon)."""
        self._flushing = False
        self._handed_out_at = 0.0
        self._chunk: _Chunk | None = None
        self._epoch = 0
        self._throttled = False
        self._ending: Shutdown | ShutdownWithSave | None = None
        self._ended: ShutdownRequested | None = None
        self._goodbye_sent = False
        self._fatal: FlodlError | None = None
        self._membership = GroupMembership(backend, config.rank, self._wakeup.notify)
        self._collective_scope: trio.CancelScope | None = None
        self._boundary_scope: trio.CancelScope | None = None
        self._background: _BackgroundRound | None = None

    # --- public: what a training loop calls -----------------------------------------------

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def steps_since_average(self) -> int:
        """Batches run since the last average (for ``global_step + steps_since_average``)."""
        return self._since_average

    @property
    def wall_s(self) -> float:
        return trio.current_time() - self._started_at

    async def announce(self, dataset_size: int, batch_size: int, epochs: int) -> None:
        """Describe the job to the coordinator (``Ready``); call once, before ``next_batch``.

        Raises ConfigError for an empty job or a second, different description.
        """
        job = Job(dataset_size, batch_size, epochs)
        if self.job is not None:
            if job != self.job:
                raise ConfigError(f"this rank already announced {self.job}, not {job}")
            return
        if batch_size < 1 or epochs < 1 or dataset_size < batch_size:
            raise ConfigError(
                f"need batch_size >= 1, epochs >= 1 and dataset_size >= batch_size; got {job}"
            )
        self._raise_if_fatal()
        self.job = job
        self._queue = WorkQueue(batch_size, dataset_size)
        self._orders = EpochOrders(self.config.seed, dataset_size)
        ready = Ready(
            rank=self.rank, dataset_size=dataset_size, batch_size=batch_size, epochs=epochs
        )
        await self._send(ready)
        self._raise_if_fatal()

    async def next_batch(self) -> Assignment | None:
        """The next batch to train, after doing whatever the coordinator asked meanwhile.

        Returns None when the coordinator shut the run down (Exiting has been sent). Raises
        ShutdownRequested after a ShutdownWithSave (the bundle is saved first) and
        CoordinatorError once the coordinator is lost (silent or disconnected). A batch not
        finished with :meth:`batch_done` is reported now with a NaN loss.
        """
        if self._queue is None:
            raise ConfigError("announce the job (dataset_size, batch_size, epochs) first")
        if self._current is not None:
            await self.batch_done(math.nan)
        elif self._reports:
            await self._flush_reports()  # reports come before whatever the boundary sends
        entered = trio.current_time()
        averaging_before = self.averaging_s
        try:
            with trio.CancelScope() as scope:
                self._boundary_scope = scope
                assignment = await self._boundary()
            if scope.cancelled_caught:
                self._raise_if_fatal()
                raise CoordinatorError("the worker is closing")
        finally:
            self._boundary_scope = None
            now = trio.current_time()
            waited = now - entered - (self.averaging_s - averaging_before)
            if self._first_batch_at is None:
                self.startup_s += waited
            else:
                self.idle_s += waited
                if self._chunk is not None and entered >= self._chunk.started_at:
                    self._chunk.idle_s += waited
        if assignment is not None:
            if self._first_batch_at is None:
                self._first_batch_at = trio.current_time()
            self._current = assignment
            self._handed_out_at = trio.current_time()
            self._stage_next()
        return assignment

    def take_staged(self) -> Assignment | None:
        """The next batch if it can be handed out without a boundary, else None.

        Thread-safe: for a training thread (the facade), which must then have
        :meth:`absorb_taken` run in the trio thread (``TrioToken.run_sync_soon``) before it
        reports that batch done.
        """
        return self._staged.take()

    def absorb_taken(self) -> None:
        """Trio thread: make the batch a training thread took (:meth:`take_staged`) the
        current one and reserve the next. Never raises."""
        taken = self._staged.claim_taken()
        if taken is None:
            return
        if self._current is not None:  # the loop skipped done(): reported as next_batch does
            self.batch_done_soon(math.nan)
        self._current = taken
        self._handed_out_at = trio.current_time()
        self._epoch = taken.epoch
        self._stage_next()

    def _stage_next(self) -> None:
        """Reserve the batch after the current one, when nothing needs a boundary before it:
        no message waiting, not throttled, not ending, no landed background round, and the
        batch continues the current chunk (same epoch)."""
        queue, chunk = self._queue, self._chunk
        background = self._background
        if (
            queue is None
            or chunk is None
            or self._staged.reserved
            or self._fatal is not None
            or self._ending is not None
            or self._inbox
            or self._throttled
            or (background is not None and background.pending.landed)
            or queue.head_epoch != chunk.epoch
        ):
            return
        batch = queue.next_batch()
        assert batch is not None
        self._staged.offer(self._assignment_of(batch))

    async def batch_done(self, loss: float, *, data_ms: float = 0.0) -> None:
        """Report the batch last handed out as finished (``Batch``), with its loss.

        ``batch_ms`` is measured from the hand-out to this call. Never raises for a lost
        coordinator (the next :meth:`next_batch` does).
        """
        self._reports.append(self._record_done(loss, data_ms))
        await self._flush_reports()

    def batch_done_soon(self, loss: float, data_ms: float = 0.0) -> None:
        """:meth:`batch_done` for a caller that will not wait (another thread, through
        ``TrioToken.run_sync_soon``): the bookkeeping happens now, the report goes out from a
        task of its own, before anything :meth:`next_batch` sends. Never raises (an error
        here is the caller's, or the next :meth:`next_batch` reports the fatal one)."""
        try:
            self._reports.append(self._record_done(loss, data_ms))
        except ConfigError as err:
            log.warning("rank %d: %s", self.rank, err)
            return
        if not self._flushing and self._nursery is not None:
            self._flushing = True
            self._nursery.start_soon(self._flush_reports)

    def _record_done(self, loss: float, data_ms: float) -> Batch:
        current = self._current
        if current is None:
            raise ConfigError("batch_done() without a batch handed out by next_batch()")
        self._current = None
        batch_ms = max(trio.current_time() - self._handed_out_at, 0.0) * 1000.0
        self.batches += 1
        self.step_count += 1
        self._since_average += 1
        chunk = self._chunk
        if chunk is not None:
            chunk.batches += 1
            chunk.samples += current.size
            if math.isfinite(loss):
                chunk.loss_sum += loss
                chunk.losses += 1
        return Batch(
            rank=self.rank,
            batch_ms=batch_ms,
            data_ms=max(float(data_ms), 0.0),
            step_count=self.step_count,
            batch_loss=float(loss),
        )

    async def _flush_reports(self) -> None:
        """Send the queued batch reports in order. A report is taken off the queue and
        queued for the channel's (fair) send lock in one step, so concurrent flushes keep the
        order."""
        try:
            while self._reports:
                await self._send(self._reports.popleft())
        finally:
            self._flushing = False

    def report_final(self, **metrics: float) -> None:
        """Record final metrics (e.g. ``test_accuracy=0.97``) for ``rank<N>.json``."""
        self.final_metrics.update({k: float(v) for k, v in metrics.items()})

    # --- the batch boundary ---------------------------------------------------------------

    async def _boundary(self) -> Assignment | None:
        queue = self._queue
        assert queue is not None
        while True:
            changed = self._wakeup.event()
            self._raise_if_fatal()
            if self._ending is not None:
                await self._end()
                return None
            while self._inbox and self._ending is None:
                await self._apply(self._inbox.popleft())
                self._raise_if_fatal()
            if self._ending is not None:
                continue
            await self._land_background()
            if not self._throttled:
                staged = self._staged.reclaim()  # reserved earlier: it comes first
                if staged is not None:
                    return staged
                batch = queue.next_batch()
                if batch is not None:
                    if self._chunk is not None and self._chunk.epoch != batch.epoch:
                        await self._close_chunk()  # tallies are per epoch
                    return self._hand_out(batch)
            if queue.empty and self._chunk is not None and not self._staged.reserved:
                await self._close_chunk()  # at the barrier: the completion frame
            await changed.wait()

    def _hand_out(self, batch: BatchSlice) -> Assignment:
        if self._chunk is None:
            self._chunk = _Chunk(epoch=batch.epoch, started_at=trio.current_time())
        self._epoch = batch.epoch
        return self._assignment_of(batch)

    def _assignment_of(self, batch: BatchSlice) -> Assignment:
        assert self._orders is not None
        indices = tuple(self._orders.indices(batch))
        return Assignment(batch.epoch, batch.start, batch.stop, indices)

    def _metrics_of(self, chunk: _Chunk, now: float) -> Metrics:
        avg = chunk.loss_sum / chunk.losses if chunk.losses else math.nan
        return Metrics(
            rank=self.rank,
            epoch=chunk.epoch,
            avg_loss=avg,
            batches_processed=chunk.batches,
            samples_processed=chunk.samples,
            epoch_ms=max(now - chunk.started_at, 0.0) * 1000.0,
            scalars=(("idle_ms", chunk.idle_s * 1000.0),),
        )

    async def _close_chunk(self) -> None:
        """The queue ran dry: send the chunk's completion frame (Metrics)."""
        chunk, self._chunk = self._chunk, None
        if chunk is not None:
            await self._send(self._metrics_of(chunk, trio.current_time()))

    async def _apply(self, message: Message) -> None:
        """Carry out one queued message (at a boundary: the training thread is waiting)."""
        if isinstance(message, StartEpoch | ExtendPartition):
            assert self._queue is not None
            self._queue.add(Span.of(message))
        elif isinstance(message, SyncNow):
            await self._average(message)
        elif isinstance(message, Checkpoint):
            await self._checkpoint(message)
        elif isinstance(message, SaveConsensusModel):
            log.info("rank %d: SaveConsensusModel is not supported; ignored", self.rank)

    # --- averaging --------------------------------------------------------------------------

    def _tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return list(self.model.parameters()), list(self.model.buffers())

    async def _group_for(self, sync: SyncNow) -> bool:
        """Wait until this rank has joined ``sync.generation``; False if it never will."""
        while True:
            changed = self._wakeup.event()
            standing = self._membership.standing_for(sync.generation)
            if standing is Standing.NEVER:
                if sync.generation <= self._membership.doomed:
                    log.info(
                        "rank %d: skipping round %d of abandoned group %d",
                        self.rank,
                        sync.round,
                        sync.generation,
                    )
                return False
            if standing is Standing.MEMBER:
                return True
            if self._fatal is not None or self._ending is not None:
                return False
            await changed.wait()

    async def _average(self, sync: SyncNow) -> None:
        """SyncNow: average now (Sync/Cadence) or start a background round (Async)."""
        if not await self._group_for(sync):
            return
        params, buffers = self._tensors()
        batches = self._since_average
        if sync.generation == 0 and self.syncs == 0 and self.batches == 0:
            # The run's first round comes before any batch: group rank 0 alone carries mass,
            # so every rank starts from its parameters (a broadcast through the mass rule).
            batches = 1 if self._membership.group_rank == 0 else 0
        if self.config.policy is Policy.ASYNC:
            await self._start_background(sync, params, buffers, batches)
            return
        result: AverageResult | None = None
        started = trio.current_time()
        with trio.CancelScope() as scope:
            self._collective_scope = scope
            try:
                result = await self.backend.average(params, buffers, batches)
            except BackendError as err:
                log.warning("rank %d: round %d failed: %s", self.rank, sync.round, err)
            finally:
                self._collective_scope = None
                self.averaging_s += trio.current_time() - started
        if result is None:
            if scope.cancelled_caught:
                log.info("rank %d: round %d abandoned", self.rank, sync.round)
            return  # no ack: the coordinator re-forms the group and redoes the round
        self._since_average = 0
        await self._acknowledge(sync, result, params, buffers)

    async def _start_background(
        self,
        sync: SyncNow,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        batches: int,
    ) -> None:
        assert self._nursery is not None
        try:
            pending = await self.backend.start_background_average(
                self._nursery, params, buffers, batches
            )
        except BackendError as err:
            log.warning("rank %d: round %d could not start: %s", self.rank, sync.round, err)
            return
        self._since_average = 0
        self._background = _BackgroundRound(sync, pending, batches)
        self._nursery.start_soon(self._watch_landing, pending)

    async def _watch_landing(self, pending: PendingAverage) -> None:
        await pending.wait()
        self._wakeup.notify()

    async def _land_background(self) -> None:
        """Async policy: blend a landed background round into the live tensors, then ack."""
        round_ = self._background
        if round_ is None or not round_.pending.landed:
            return
        self._background = None
        params, buffers = self._tensors()
        started = trio.current_time()
        try:
            result = await trio.to_thread.run_sync(round_.pending.blend_into, params, buffers)
        except BackendError as err:
            self.averaging_s += trio.current_time() - started
            log.info("rank %d: round %d did not land: %s", self.rank, round_.sync.round, err)
            self._since_average += round_.batches  # those batches were never averaged
            return
        self.averaging_s += trio.current_time() - started
        await self._acknowledge(round_.sync, result, params, buffers)

    def _abandon_background(self) -> None:
        if self._background is not None:
            self._background.pending.abandon()

    async def _acknowledge(
        self,
        sync: SyncNow,
        result: AverageResult,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
    ) -> None:
        self.step_count += 1
        self.syncs += 1
        if self.config.debug_param_hashes:
            digest = tensors_sha256([*params, *buffers])
            self.param_hashes.append(
                {"round": sync.round, "generation": sync.generation, "sha256": digest}
            )
        await self._send(
            SyncAck(
                rank=self.rank,
                round=sync.round,
                step_count=self.step_count,
                divergence=_finite(result.divergence),
                post_norm=_finite(result.post_norm),
                pre_norm=_finite(result.pre_norm),
            )
        )

    # --- saving and ending -------------------------------------------------------------------

    def _save_point(self, reason: str | None) -> SavePoint:
        return SavePoint(
            epoch=self._epoch,
            global_step=self.global_step,
            sync_round=self.syncs,
            world_size=self.world_size,
            reason=reason,
        )

    async def _save_bundle(self, reason: str | None, stem: str | None = None) -> Path:
        """Save this rank's bundle in a worker thread and remember it as the latest."""
        point = self._save_point(reason)
        path = await trio.to_thread.run_sync(
            lambda: save_rank_bundle(
                self.config.run_dir, self.rank, self.model, self.optimizer, point, stem=stem
            )
        )
        self.checkpoint_path = str(path)
        return path

    async def _checkpoint(self, request: Checkpoint) -> None:
        if request.target_rank != self.rank:
            return
        started = trio.current_time()
        error: str | None = None
        try:
            await self._save_bundle(None, stem=f"flodl-v{request.version:06d}")
        except CheckpointError as err:
            error = str(err)
        elapsed_ms = (trio.current_time() - started) * 1000.0
        await self._send(
            CheckpointResult(
                rank=self.rank, version=request.version, elapsed_ms=elapsed_ms, error=error
            )
        )

    async def _end(self) -> None:
        """Shutdown: say Exiting and return None; ShutdownWithSave: save first, then raise."""
        if self._ended is not None:
            raise self._ended
        ending = self._ending
        self._abandon_background()
        if isinstance(ending, ShutdownWithSave):
            reason = ending.reason.name
            try:
                path = await self._save_bundle(reason)
                saved = f"saved to {path}"
            except CheckpointError as err:
                saved = f"the save failed: {err}"
            await self._say_goodbye(f"saving and stopping: {reason}")
            self.exit_reason = self.exit_reason or f"shutdown_with_save:{reason}"
            self._ended = ShutdownRequested(
                f"coordinator asked to save and stop: {reason} ({saved})", ending.reason
            )
            raise self._ended
        await self._say_goodbye("shut down by the coordinator")
        self.exit_reason = self.exit_reason or "completed"
        return None

    async def _say_goodbye(self, why: str) -> None:
        if self._goodbye_sent:
            return
        self._goodbye_sent = True
        await self._send(Note(rank=self.rank, detail=why))
        await self._send(Exiting(rank=self.rank))

    # --- failure ------------------------------------------------------------------------------

    def _raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def _die(self, error: FlodlError) -> None:
        """The coordinator is lost: record it, stop every wait, make the next call raise."""
        if self._fatal is not None or self._ending is not None:
            return
        self._fatal = error
        self.exit_reason = f"coordinator_lost: {error}"
        bundle = Path(self.checkpoint_path) if self.checkpoint_path is not None else None
        try:
            path = write_death_record(
                self.config.run_dir, self.rank, self.world_size, str(error), bundle
            )
            log.error("rank %d: %s (death record: %s)", self.rank, error, path)
        except (OSError, CheckpointError) as err:
            log.error("rank %d: %s (could not write the death record: %s)", self.rank, error, err)
        if self._collective_scope is not None:
            self._collective_scope.cancel()
        self._membership.stop_joining()
        self._abandon_background()
        self._wakeup.notify()

    async def _send(self, message: Message) -> None:
        """Send, turning a broken connection into the rank's death (never raises for it)."""
        channel = self._channel
        if channel is None or self._fatal is not None:
            return
        try:
            await channel.send(message)
        except (TransportError, trio.BrokenResourceError, trio.ClosedResourceError) as err:
            if self._ending is None:
                self._die(CoordinatorError(f"lost the connection to the coordinator: {err}"))

    # --- background tasks ---------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        channel = self._channel
        assert channel is not None
        timeout = self.config.heartbeat_timeout
        try:
            while True:
                with trio.move_on_after(timeout) as scope:
                    message = await channel.receive()
                if scope.cancelled_caught:
                    self._die(
                        CoordinatorError(
                            f"the coordinator has been silent for {timeout:g} s "
                            "(FLODL_HEARTBEAT_TIMEOUT); giving up on it"
                        )
                    )
                    return
                self._dispatch(message)
        except (FlodlError, trio.BrokenResourceError, trio.ClosedResourceError) as err:
            self._die(CoordinatorError(f"lost the connection to the coordinator: {err}"))

    def _dispatch(self, message: Message) -> None:
        """Act on one incoming message at once; queue what must wait for a boundary."""
        if isinstance(message, CoordHeartbeat):
            return
        if isinstance(message, StartEpoch | ExtendPartition) and self._queue_work_now(message):
            self._wakeup.notify(boundary_needed=False)
            return
        if isinstance(message, StartEpoch | ExtendPartition | Checkpoint | SaveConsensusModel):
            self._inbox.append(message)
        elif isinstance(message, SyncNow):
            self._throttled = False
            self._inbox.append(message)
        elif isinstance(message, SetGlobalStep):
            self.global_step = message.global_step
            if not self._throttled:
                return  # nothing for a boundary to do
            self._throttled = False
        elif isinstance(message, Throttle):
            self._throttled = True
        elif isinstance(message, DeclareDead):
            self._on_declare_dead(message)
        elif isinstance(message, RequestNewGroup):
            self._prepare_group(message)
        elif isinstance(message, NewGroupSession):
            self._membership.announce(message)
        elif isinstance(message, Shutdown | ShutdownWithSave):
            if self._ending is None:
                self._ending = message
                self._throttled = False
                if self._collective_scope is not None:
                    self._collective_scope.cancel()
        elif isinstance(message, EpochAggregated):
            self.last_epoch = message
            return  # nothing for a boundary to do
        else:
            log.warning("rank %d: ignoring unexpected %s", self.rank, type(message).__name__)
            return
        self._wakeup.notify()

    def _queue_work_now(self, message: StartEpoch | ExtendPartition) -> bool:
        """Queue work at once when nothing waits in the inbox before it (work needs no
        boundary; behind a SyncNow it must wait for it). False: it goes to the inbox."""
        queue = self._queue
        if queue is None or self._inbox:
            return False
        try:
            queue.add(Span.of(message))
        except ProtocolError:
            return False  # raised to the training loop at the boundary, as before
        self._stage_next()
        return True

    def _on_declare_dead(self, message: DeclareDead) -> None:
        log.info("rank %d: rank %d declared dead; abandoning its group", self.rank, message.rank)
        self._membership.doom()
        if self._collective_scope is not None:
            self._collective_scope.cancel()
        self._abandon_background()

    def _prepare_group(self, request: RequestNewGroup) -> None:
        assert self._nursery is not None
        try:
            info = self.backend.prepare_group(request.generation, self.config.host)
        except BackendError as err:
            log.warning("rank %d: cannot host group %d: %s", self.rank, request.generation, err)
            self._nursery.start_soon(self._send, Note(rank=self.rank, detail=str(err)[:200]))
            return
        reply = NewGroupReady(rank=self.rank, generation=request.generation, info=info)
        self._nursery.start_soon(self._send, reply)

    async def _heartbeat_loop(self) -> None:
        """Beat every ``heartbeat_interval`` until the coordinator is lost or the block ends."""
        interval = self.config.heartbeat_interval
        next_beat = trio.current_time()
        while self._fatal is None:
            next_beat += interval
            await trio.sleep_until(next_beat)
            await self._send(Heartbeat(rank=self.rank, step_count=self.step_count))

    # --- lifecycle ----------------------------------------------------------------------------

    async def _connect(self) -> None:
        config = self.config
        try:
            with trio.fail_after(config.heartbeat_timeout):
                stream = await connect(config.coordinator)
                try:
                    self._channel = await connect_rank(
                        stream, config.session_key, config.rank, config.world_size
                    )
                except BaseException:
                    await trio.aclose_forcefully(stream)
                    raise
        except trio.TooSlowError:
            raise CoordinatorError(
                f"rank {config.rank}: no handshake with the coordinator at {config.coordinator} "
                f"within {config.heartbeat_timeout:g} s"
            ) from None
        self._started_at = trio.current_time()

    def _start_tasks(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        nursery.start_soon(self._receive_loop)
        nursery.start_soon(self._heartbeat_loop)
        nursery.start_soon(self._membership.join_announced)

    def note_exit(self, error: BaseException | None) -> None:
        """Record why the training script left the block (for ``rank<N>.json``)."""
        if self.exit_reason is not None:
            return
        if error is None:
            self.exit_reason = "left the training loop"
        elif isinstance(error, KeyboardInterrupt):
            self.exit_reason = "interrupted"
        else:
            self.exit_reason = f"error: {type(error).__name__}: {error}"

    def report(self) -> dict[str, Any]:
        """What ``rank<N>.json`` holds."""
        data: dict[str, Any] = {
            "rank": self.rank,
            "world_size": self.world_size,
            "policy": self.config.policy.value,
            "steps": self.step_count,
            "batches": self.batches,
            "syncs": self.syncs,
            "global_step": self.global_step,
            "idle_s": self.idle_s,
            "averaging_s": self.averaging_s,
            "startup_s": self.startup_s,
            "wall_s": self.wall_s,
            "final_metrics": dict(self.final_metrics),
            "exit_reason": self.exit_reason,
            "checkpoint": self.checkpoint_path,
        }
        if self.config.debug_param_hashes:
            data["param_hashes"] = list(self.param_hashes)
        return data

    async def _close(self) -> None:
        """Stop everything, close the backend and the connection, write ``rank<N>.json``.

        Runs shielded: completes even when the caller is being cancelled.
        """
        if self._boundary_scope is not None:
            self._boundary_scope.cancel()
        self._abandon_background()
        try:
            await self.backend.close()
        finally:
            if self._channel is not None:
                await self._channel.aclose()
            try:
                write_json_atomic(report_path(self.config.run_dir, self.rank), self.report())
            except OSError as err:
                log.error("rank %d: could not write its report: %s", self.rank, err)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


@asynccontextmanager
async def open_worker(
    config: WorkerConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    backend: Backend | None = None,
) -> AsyncIterator[Worker]:
    """Connect rank ``config.rank`` to its coordinator and serve the protocol during the block.

    With ``config.resume`` set, the model (and optimizer) are first loaded from this rank's
    newest bundle there (CheckpointError if there is none that fits).
    Raises CoordinatorError (or the handshake's typed error) if the coordinator cannot be
    reached. On leaving the block, however it is left (cancellation included), the backend is
    closed (no live process group outlives it), the connection closed and ``rank<N>.json``
    written. An exception from the block propagates unchanged (not wrapped in a group).
    """
    if backend is None:
        from flodl.backends import open_backend

        backend = open_backend(
            config.backend,
            local_rank=config.local_rank,
            local_world_size=config.local_world_size,
            op_timeout=config.collective_timeout,
        )
    worker = Worker(config, model, optimizer, backend)
    body_error: Exception | None = None
    try:
        if config.resume is not None:
            worker.global_step = await trio.to_thread.run_sync(
                restore_rank_bundle, config.resume, config.rank, model, optimizer
            )
        await worker._connect()
        async with trio.open_nursery() as nursery:
            worker._start_tasks(nursery)
            try:
                yield worker
            except Exception as err:
                body_error = err
            except BaseException as err:
                worker.note_exit(err)
                raise
            finally:
                nursery.cancel_scope.cancel()
        worker.note_exit(body_error)
    finally:
        with trio.CancelScope(shield=True):
            await worker._close()
    if body_error is not None:
        raise body_error
