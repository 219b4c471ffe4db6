"""The run's work across epochs: windows of batches that may cross an epoch boundary.

One :class:`~flodl.core.coordinator.partitions.ChunkPool` per epoch hands out whole batches of that
epoch's shared order. :class:`Workload` strings the pools together so a window is never cut short by
an epoch's end: when the current epoch runs out mid-window, the rest of each rank's count comes
from the next epoch (a StartEpoch for it follows the rank's last span of the old one). Without
this, every epoch boundary would cost an extra averaging round of short windows.

Ranks work through spans in the order they receive them; completed batches are credited to the
oldest epoch in which the rank still has work. Pure: no I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence, Set

from flodl.core.common.work import WorkMessage, work_span
from flodl.core.coordinator.partitions import ChunkPool
from flodl.errors import ConfigError
from flodl.wire.messages import ExtendPartition


def span_batches(message: WorkMessage, batch_size: int) -> int:
    """How many batches a work message holds (the last one may be short)."""
    return -(-work_span(message)[1].size // batch_size)


class Workload:
    """Every epoch's samples, handed out in windows of per-rank batch counts."""

    def __init__(
        self, dataset_size: int, batch_size: int, epochs: int, *, first_epoch: int = 0
    ) -> None:
        if batch_size < 1 or dataset_size < batch_size:
            raise ConfigError(
                f"workload: need dataset_size >= batch_size >= 1, got {dataset_size}, {batch_size}"
            )
        if not 0 <= first_epoch <= epochs:
            raise ConfigError(f"workload: first epoch {first_epoch} outside 0..{epochs}")
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.epochs = epochs
        self._next_epoch = first_epoch
        self._pools: list[ChunkPool] = []
        self.stopped = False
        """True once :meth:`stop` was called: nothing more is handed out."""
        self._open_next()

    # --- queries ----------------------------------------------------------------------------

    @property
    def epoch_batches(self) -> int:
        """Batches in one epoch (the last one shorter when the batch size does not divide
        the dataset)."""
        return -(-self.dataset_size // self.batch_size)

    @property
    def current_epoch(self) -> int:
        """The oldest epoch still in progress (the last one once everything is done)."""
        if self._pools:
            return self._pools[0].epoch
        return max(self._next_epoch - 1, 0)

    @property
    def exhausted(self) -> bool:
        """Nothing left to hand out: every epoch has been dispatched, or the work stopped."""
        no_more = self.stopped or self._next_epoch >= self.epochs
        return no_more and all(p.drained for p in self._pools)

    @property
    def done(self) -> bool:
        """Exhausted, and every batch handed out has been finished."""
        return self.exhausted and all(p.done() for p in self._pools)

    @property
    def pools(self) -> tuple[ChunkPool, ...]:
        """The epochs in progress, oldest first."""
        return tuple(self._pools)

    def in_flight(self, rank: int) -> int:
        """Batches ``rank`` was given and has not finished, over every epoch."""
        return sum(pool.ledger.in_flight(rank) for pool in self._pools)

    def quiesced(self, ranks: Iterable[int]) -> Set[int]:
        """Ranks with nothing in flight once no work is left to hand out (the trigger's
        exemption); empty while work remains, since then every window is filled.

        A view, read when asked: a membership test costs one rank's ledger lookups, not a scan
        of every rank (the trigger asks after each batch report, and at the end of a run every
        window is the last one)."""
        if not self.exhausted:
            return frozenset()
        return _Quiesced(self, ranks)

    # --- changes ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Hand out nothing more, from this epoch or a later one: the work is done once what
        was handed out is finished. Idempotent."""
        self.stopped = True
        for pool in self._pools:
            pool.close()

    def _open_next(self) -> ChunkPool | None:
        if self.stopped or self._next_epoch >= self.epochs:
            return None
        pool = ChunkPool(self._next_epoch, self.dataset_size, self.batch_size)
        self._next_epoch += 1
        self._pools.append(pool)
        return pool

    def dispatch_window(self, plan: Mapping[int, int]) -> list[tuple[int, WorkMessage]]:
        """Hand each rank ``plan[rank]`` batches, continuing into the next epoch if needed.

        Within one epoch a shortfall is shared in proportion to the plan (largest remainder);
        what a rank still lacks comes from the next epoch. Only the run's very last window can
        be short. Returns the assignments to send, in order.
        """
        wanted = {rank: count for rank, count in plan.items() if count > 0}
        sends: list[tuple[int, WorkMessage]] = []
        index = 0
        while wanted:
            if index == len(self._pools) and self._open_next() is None:
                break
            pool = self._pools[index]
            index += 1
            if pool.drained:
                continue
            for rank, message in pool.dispatch_window(wanted):
                wanted[rank] -= span_batches(message, self.batch_size)
                sends.append((rank, message))
            wanted = {rank: count for rank, count in wanted.items() if count > 0}
        return sends

    def complete(self, rank: int) -> tuple[int | None, int]:
        """Credit one finished batch of ``rank`` to the oldest epoch in which it holds work.

        Returns that epoch (None if the rank held none) and the batches the rank still has in
        flight afterwards, over every epoch.
        """
        credited: int | None = None
        left = 0
        for pool in self._pools:
            ledger = pool.ledger
            in_flight = ledger.in_flight(rank)
            if credited is None and in_flight > 0:
                ledger.complete(rank)
                credited = pool.epoch
                in_flight -= 1
            left += in_flight
        return credited, left

    def complete_many(self, rank: int, batches: int) -> list[tuple[int, int]]:
        """Credit ``batches`` finished batches of ``rank`` as :meth:`complete` would one by
        one, oldest epoch first; ``batches`` must not exceed :meth:`in_flight`.

        Returns each epoch credited and how many of the batches it took, in order.
        """
        credited: list[tuple[int, int]] = []
        for pool in self._pools:
            if batches == 0:
                break
            ledger = pool.ledger
            take = min(batches, ledger.in_flight(rank))
            if take > 0:
                ledger.complete(rank, take)
                credited.append((pool.epoch, take))
                batches -= take
        assert batches == 0, "complete_many: more batches than the rank holds"
        return credited

    def reassign(self, dead: int, survivors: Sequence[int]) -> list[tuple[int, ExtendPartition]]:
        """Split ``dead``'s unfinished batches of every epoch among ``survivors``."""
        sends: list[tuple[int, ExtendPartition]] = []
        for pool in self._pools:
            sends += pool.reassign(dead, survivors)
        return sends

    def readmit(self, rank: int) -> None:
        """Let a rank that left take work again (a restarted process rejoining)."""
        for pool in self._pools:
            pool.readmit(rank)

    def pop_finished(self) -> list[ChunkPool]:
        """Remove and return the oldest epochs that are completely done, in order.

        An epoch is finished when its pool is drained and every batch of it is done; the last
        epoch in progress is kept until nothing more can be dispatched, so that a new window
        still knows where the run stands.
        """
        finished: list[ChunkPool] = []
        while self._pools and self._pools[0].done():
            if len(self._pools) == 1 and not self.exhausted and self._pools[0].drained:
                # Open the next epoch first so the run never sits with no pool.
                self._open_next()
            finished.append(self._pools.pop(0))
        return finished


class _Quiesced(Set[int]):
    """:meth:`Workload.quiesced` as a lazy set over ``ranks`` (the work is exhausted)."""

    def __init__(self, work: Workload, ranks: Iterable[int]) -> None:
        self._work = work
        self._ranks = ranks if isinstance(ranks, Set) else frozenset(ranks)

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and rank in self._ranks and self._work.in_flight(rank) == 0

    def __iter__(self) -> Iterator[int]:
        return (rank for rank in self._ranks if self._work.in_flight(rank) == 0)

    def __len__(self) -> int:
        return sum(1 for _ in self)
