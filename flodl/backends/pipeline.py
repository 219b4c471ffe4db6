"""One averaging round reduced in buckets, so packing and checking overlap the collective.

The flat buffer (:class:`~flodl.averaging.mass.FlatLayout`) is cut into buckets of equal
size. On one worker thread: reduce the two sums (mass and movers, a few bytes), so every rank
knows its share ``m / M`` of the average; then copy bucket 0's share ``p * m / M`` into
scratch (taking ``||p||`` in the same pass), start its all-reduce, copy bucket 1 while bucket
0 is on the wire, and so on. The SUM of the shares *is* the average, so nothing is divided
after the collective: as each bucket lands it is only read (checksum, ``||a||``,
``||a - p||``) while the later buckets are still being reduced. Torch ops release the GIL and
gloo reduces in its own threads, so compute and communication run side by side, and the
scratch buffer ends up holding the average.

Nothing here writes into the live tensors except :func:`install`, which the caller runs only
after the whole round (every bucket, and the verify collective) succeeded: it makes the
parameters *views of the scratch buffer* (no copy at all) where it can, and copies the rest.
A round that fails part way leaves its scratch buffer to the ops still in flight: the caller
must drop it (an abandoned op may still write into it), never hand it out again.

Every rank must cut the buffer the same way: the plan depends only on the layout and
``bucket_elements``, which must be equal on all ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import torch
import torch.distributed as dist

from flodl.averaging.kernels import NormSample, gap_piece, share_piece
from flodl.averaging.mass import (
    HEADER,
    Applied,
    FlatLayout,
    Reduced,
    checksum_part,
    combine_checksums,
    combine_squares,
    copy_buffers,
    divisors,
    mass_of,
    mover_of,
    read_sums,
    squared_norm,
)
from flodl.errors import BackendError, CollectiveAborted


class PendingOp(Protocol):
    """A collective started in the background."""

    def wait(self) -> None:
        """Block until it ended; raise RuntimeError if it failed."""
        ...


class StartsAllreduce(Protocol):
    def start_allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> PendingOp:
        """Start reducing ``tensor`` in place with every member; return at once."""
        ...


@attrs.frozen
class Piece:
    """The part of one member tensor (flattened) that lies in one bucket."""

    member: int  # index into params followed by the averaged buffers
    is_param: bool
    offset: int  # first element inside the member
    start: int  # first element inside the flat buffer
    end: int


@attrs.frozen
class Bucket:
    start: int
    end: int
    pieces: tuple[Piece, ...]


@attrs.frozen
class BucketPlan:
    """How a layout is cut into buckets (equal on every rank for equal inputs)."""

    layout: FlatLayout
    buckets: tuple[Bucket, ...]

    @property
    def spare_elements(self) -> int:
        widest = max((p.end - p.start for b in self.buckets for p in b.pieces), default=0)
        block = CPU_BLOCK_ELEMENTS if self.layout.device.type == "cpu" else DEVICE_BLOCK_ELEMENTS
        return max(min(widest, block), 1)

    @staticmethod
    def of(layout: FlatLayout, bucket_elements: int | None) -> BucketPlan:
        """Buckets of ``bucket_elements`` (rounded up to even; None: one bucket).

        Bucket 0 starts with the mass and mover sums. Cuts fall on even elements, so each
        bucket starts on a whole 8-byte word (see :func:`checksum_part`).
        """
        total = layout.total
        if bucket_elements is None:
            size = total
        elif bucket_elements < 2:
            raise BackendError(f"bucket_elements must be >= 2, got {bucket_elements}")
        else:
            size = bucket_elements + bucket_elements % 2
        spans = [
            *layout.param_ranges(),
            *(s for s in layout.buffer_ranges() if s is not None),
        ]
        params = len(layout.param_numels)
        buckets = []
        for start in range(0, total, max(size, 1)):
            end = min(start + size, total)
            pieces = tuple(
                Piece(i, i < params, max(start, a) - a, max(start, a), min(end, b))
                for i, (a, b) in enumerate(spans)
                if a < end and b > start
            )
            buckets.append(Bucket(start, end, pieces))
        return BucketPlan(layout, tuple(buckets))


CPU_BLOCK_ELEMENTS = 1 << 17
"""Block for the norms on CPU: ``S``, ``p`` and ``S - M p`` blocks (512 KiB each in float32)
stay in a core's L2 between the subtraction and the three norms."""

DEVICE_BLOCK_ELEMENTS = 1 << 24
"""Block on an accelerator: large, since every block costs kernel launches there."""


@attrs.define(eq=False)
class Scratch:
    """A flat buffer for one round and a small spare for slices of ``S - M p``."""

    flat: torch.Tensor
    spare: torch.Tensor

    def fits(self, layout: FlatLayout, spare: int) -> bool:
        return (
            self.flat.numel() == layout.total
            and self.flat.dtype == layout.dtype
            and self.flat.device == layout.device
            and self.spare.numel() >= spare
        )


