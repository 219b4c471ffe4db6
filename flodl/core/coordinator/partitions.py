"""Who trains on which samples: seeded epoch orders, partition sizes, chunk dispatch.

**Unit.** Work is handed out as ranges ``[offset, offset + size)`` of *positions* in the
epoch order ``epoch_order(seed, epoch, n)`` (a permutation of the dataset indices that
every rank computes identically). A rank trains on ``order[offset:offset + size]``.

**Progress.** A rank works through the ranges it was given in the order it got them; it
cuts each range into batches of ``batch_size`` samples, the last batch of a range possibly
shorter, and a batch never spans two ranges. Each finished batch is reported (one
``Batch`` message), and the caller feeds the count to :meth:`EpochLedger.complete`. From
that count alone the ledger knows exactly which samples are done, so when a rank dies
its unfinished remainder is split among the survivors (``ExtendPartition``) with no sample
lost or trained twice.

**Two ways to hand out an epoch.**

* :func:`plan_epoch`: one partition per rank up front (``StartEpoch``), sized equally
  (SYNC, remainder to the first ranks), by throughput (proportional to
  ``1 / max(ms, 0.001)``, remainder to the fastest) or by user ratios (normalised floor,
  remainder to the largest); the slices are consecutive and cover all ``n`` positions.
* :class:`ChunkPool`: progressive dispatch. The epoch's samples are rounded down to whole
  batches; each dispatch hands a rank exactly its batch count (``StartEpoch`` for its first
  chunk of the epoch, ``ExtendPartition`` after), and when the pool cannot cover a whole
  window the rest is split by largest remainder (zero allowed).

Exact rational arithmetic (``fractions.Fraction``) keeps the sizing deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction

from flodl.core.common.order import Span
from flodl.core.common.policy import Policy
from flodl.errors import ConfigError, CoordinatorError
from flodl.wire.messages import ExtendPartition, StartEpoch

MIN_BATCH_MS = 0.001
"""Throughput sizing treats faster timings as this (ms), so a zero never divides."""


# --- sizing -------------------------------------------------------------------------------


def _check_total(total: int, parts: int) -> None:
    if total < 0:
        raise ConfigError(f"partitions: total must be >= 0, got {total}")
    if parts < 1:
        raise ConfigError("partitions: need at least one rank")


def equal_sizes(total: int, parts: int) -> list[int]:
    """``total`` split in ``parts`` sizes differing by at most one, larger ones first."""
    _check_total(total, parts)
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _floor_shares(total: int, weights: Sequence[Fraction]) -> list[int]:
    whole = sum(weights, Fraction(0))
    return [int(total * w / whole) for w in weights]  # int() floors a non-negative Fraction


def _first_max(values: Sequence[Fraction]) -> int:
    best = 0
    for i, value in enumerate(values):
        if value > values[best]:
            best = i
    return best


def throughput_sizes(total: int, ms_per_batch: Sequence[float]) -> list[int]:
    """Sizes proportional to ``1 / max(ms, 0.001)``; the floor's remainder to the fastest
    (the lowest position among equally fast)."""
    _check_total(total, len(ms_per_batch))
    weights = []
    for ms in ms_per_batch:
        if not math.isfinite(ms):
            raise ConfigError(f"throughput_sizes: timings must be finite, got {ms}")
        weights.append(1 / Fraction(max(ms, MIN_BATCH_MS)))
    sizes = _floor_shares(total, weights)
    sizes[_first_max(weights)] += total - sum(sizes)
    return sizes


def ratio_sizes(total: int, ratios: Sequence[float]) -> list[int]:
    """Sizes from user ratios: normalised floor, remainder to the largest ratio (the lowest
    position among equal ones)."""
    _check_total(total, len(ratios))
    if any(not (math.isfinite(r) and r >= 0) for r in ratios) or not any(r > 0 for r in ratios):
        raise ConfigError(f"ratio_sizes: ratios must be >= 0 and not all zero, got {ratios}")
    weights = [Fraction(r) for r in ratios]
    sizes = _floor_shares(total, weights)
    sizes[_first_max(weights)] += total - sum(sizes)
    return sizes


def largest_remainder_sizes(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` split in proportion to integer ``weights``: floors, then one more each to
    the largest fractional parts (ties to the lower position). A share may be zero."""
    _check_total(total, len(weights))
    whole = sum(weights)
    if any(w < 0 for w in weights) or whole <= 0:
        raise ConfigError(f"largest_remainder_sizes: bad weights {list(weights)}")
    sizes = [total * w // whole for w in weights]
    rest = total - sum(sizes)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % whole), i))
    for i in by_remainder[:rest]:
        sizes[i] += 1
    return sizes


