"""The rank runtime: the trio shell around the rank machine (:mod:`flodl.core.rank.machine`).

:func:`open_worker` connects to the coordinator, completes the handshake and runs three
background tasks for as long as the block lasts:

* the **receiver**, the only reader of the connection: each message goes to the machine and
  its reactions are performed at once. If no frame at all arrives for ``heartbeat_timeout``
  seconds, or the connection breaks, the coordinator is lost: the rank writes a death record
  (see :mod:`flodl.worker.records`) and every later call raises :class:`CoordinatorError`;
* the **heartbeat**, which sends a sign of life every ``heartbeat_interval`` whatever the
  training loop does: ``Heartbeat``, or the batch reports the machine holds (``Batches``),
  or nothing when another frame went out since the last beat;
* the **group joiner**, which joins each new group generation (:mod:`flodl.worker.membership`).

The training loop calls :meth:`Worker.next_batch` and :meth:`Worker.batch_done`. Parameters
are only read or written inside :meth:`Worker.next_batch` (the *batch boundary*), where the
shell performs the machine's steps: averaging (:mod:`flodl.worker.rounds`), saving
(:mod:`flodl.worker.persist`), handing out the next batch. Every decision is the machine's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from flodl.averaging.dtypes import reduce_dtype
from flodl.averaging.outer import OuterOptimizer
from flodl.backends.devices import check_model_devices, named_tensors
from flodl.core.common.job import Job
from flodl.core.common.work import BatchSlice, EpochOrders
from flodl.core.rank.effects import (
    Average,
    Blend,
    CancelRound,
    DoomGroup,
    Finish,
    GiveUp,
    HandOut,
    Ignored,
    JoinGroup,
    PrepareGroup,
    Raise,
    RankEffect,
    SaveAndStop,
    SaveCheckpoint,
    SaveOnLoss,
    Send,
    Wait,
    Wake,
)
from flodl.core.rank.machine import RankMachine
from flodl.errors import CheckpointError, ConfigError, CoordinatorError, FlodlError, OutOfTurn
from flodl.transports.channel import Channel
from flodl.wire.fields import MAX_TEXT
from flodl.wire.messages import (
    EpochAggregated,
    IntentKind,
    Message,
)
from flodl.worker.assignment import Assignment
from flodl.worker.config import WorkerConfig
from flodl.worker.link import beat, local_address, open_channel, receive_until_lost
from flodl.worker.membership import GroupMembership
from flodl.worker.outbox import Outbox
from flodl.worker.persist import restore_rank_bundle
from flodl.worker.records import record_death, report_path, write_json_atomic
from flodl.worker.rounds import RoundRunner
from flodl.worker.saving import BundleSaver
from flodl.worker.settings import receive_settings
from flodl.worker.signals import say_stopped
from flodl.worker.staging import StagedBatch
from flodl.worker.wakeup import Wakeup

if TYPE_CHECKING:
    import torch

    from flodl.backends import Backend

log = logging.getLogger("flodl.worker")

__all__ = ["Assignment", "Worker", "open_worker"]


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
        # Coalesced reports: the coordinator's work per rank then grows with its windows,
        # not with every batch (see flodl.core.rank.machine).
        self.machine = RankMachine(config.rank, config.world_size, config.policy, coalesce=True)
        self.final_metrics: dict[str, float] = {}
        self._started_at = trio.current_time()
        self._channel: Channel | None = None
        self._nursery: trio.Nursery | None = None
        self._orders: EpochOrders | None = None
        self._outbox = Outbox(self._lost)
        self.outer = OuterOptimizer(config.outer)
        """The outer optimizer every landed average goes through (the coordinator's choice)."""
        self._saver = BundleSaver(
            self.machine, config.run_dir, model, optimizer, config.keep_checkpoints, self.outer
        )
        self._staged: StagedBatch[Assignment] = StagedBatch()
        """The batch after the current one, takeable by a training thread (see staging.py)."""
        self._wakeup = Wakeup(self._staged.invalidate)
        self._boundary_scope: trio.CancelScope | None = None
        self._membership = GroupMembership(
            backend, config.rank, self._wakeup.notify, lambda message: self._post([Send(message)])
        )
        self._rounds = RoundRunner(
            self.machine,
            backend,
            self._membership,
            model,
            self._wakeup.event,
            self._perform,
            outer=self.outer,
            average_dtype=reduce_dtype(config.average_dtype),
            record_hashes=config.debug_param_hashes,
        )

    # --- what a training loop reads ---------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def global_step(self) -> int:
        """The run's global step as last set by the coordinator (SetGlobalStep)."""
        return self.machine.global_step

    @property
    def averages(self) -> int:
        """Averages that landed on this rank so far (blended ones under ``async``): when it
        changed between two batches, the parameters are the shared model."""
        return self.machine.syncs

    @property
    def steps_since_average(self) -> int:
        """Batches run since the last average (for ``global_step + steps_since_average``)."""
        return self.machine.since_average

    @property
    def last_epoch(self) -> EpochAggregated | None:
        """The latest epoch summary the coordinator broadcast."""
        return self.machine.last_epoch

    @property
    def param_hashes(self) -> list[dict[str, Any]]:
        """With ``debug_param_hashes``: ``{round, generation, sha256}`` after each average (and
        ``outer_sha256``, ``outer_version`` with an outer optimizer)."""
        return self._rounds.param_hashes

    @property
    def checkpoint_path(self) -> str | None:
        """The newest bundle this rank wrote."""
        return self._saver.latest

    @property
    def wall_s(self) -> float:
        return trio.current_time() - self._started_at

    # --- what a training loop calls ---------------------------------------------------------

    async def announce(self, dataset_size: int, batch_size: int, epochs: int) -> None:
        """Describe the job to the coordinator (``Ready``); call once, before ``next_batch``.
        Raises ConfigError for an empty job or a second, different description."""
        first = self.machine.job is None
        effects = self.machine.announce(Job(dataset_size, batch_size, epochs))
        if first:
            self._orders = EpochOrders(self.config.seed, dataset_size)
        self._perform(effects)
        await self._outbox.flush()
        self.machine.life.raise_if_lost()

    async def next_batch(self) -> Assignment | None:
        """The next batch to train, after doing whatever the coordinator asked meanwhile.

        Returns None when the coordinator shut the run down (Exiting has been sent). Raises
        ShutdownRequested after a ShutdownWithSave (the bundle is saved first) and
        CoordinatorError once the coordinator is lost (silent or disconnected). A batch not
        finished with :meth:`batch_done` is reported now with a NaN loss.
        """
        machine = self.machine
        if machine.current is not None:
            await self.batch_done(math.nan)
        machine.enter_boundary(trio.current_time())
        try:
            with trio.CancelScope() as scope:
                self._boundary_scope = scope
                batch = await self._boundary()
            if scope.cancelled_caught:
                machine.life.raise_if_lost()
                raise CoordinatorError("the worker is closing")
        finally:
            self._boundary_scope = None
            machine.leave_boundary(trio.current_time())
        if batch is None:
            return None
        self._reserve_next()
        return self._assignment_of(batch)

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
        if self._staged.claim_taken() is None:
            return
        self._post(self.machine.take_reserved(trio.current_time()))
        self._reserve_next()

    async def batch_done(self, loss: float, *, data_ms: float = 0.0) -> None:
        """Report the batch last handed out as finished (``Batch``), with its loss.

        ``batch_ms`` is measured from the hand-out to this call. Never raises for a lost
        coordinator (the next :meth:`next_batch` does).
        """
        self._perform(self.machine.batch_done(loss, data_ms, trio.current_time()))
        await self._outbox.flush()

    def batch_done_soon(self, loss: float, data_ms: float = 0.0) -> None:
        """:meth:`batch_done` for a caller that will not wait (another thread, through
        ``TrioToken.run_sync_soon``): the bookkeeping happens now, the report goes out from a
        task of its own, before anything :meth:`next_batch` sends. Never raises (an error
        here is the caller's, or the next :meth:`next_batch` reports the fatal one)."""
        try:
            effects = self.machine.batch_done(loss, data_ms, trio.current_time())
        except OutOfTurn as err:
            log.warning("rank %d: %s", self.rank, err)
            return
        self._post(effects)

    async def request_checkpoint(self) -> None:
        """Ask for a bundle of this rank after the next settled round (``Intent``)."""
        self._perform(self.machine.request_checkpoint())
        await self._outbox.flush()

    async def stop(self, reason: str) -> None:
        """End the training for every rank: nothing more is handed out, the batches already
        handed out are finished, a last round averages them and the run completes (every
        rank saves its final bundle, all holding the same model), so :meth:`next_batch` ends
        as at the last epoch's end. Returns once the request is sent; a second stop, or one
        once the run is ending, does nothing."""
        self._perform(self.machine.ask(IntentKind.STOP, reason[:MAX_TEXT]))
        await self._outbox.flush()

    def report_final(self, **metrics: float) -> None:
        """Record final metrics (e.g. ``test_accuracy=0.97``) for ``rank<N>.json``."""
        self.final_metrics.update({k: float(v) for k, v in metrics.items()})

    # --- performing the machine's effects ---------------------------------------------------

    def _assignment_of(self, batch: BatchSlice) -> Assignment:
        assert self._orders is not None
        return Assignment.of(batch, self._orders)

    def _reserve_next(self) -> None:
        batch = self.machine.reserve()
        if batch is not None:
            self._staged.offer(self._assignment_of(batch))

    def _perform(self, effects: Iterable[RankEffect]) -> None:
        """Carry out reactions at once; sends join the outbox (flushed by the caller)."""
        for effect in effects:
            if isinstance(effect, Send):
                self._outbox.put(effect.message)
            elif isinstance(effect, Wake):
                self._wakeup.notify(boundary_needed=effect.boundary)
            elif isinstance(effect, CancelRound):
                self._rounds.cancel()
            elif isinstance(effect, DoomGroup):
                dead = effect.dead_rank
                log.info("rank %d: rank %d declared dead; abandoning its group", self.rank, dead)
                self._membership.doom()
            elif isinstance(effect, PrepareGroup):
                self._outbox.put(self._membership.prepare(effect.request))
            elif isinstance(effect, JoinGroup):
                self._membership.announce(effect.session)
            elif isinstance(effect, GiveUp):
                self._give_up(effect.error)
            elif isinstance(effect, Ignored):
                kind = type(effect.message).__name__
                log.warning("rank %d: ignoring %s: %s", self.rank, kind, effect.why)
            else:
                raise OutOfTurn(f"{type(effect).__name__} is a boundary step, not a reaction")

    def _post(self, effects: Iterable[RankEffect]) -> None:
        """:meth:`_perform`, with the sends flushed from a task of their own."""
        self._perform(effects)
        self._outbox.flush_soon(self._nursery)

    def _lost(self, error: FlodlError) -> None:
        self._perform(self.machine.connection_lost(error))

    def _give_up(self, error: Exception) -> None:
        """The coordinator is lost: write the death record, stop joining groups."""
        config = self.config
        record_death(config.run_dir, self.rank, self.world_size, str(error), self.checkpoint_path)
        self._outbox.closed = True
        self._membership.stop_joining()

    # --- the batch boundary -----------------------------------------------------------------

    async def _boundary(self) -> BatchSlice | None:
        """Perform the machine's boundary steps until it hands out a batch (or ends)."""
        machine = self.machine
        while True:
            changed = self._wakeup.event()
            effects = machine.boundary(trio.current_time())
            step = effects.pop()
            if isinstance(step, HandOut) and step.reserved:
                self._staged.reclaim()  # before any wait: a message may reserve the next one
            self._perform(effects)
            await self._outbox.flush()
            if isinstance(step, HandOut):
                return step.batch
            if isinstance(step, Finish):
                return None
            if isinstance(step, Raise):
                raise step.error
            if isinstance(step, Wait):
                await changed.wait()
                continue
            assert self._nursery is not None
            if isinstance(step, Average):
                after = await self._rounds.average(step.sync, step.background, self._nursery)
            elif isinstance(step, Blend):
                after = await self._rounds.blend(step)
            elif isinstance(step, SaveCheckpoint):
                after = await self._saver.checkpoint(step.request)
            elif isinstance(step, SaveAndStop):
                after = await self._saver.save_and_stop(step.reason)
            elif isinstance(step, SaveOnLoss):
                after = await self._saver.save_on_loss()
            self._perform(after)
            await self._outbox.flush()

    # --- lifecycle --------------------------------------------------------------------------

    def _on_message(self, message: Message) -> None:
        self._post(self.machine.receive(message))
        self._reserve_next()

    def _start_tasks(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        channel, config = self._channel, self.config
        assert channel is not None
        timeout = config.heartbeat_timeout
        nursery.start_soon(receive_until_lost, channel, timeout, self._on_message, self._lost)
        nursery.start_soon(beat, self._outbox, config.heartbeat_interval, self.machine.heartbeat)
        nursery.start_soon(self._membership.join_announced)

    def note_exit(self, error: BaseException | None) -> None:
        """Record why the training script left the block (for ``rank<N>.json``); a stop
        the coordinator asked for is also said on stderr (:func:`say_stopped`)."""
        say_stopped(self.rank, error)
        if error is None:
            self.machine.life.note_exit("left the training loop")
        elif isinstance(error, KeyboardInterrupt):
            self.machine.life.note_exit("interrupted")
        else:
            self.machine.life.note_exit(f"error: {type(error).__name__}: {error}")

    def report(self) -> dict[str, Any]:
        """What ``rank<N>.json`` holds."""
        data: dict[str, Any] = {
            "rank": self.rank,
            "world_size": self.world_size,
            "policy": self.config.policy.value,
            **self.machine.tallies(),
            "wall_s": self.wall_s,
            "final_metrics": dict(self.final_metrics),
            "checkpoint": self.checkpoint_path,
            "checkpoint_ms": list(self._saver.checkpoint_ms),
        }
        if self.config.debug_param_hashes:
            data["param_hashes"] = list(self._rounds.param_hashes)
        return data

    async def _close(self) -> None:
        """Stop everything, close the backend and the connection, write ``rank<N>.json``.

        Runs shielded: completes even when the caller is being cancelled.
        """
        if self._boundary_scope is not None:
            self._boundary_scope.cancel()
        self._rounds.cancel()
        try:
            await self.backend.close()
        finally:
            if self._channel is not None:
                await self._channel.aclose()
            try:
                write_json_atomic(report_path(self.config.run_dir, self.rank), self.report())
            except OSError as err:
                log.error("rank %d: could not write its report: %s", self.rank, err)


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
    newest bundle there (CheckpointError if there is none that fits). A model with a
    parameter or buffer off the backend's device, or split across devices, is a ConfigError
    (:func:`~flodl.backends.devices.check_model_devices`) before the first round.
    Raises CoordinatorError (or the handshake's typed error) if the coordinator cannot be
    reached. On leaving the block, however it is left (cancellation included), the backend is
    closed (no live process group outlives it), the connection closed and ``rank<N>.json``
    written. An exception from the block propagates unchanged (not wrapped in a group).
    """
    restored = None
    if config.resume is not None:  # before connecting: the coordinator would hear no beat
        restored = await trio.to_thread.run_sync(
            restore_rank_bundle, config.resume, config.rank, model, optimizer
        )
    channel = await open_channel(config)
    try:
        config = await receive_settings(channel, config)  # the coordinator's, where unset
        if backend is None:
            from flodl.backends import open_backend

            backend = open_backend(
                config.backend,
                local_rank=config.local_rank,
                local_world_size=config.local_world_size,
                op_timeout=config.collective_timeout,
            )
        check_model_devices(named_tensors(model), getattr(backend, "device", None), backend.name)
        worker = Worker(config, model, optimizer, backend)
        if restored is not None and worker.outer.active:
            try:
                worker.outer.load_state_dict(restored.outer_state, list(model.parameters()))
            except ConfigError as err:
                raise CheckpointError(f"checkpoint {config.resume} does not fit: {err}") from None
    except BaseException:
        with trio.CancelScope(shield=True):
            await channel.aclose()
        raise
    body_error: Exception | None = None
    try:
        if restored is not None:
            worker.machine.global_step = restored.global_step
        worker._channel = worker._outbox.channel = channel
        worker._membership.host = config.host or local_address(channel.stream)
        worker._started_at = trio.current_time()
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
                worker._nursery = None  # a late callback must not start tasks in a closing nursery
                nursery.cancel_scope.cancel()
        worker.note_exit(body_error)
    finally:
        with trio.CancelScope(shield=True):
            await worker._close()
    if body_error is not None:
        raise body_error