class ScratchPool:
    """Scratch buffers kept between rounds: a fresh 40 MB buffer costs ~20 ms of page faults.

    A buffer comes back (:meth:`give_back`) only from a round whose ops have all ended; one
    from a failed or abandoned round is simply dropped. Holds at most ``keep`` idle buffers.
    """

    def __init__(self, keep: int = 2) -> None:
        self._idle: list[Scratch] = []
        self._keep = keep

    def take(self, plan: BucketPlan) -> Scratch:
        layout = plan.layout
        wanted = plan.spare_elements
        while self._idle:
            scratch = self._idle.pop()
            if scratch.fits(layout, wanted):
                return scratch
        flat = torch.zeros(layout.total, dtype=layout.dtype, device=layout.device)  # gaps: 0
        spare = torch.empty(wanted, dtype=layout.dtype, device=layout.device)
        return Scratch(flat, spare)

    def give_back(self, scratch: Scratch) -> None:
        if len(self._idle) < self._keep:
            self._idle.append(scratch)

    def clear(self) -> None:
        self._idle.clear()


@attrs.frozen
class Landed:
    """A reduced round, finished in scratch: the average (unless skipped) and its checksum."""

    reduced: Reduced
    checksum: int
    applied: Applied | None  # norms, when the round packed the live tensors itself

    @property
    def skipped(self) -> bool:
        return self.reduced.total_mass <= 0


def members(
    params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], layout: FlatLayout
) -> list[torch.Tensor]:
    """Params, then averaged buffers, each flattened (a view when contiguous)."""
    chosen = [b for b, a in zip(buffers, layout.averaged_buffers, strict=True) if a]
    return [t.reshape(-1) for t in [*params, *chosen]]


@torch.no_grad()
def reduce_in_buckets(
    comm: StartsAllreduce,
    plan: BucketPlan,
    scratch: Scratch,
    sources: Sequence[torch.Tensor] | None,
    batches: int,
    gamma: float,
    abandoned: Callable[[], bool],
    checksum: bool = True,
    sample: NormSample | None = None,
) -> Landed:
    """Reduce one round in buckets; when the summed mass is above 0, the scratch is left
    holding the average (at zero mass the local state is kept and the scratch is not used).

    With ``sources`` (from :func:`members`; read, never written) the round is *pre-scaled*
    (:func:`_reduce_shares`): the two sums (mass, movers) are reduced first, so each rank
    copies its share ``p * m / M`` into scratch and the SUM all-reduce itself yields the
    average; as each bucket lands, only the norms ``||a||`` and ``||a - p||`` are read from it
    (``||p||`` was taken during the copy; with ``sample``, ``||a||`` and ``||a - p||`` are
    estimated from that fixed sample of each large parameter, :class:`NormSample`). With
    ``sources`` None the scratch already holds this rank's mass-weighted contribution (a
    snapshot, :func:`~flodl.averaging.mass.pack`) and each landed bucket is divided by
    the sums; no norms are taken.

    The checksum (taken when ``checksum``, else 0) covers the reduced buffer as every rank
    holds it: equal sums on every rank (and, for a snapshot, the same deterministic division)
    give bitwise equal averages.

    Returns after every op ended. Raises :class:`CollectiveAborted` when ``abandoned()``
    turns true (checked before each op starts and after each lands), RuntimeError when an op
    failed; in both cases ops may still be in flight on the scratch.
    """
    if sources is not None:
        return _reduce_shares(
            comm, plan, scratch, sources, batches, gamma, abandoned, checksum, sample
        )
    return _reduce_snapshot(comm, plan, scratch, abandoned, checksum)


def _reduce_shares(
    comm: StartsAllreduce,
    plan: BucketPlan,
    scratch: Scratch,
    sources: Sequence[torch.Tensor],
    batches: int,
    gamma: float,
    abandoned: Callable[[], bool],
    checksum: bool,
    sample: NormSample | None,
) -> Landed:
    flat, layout = scratch.flat, plan.layout
    mass, mover = mass_of(batches, gamma), mover_of(batches)
    flat[layout.mass_index], flat[layout.mover_index] = mass, mover
    check_abandoned(abandoned, "abandoned before the sums were reduced")
    comm.start_allreduce(flat[:HEADER], dist.ReduceOp.SUM).wait()
    check_abandoned(abandoned, "abandoned while the sums were reduced")
    reduced = read_sums(flat, layout)
    params = [piece for bucket in plan.buckets for piece in bucket.pieces if piece.is_param]
    if reduced.total_mass <= 0:  # nobody moved: every rank keeps its own state
        pre = combine_squares([squared_norm(_source(sources, p)) for p in params])
        header = [checksum_part(flat[:HEADER])] if checksum else []
        return Landed(reduced, combine_checksums(header), Applied(pre, pre, 0.0))
    by_mass, by_movers = divisors(reduced)
    param_share, buffer_share = mass / by_mass, mover / by_movers
    norms = _ShareNorms()
    ops = []
    for bucket in plan.buckets:
        for piece in bucket.pieces:
            out = flat[piece.start : piece.end]
            if piece.is_param:
                norms.pre.append(share_piece(_source(sources, piece), out, param_share))
            else:  # buffers (a few, small) need no norm
                share_piece(_source(sources, piece), out, buffer_share)
        check_abandoned(abandoned, "abandoned before every bucket was started")
        body = max(bucket.start, HEADER)  # the sums are reduced already
        ops.append(
            comm.start_allreduce(flat[body : bucket.end], dist.ReduceOp.SUM)
            if body < bucket.end
            else None
        )

    sums: list[torch.Tensor] = []
    for bucket, op in zip(plan.buckets, ops, strict=True):
        if op is not None:
            op.wait()
        check_abandoned(abandoned, "abandoned while the buckets were landing")
        if checksum:
            sums.append(checksum_part(flat[bucket.start : bucket.end]))
        for piece in bucket.pieces:
            if piece.is_param:
                average = flat[piece.start : piece.end]
                source = _source(sources, piece)
                norms.take(gap_piece(average, source, scratch.spare, sample, piece.start))
    return Landed(reduced, combine_checksums(sums), norms.applied())