def partition_sizes(
    policy: Policy,
    total: int,
    parts: int,
    *,
    ms_per_batch: Sequence[float] | None = None,
    ratios: Sequence[float] | None = None,
) -> list[int]:
    """The sizing rule floDl applies: user ratios if given; equal under SYNC; by throughput
    under CADENCE/ASYNC when timings are known; equal otherwise."""
    for given in (ms_per_batch, ratios):
        if given is not None and len(given) != parts:
            raise ConfigError(f"partition_sizes: {len(given)} entries for {parts} ranks")
    if ratios is not None:
        return ratio_sizes(total, ratios)
    if policy is not Policy.SYNC and ms_per_batch is not None:
        return throughput_sizes(total, ms_per_batch)
    return equal_sizes(total, parts)


# --- the ledger of who holds which samples ------------------------------------------------


def _batches_in(size: int, batch_size: int) -> int:
    return -(-size // batch_size)


class EpochLedger:
    """Which spans of one epoch each rank holds, and how many batches it finished.

    A rank's spans are kept in the order given; its finished batches are counted across
    them, each span taking ``ceil(size / batch_size)`` batches.
    """

    def __init__(self, epoch: int, batch_size: int) -> None:
        if batch_size < 1:
            raise ConfigError(f"partitions: batch_size must be >= 1, got {batch_size}")
        self._epoch = epoch
        self._batch_size = batch_size
        self._spans: dict[int, list[Span]] = {}
        self._dispatched: dict[int, int] = {}
        self._completed: dict[int, int] = {}
        self._closed: set[int] = set()
        self._outstanding = 0
        """Batches the live ranks were given and have not finished (summed: asked after every
        report, so kept rather than counted)."""

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def ranks(self) -> tuple[int, ...]:
        """Ranks still holding work in this epoch (dead ones removed), ascending."""
        return tuple(sorted(r for r in self._spans if r not in self._closed))

    def spans(self, rank: int) -> tuple[Span, ...]:
        """Every span given to ``rank`` in this epoch, in order."""
        return tuple(self._spans.get(rank, ()))

    def dispatched(self, rank: int) -> int:
        """Batches handed to ``rank`` (its spans' batch counts summed)."""
        return self._dispatched.get(rank, 0)

    def completed(self, rank: int) -> int:
        return self._completed.get(rank, 0)

    def in_flight(self, rank: int) -> int:
        """Batches ``rank`` was given and has not finished."""
        return self.dispatched(rank) - self.completed(rank)

    def all_completed(self) -> bool:
        """True when every live rank finished every batch it was given."""
        return self._outstanding == 0

    def assign(self, rank: int, span: Span) -> StartEpoch | ExtendPartition:
        """Give ``span`` to ``rank``: StartEpoch for its first span this epoch, else
        ExtendPartition. Raises CoordinatorError for a rank removed by :meth:`reassign`."""
        if rank in self._closed:
            raise CoordinatorError(f"partitions: rank {rank} left epoch {self._epoch}")
        if span.size < 1:
            raise CoordinatorError(f"partitions: empty span for rank {rank}")
        first = rank not in self._spans
        self._spans.setdefault(rank, []).append(span)
        batches = _batches_in(span.size, self._batch_size)
        self._dispatched[rank] = self.dispatched(rank) + batches
        self._outstanding += batches
        if first:
            return StartEpoch(
                epoch=self._epoch, partition_offset=span.offset, partition_size=span.size
            )
        return ExtendPartition(epoch=self._epoch, offset=span.offset, size=span.size)

    def complete(self, rank: int, batches: int = 1) -> int:
        """Record ``batches`` finished batches of ``rank``; returns how many did not fit.

        Batches beyond what the rank was given are not counted here; the returned overflow
        lets the caller credit them to the next epoch or treat the rank as misbehaving.
        Reports from a rank removed by :meth:`reassign` all overflow.
        """
        if batches < 0:
            raise CoordinatorError(f"partitions: negative batch count {batches}")
        if rank in self._closed:
            return batches
        fit = min(batches, self.in_flight(rank))
        self._completed[rank] = self.completed(rank) + fit
        self._outstanding -= fit
        return batches - fit

    def remainder(self, rank: int) -> list[Span]:
        """The parts of ``rank``'s spans it has not finished, in order."""
        done = self.completed(rank)
        left: list[Span] = []
        for span in self._spans.get(rank, ()):
            batches = _batches_in(span.size, self._batch_size)
            if done >= batches:
                done -= batches
                continue
            skip = done * self._batch_size
            left.append(Span(span.offset + skip, span.size - skip))
            done = 0
        return left

    def readmit(self, rank: int) -> None:
        """Let ``rank`` hold work again as a new holder (a restarted process rejoining).

        Its earlier spans are forgotten: their unfinished part was already handed out by
        :meth:`reassign`, so its next span is a first one (StartEpoch). No-op for a rank
        that never left.
        """
        if rank not in self._closed:
            return
        self._closed.discard(rank)
        self._spans.pop(rank, None)
        self._dispatched.pop(rank, None)
        self._completed.pop(rank, None)

    def reassign(self, dead: int, survivors: Sequence[int]) -> list[tuple[int, ExtendPartition]]:
        """Split ``dead``'s unfinished remainder among ``survivors`` and remove ``dead``.

        The remainder is cut into batches (as ``dead`` would have), and survivors in
        ascending order take consecutive runs of them: ``q + 1`` batches for the first
        ``r`` survivors and ``q`` for the rest, where ``q, r = divmod(batches, len)``.
        Returns ``(rank, ExtendPartition)`` pairs to send, in order. With no survivors the
        remainder is dropped (the run is ending anyway); a rank with nothing left is just
        removed.
        """
        if dead in self._closed:
            return []
        takers = sorted(set(survivors) - {dead} - self._closed)
        pieces = self.remainder(dead)
        self._outstanding -= self.in_flight(dead)  # handed to the takers below, or dropped
        self._closed.add(dead)
        if not takers or not pieces:
            return []
        units: list[Span] = []
        for piece in pieces:
            for start in range(piece.offset, piece.end, self._batch_size):
                units.append(Span(start, min(self._batch_size, piece.end - start)))
        sends: list[tuple[int, ExtendPartition]] = []
        cursor = 0
        for rank, count in zip(takers, equal_sizes(len(units), len(takers)), strict=True):
            for span in _merge(units[cursor : cursor + count]):
                message = self.assign(rank, span)
                assert isinstance(message, ExtendPartition) or self.spans(rank) == (span,)
                sends.append((rank, _as_extension(message)))
            cursor += count
        return sends


def _as_extension(message: StartEpoch | ExtendPartition) -> ExtendPartition:
    # A survivor that held nothing this epoch still receives the remainder as an extension:
    # it is a dead rank's share, not a partition of its own.
    if isinstance(message, ExtendPartition):
        return message
    return ExtendPartition(
        epoch=message.epoch, offset=message.partition_offset, size=message.partition_size
    )


def _merge(units: Sequence[Span]) -> list[Span]:
    merged: list[Span] = []
    for unit in units:
        if merged and merged[-1].end == unit.offset:
            merged[-1] = Span(merged[-1].offset, merged[-1].size + unit.size)
        else:
            merged.append(unit)
    return merged


# --- static partitions --------------------------------------------------------------------


def plan_epoch(
    epoch: int,
    ranks: Sequence[int],
    sizes: Sequence[int],
    batch_size: int,
) -> tuple[EpochLedger, list[tuple[int, StartEpoch]]]:
    """Consecutive, disjoint partitions: ``ranks[i]`` gets the ``i``-th slice of ``sizes``.

    Returns the ledger that tracks them and one StartEpoch per rank with a non-empty slice
    (a rank with a zero size gets nothing).
    """
    if len(ranks) != len(sizes) or len(set(ranks)) != len(ranks):
        raise ConfigError("plan_epoch: need one size per distinct rank")
    ledger = EpochLedger(epoch, batch_size)
    starts: list[tuple[int, StartEpoch]] = []
    offset = 0
    for rank, size in zip(ranks, sizes, strict=True):
        if size < 0:
            raise ConfigError(f"plan_epoch: negative size for rank {rank}")
        if size:
            message = ledger.assign(rank, Span(offset, size))
            assert isinstance(message, StartEpoch)
            starts.append((rank, message))
        offset += size
    return ledger, starts


# --- progressive dispatch -----------------------------------------------------------------


class ChunkPool:
    """Progressive dispatch of one epoch: whole batches from a cursor, on demand.

    The epoch's ``n_samples`` positions are cut into batches; when ``n_samples`` is not a
    multiple of the batch size the last batch is shorter (nothing is dropped: every sample is
    trained once per epoch). The epoch is done when the cursor is exhausted and every live rank
    finished what it was given.
    """

    def __init__(self, epoch: int, n_samples: int, batch_size: int) -> None:
        if n_samples < 0:
            raise ConfigError(f"chunk pool: n_samples must be >= 0, got {n_samples}")
        self._ledger = EpochLedger(epoch, batch_size)
        self._n_samples = n_samples
        self._total_batches = _batches_in(n_samples, batch_size)
        self._cursor = 0
        self._closed = False

    @property
    def ledger(self) -> EpochLedger:
        return self._ledger

    @property
    def epoch(self) -> int:
        return self._ledger.epoch

    @property
    def total_batches(self) -> int:
        return self._total_batches

    @property
    def remaining_batches(self) -> int:
        """Batches not yet handed to anyone (none once the pool is closed)."""
        return 0 if self._closed else self._total_batches - self._cursor

    @property
    def drained(self) -> bool:
        """True when the cursor is exhausted or the pool closed."""
        return self._closed or self._cursor >= self._total_batches

    def close(self) -> None:
        """Hand out nothing more: the batches not yet handed out are left untrained (the run
        was stopped). What was handed out stays to be finished."""
        self._closed = True

    def is_quiesced(self, rank: int) -> bool:
        """Nothing in flight for ``rank`` and the pool drained (the trigger's exemption)."""
        return self.drained and self._ledger.in_flight(rank) == 0

    def done(self) -> bool:
        """Cursor exhausted and every live rank finished what it was given."""
        return self.drained and self._ledger.all_completed()

    def complete(self, rank: int, batches: int = 1) -> int:
        """See :meth:`EpochLedger.complete`."""
        return self._ledger.complete(rank, batches)

    def dispatch(self, rank: int, batches: int) -> StartEpoch | ExtendPartition | None:
        """Hand ``rank`` the next ``min(batches, remaining)`` batches (None if that is 0)."""
        if batches < 0:
            raise CoordinatorError(f"chunk pool: negative batch count {batches}")
        take = min(batches, self.remaining_batches)
        if take == 0:
            return None
        bs = self._ledger.batch_size
        start = self._cursor * bs
        span = Span(start, min(take * bs, self._n_samples - start))
        self._cursor += take
        return self._ledger.assign(rank, span)

    def dispatch_window(
        self, counts: Mapping[int, int]
    ) -> list[tuple[int, StartEpoch | ExtendPartition]]:
        """Hand each rank in ``counts`` exactly ``counts[rank]`` batches, ascending by rank.

        When fewer batches remain than the window needs, the remainder is split in
        proportion to the counts by largest remainder (a rank may get none).
        """
        ranks = sorted(counts)
        wanted = [counts[r] for r in ranks]
        if any(c < 0 for c in wanted):
            raise CoordinatorError(f"chunk pool: negative count in {dict(counts)}")
        if sum(wanted) > self.remaining_batches and sum(wanted) > 0:
            wanted = largest_remainder_sizes(self.remaining_batches, wanted)
        sends: list[tuple[int, StartEpoch | ExtendPartition]] = []
        for rank, count in zip(ranks, wanted, strict=True):
            message = self.dispatch(rank, count)
            if message is not None:
                sends.append((rank, message))
        return sends

    def readmit(self, rank: int) -> None:
        """See :meth:`EpochLedger.readmit`."""
        self._ledger.readmit(rank)

    def reassign(self, dead: int, survivors: Sequence[int]) -> list[tuple[int, ExtendPartition]]:
        """See :meth:`EpochLedger.reassign` (chunks are whole batches, so shares are too)."""
        return self._ledger.reassign(dead, survivors)
