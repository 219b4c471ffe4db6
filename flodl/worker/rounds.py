"""Averaging rounds, performed: the rank machine's Average and Blend steps against a backend.

:class:`RoundRunner` waits until the rank is in the round's group generation, runs the
collective (or, under the Async policy, starts it in the background and later blends the
landed result in), and reports how it went to the machine. It owns the one cancel scope of a
collective in flight and the background round, so the shell's CancelRound effect has one
place to go.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from flodl.averaging.outer import OuterOptimizer, OuterSettings
from flodl.backends import DEFAULT_ALPHA
from flodl.core.rank.effects import Blend, RankEffect
from flodl.core.rank.machine import RankMachine
from flodl.errors import BackendError
from flodl.wire.messages import SyncNow
from flodl.worker.membership import GroupMembership, Standing
from flodl.worker.records import tensors_sha256

if TYPE_CHECKING:
    import torch

    from flodl.backends import AverageResult, Backend, PendingAverage

log = logging.getLogger("flodl.worker")

__all__ = ["RoundRunner"]


class RoundRunner:
    """Performs one rank's averaging steps; see the module docstring."""

    def __init__(
        self,
        machine: RankMachine,
        backend: Backend,
        membership: GroupMembership,
        model: torch.nn.Module,
        changed: Callable[[], trio.Event],
        perform: Callable[[list[RankEffect]], None],
        *,
        outer: OuterOptimizer | None = None,
        average_dtype: torch.dtype | None = None,
        record_hashes: bool = False,
    ) -> None:
        """``changed()`` gives an event set at the next change worth re-checking (a group
        joined, the rank ending or lost); ``perform`` carries out reactions that arrive outside a
        boundary (a background round landed). With ``record_hashes``, a digest of the averaged
        tensors is kept in :attr:`param_hashes` after every round. ``outer``: the outer
        optimizer each landed average goes through (None: plain averaging). ``average_dtype``:
        rounds reduce the moves since the last round in this dtype
        (:mod:`flodl.backends.compressed`; None: full precision)."""
        self._machine = machine
        self._backend = backend
        self._membership = membership
        self._model = model
        self._changed = changed
        self._perform = perform
        self._record_hashes = record_hashes
        self.outer = outer if outer is not None else OuterOptimizer(OuterSettings())
        self._outer_generation: int | None = None
        """The group generation whose members last made the outer state equal."""
        self._average_dtype = average_dtype
        self._reference: list[torch.Tensor] = []
        """With ``average_dtype``: the parameters the last round left, the same bytes on every
        member of :attr:`_reference_generation` (compressed rounds send the moves from them)."""
        self._reference_generation: int | None = None
        self.param_hashes: list[dict[str, Any]] = []
        """With ``record_hashes``: ``{round, generation, sha256}`` after each average, the
        outer state's ``outer_sha256`` and ``outer_version`` when it is active, and
        ``compressed`` for a round that reduced 16-bit moves."""
        self._collective: trio.CancelScope | None = None
        self._pending: PendingAverage | None = None
        self._pending_sync: SyncNow | None = None

    def _tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return list(self._model.parameters()), list(self._model.buffers())

    def cancel(self) -> None:
        """Cancel the collective in flight and abandon the background round (never raises)."""
        if self._collective is not None:
            self._collective.cancel()
        if self._pending is not None:
            self._pending.abandon()

    async def _joined(self, sync: SyncNow) -> bool:
        """Wait until this rank is in ``sync.generation``; False if it never will be (or the
        rank stops taking rounds meanwhile)."""
        while True:
            changed = self._changed()
            standing = self._membership.standing_for(sync.generation)
            if standing is Standing.NEVER:
                if sync.generation <= self._membership.doomed:
                    log.info(
                        "rank %d: skipping round %d of abandoned group %d",
                        self._machine.rank,
                        sync.round,
                        sync.generation,
                    )
                return False
            if standing is Standing.MEMBER:
                return True
            if not self._machine.life.takes_rounds:
                return False
            await changed.wait()

    async def average(
        self, sync: SyncNow, background: bool, nursery: trio.Nursery
    ) -> list[RankEffect]:
        """Run the round for ``sync`` (or start it in the background); the machine's answer.

        Cancelled (CancelRound) or failed rounds send no ack: the coordinator re-forms the
        group and redoes the round.
        """
        machine = self._machine
        if not await self._joined(sync):
            return machine.average_finished(sync, None, 0.0)
        weight = machine.round_weight(sync, self._membership.group_rank)
        params, buffers = self._tensors()
        started = trio.current_time()
        if not await self._share_outer(sync, params):
            return machine.average_finished(sync, None, trio.current_time() - started)
        if background:
            return await self._start_background(sync, params, buffers, weight, nursery)
        result: AverageResult | None = None
        # A compressed round needs a reference every member holds: one a round of this group
        # generation left (the first round of a generation runs in full precision and sets it).
        dtype = self._average_dtype if self._reference_generation == sync.generation else None
        with trio.CancelScope() as scope:
            self._collective = scope
            try:
                if dtype is None:
                    result = await self._backend.average(params, buffers, weight)
                else:
                    result = await self._backend.average_moves(
                        params, buffers, self._reference, weight, dtype
                    )
            except BackendError as err:
                log.warning("rank %d: round %d failed: %s", machine.rank, sync.round, err)
            finally:
                self._collective = None
        if result is None and scope.cancelled_caught:
            log.info("rank %d: round %d abandoned", machine.rank, sync.round)
        if result is not None:
            if not result.skipped and self.outer.active:
                with trio.CancelScope(shield=True):  # every member steps once per round
                    await trio.to_thread.run_sync(self.outer.step, params)
            if not result.skipped and self._average_dtype is not None:
                self._keep_reference(params, sync.generation)
            self._record(sync, compressed=dtype is not None)
        else:
            self._reference_generation = None  # this rank's parameters may differ now
        return machine.average_finished(sync, result, trio.current_time() - started)

    def _keep_reference(self, params: list[torch.Tensor], generation: int) -> None:
        """The parameters a round just left, the same bytes on every member: the reference
        of the next compressed round."""
        import torch

        with torch.no_grad():
            if [r.shape for r in self._reference] != [p.shape for p in params]:
                self._reference = [p.detach().clone() for p in params]
            else:
                for reference, p in zip(self._reference, params, strict=True):
                    reference.copy_(p)
        self._reference_generation = generation

    async def _share_outer(self, sync: SyncNow, params: list[torch.Tensor]) -> bool:
        """At the first round of each group generation, make the outer state equal on every
        member (a joiner or a resumed rank takes the newest); False if that failed (the
        round is then not run, and the coordinator re-forms the group as for a failed one)."""
        outer = self.outer
        if not outer.active or self._outer_generation == sync.generation:
            return True
        with trio.CancelScope() as scope:
            self._collective = scope
            try:
                version = await self._backend.share_newest(
                    outer.shared_tensors(params), outer.version
                )
            except BackendError as err:
                log.warning(
                    "rank %d: round %d could not share the outer state: %s",
                    self._machine.rank,
                    sync.round,
                    err,
                )
                return False
            finally:
                self._collective = None
        if scope.cancelled_caught:
            return False
        outer.adopt_shared(version)
        self._outer_generation = sync.generation
        return True

    async def _start_background(
        self,
        sync: SyncNow,
        params: list[torch.Tensor],
        buffers: list[torch.Tensor],
        weight: int,
        nursery: trio.Nursery,
    ) -> list[RankEffect]:
        machine = self._machine
        started = trio.current_time()
        try:
            pending = await self._backend.start_background_average(nursery, params, buffers, weight)
        except BackendError as err:
            log.warning("rank %d: round %d could not start: %s", machine.rank, sync.round, err)
            return machine.average_finished(sync, None, trio.current_time() - started)
        machine.background_started(sync)
        self._pending, self._pending_sync = pending, sync
        nursery.start_soon(self._watch_landing, pending)
        return []

    async def _watch_landing(self, pending: PendingAverage) -> None:
        await pending.wait()
        if pending is self._pending:
            self._perform(list(self._machine.background_landed()))

    async def blend(self, step: Blend) -> list[RankEffect]:
        """The Blend step: the landed background round blended into the live tensors (the
        EASGD default alpha; the average as it is when ``step.exact``); the machine's answer."""
        pending, sync = self._pending, self._pending_sync
        assert pending is not None and sync is not None
        self._pending = self._pending_sync = None
        alpha = 1.0 if step.exact else DEFAULT_ALPHA
        params, buffers = self._tensors()
        started = trio.current_time()
        result: AverageResult | None = None
        try:
            outer_step = self.outer.step if self.outer.active else None
            result = await trio.to_thread.run_sync(
                pending.blend_into, params, buffers, alpha, outer_step
            )
        except BackendError as err:
            log.info("rank %d: round %d did not land: %s", self._machine.rank, sync.round, err)
        if result is not None:
            self._record(sync)
        return self._machine.blend_finished(result, trio.current_time() - started)

    def _record(self, sync: SyncNow, *, compressed: bool = False) -> None:
        if self._record_hashes:
            params, buffers = self._tensors()
            digest = tensors_sha256([*params, *buffers])
            entry = {"round": sync.round, "generation": sync.generation, "sha256": digest}
            if compressed:
                entry["compressed"] = True
            if self.outer.active:
                entry["outer_sha256"] = tensors_sha256(self.outer.tensors())
                entry["outer_version"] = self.outer.version
            self.param_hashes.append(entry)