def _reduce_snapshot(
    comm: StartsAllreduce,
    plan: BucketPlan,
    scratch: Scratch,
    abandoned: Callable[[], bool],
    checksum: bool,
) -> Landed:
    flat = scratch.flat
    ops = []
    for bucket in plan.buckets:
        check_abandoned(abandoned, "abandoned before every bucket was started")
        ops.append(comm.start_allreduce(flat[bucket.start : bucket.end], dist.ReduceOp.SUM))
    sums: list[torch.Tensor] = []
    reduced = Reduced(0.0, 0.0)
    for index, (bucket, op) in enumerate(zip(plan.buckets, ops, strict=True)):
        op.wait()
        check_abandoned(abandoned, "abandoned while the buckets were landing")
        if index == 0:
            reduced = read_sums(flat, plan.layout)
            by_mass, by_movers = divisors(reduced)
        if checksum:
            sums.append(checksum_part(flat[bucket.start : bucket.end]))
        if reduced.total_mass > 0:
            for piece in bucket.pieces:
                flat[piece.start : piece.end].div_(by_mass if piece.is_param else by_movers)
    return Landed(reduced, combine_checksums(sums), None)


def check_abandoned(abandoned: Callable[[], bool], why: str) -> None:
    """Raise :class:`CollectiveAborted` (``why``) once ``abandoned()`` is true: between the
    collectives of a worker thread whose caller has gone, start nothing more and stop reading
    its tensors."""
    if abandoned():
        raise CollectiveAborted(why)


@attrs.define
class _ShareNorms:
    """Squared norms of ``p`` (taken as the shares are copied), and of ``a - p`` and ``a`` (as
    the buckets land), summed over pieces in float64; tensors are synchronised once."""

    pre: list[float | torch.Tensor] = attrs.field(factory=list)
    diff: list[float | torch.Tensor] = attrs.field(factory=list)
    post: list[float | torch.Tensor] = attrs.field(factory=list)

    def take(self, gap: tuple[float, float] | list[torch.Tensor]) -> None:
        self.diff.append(gap[0])
        self.post.append(gap[1])

    def applied(self) -> Applied:
        diff, post, pre = (_total(squares) for squares in (self.diff, self.post, self.pre))
        return Applied(math.sqrt(pre), math.sqrt(post), math.sqrt(diff))


def _total(squares: Sequence[float | torch.Tensor]) -> float:
    floats = [q for q in squares if not isinstance(q, torch.Tensor)]
    tensors = [q.to(torch.float64) for q in squares if isinstance(q, torch.Tensor)]
    total = math.fsum(floats)
    if tensors:
        total += float(torch.stack(tensors).sum().item())
    return total


def _source(sources: Sequence[torch.Tensor], piece: Piece) -> torch.Tensor:
    return sources[piece.member][piece.offset : piece.offset + piece.end - piece.start]


@torch.no_grad()
def install(
    flat: torch.Tensor,
    layout: FlatLayout,
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    swap: bool,
) -> bool:
    """Put the average held in ``flat`` into the live tensors; True if some parameter now
    views ``flat`` (the caller must then keep ``flat`` out of use for as long as it does).

    With ``swap``, a contiguous parameter of the flat dtype becomes a view of its slice of
    ``flat`` (``p.data = ...``: same Parameter object, shape and strides; no copy). Other
    parameters, and every float buffer, are copied (cast on write, strides kept).
    """
    viewed = False
    for p, (start, end) in zip(params, layout.param_ranges(), strict=True):
        average = flat[start:end].view(p.shape)
        if swap and p.is_contiguous() and p.dtype == flat.dtype and p.device == flat.device:
            p.data = average
            viewed = True
        else:
            p.copy_(average)
    copy_buffers(flat, layout, buffers)
    return viewed


def views_storage_of(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> bool:
    """Whether any of ``tensors`` still lies in ``flat``'s storage."""
    base = flat.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == base for t in tensors)
