"""One averaging round reduced in buckets, so packing and checking overlap the collective.

The flat buffer (:class:`~flodl.backends.averaging.FlatLayout`) is cut into buckets of equal
size. On one worker thread: pack bucket 0, start its all-reduce, pack bucket 1 while bucket 0
is on the wire, and so on; then, as each bucket lands, checksum it and take its norms while
the later buckets are still being reduced, and divide it in place, block by block while the
block is in cache. Torch ops release the GIL and gloo reduces in its own threads, so compute
and communication run side by side, and the scratch buffer ends up holding the average.

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

from flodl.backends.averaging import (
    Applied,
    FlatLayout,
    Reduced,
    checksum_part,
    combine_checksums,
    copy_buffers,
    divisors,
    mass_of,
    mover_of,
    read_sums,
    scaled_copy,
    squared_norm,
)
from flodl.backends.kernels import PieceNorms, finish_piece
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
) -> Landed:
    """Pack ``sources`` bucket by bucket into scratch and SUM-reduce; check each as it lands.

    With ``sources`` (from :func:`members`; read, never written) this rank's contribution is
    packed from them, and as each bucket lands its parameters are divided by the summed mass
    ``M`` and the norms ``||p||``, ``||a||`` and ``||a - p||`` taken (``a = S / M`` the
    average) in one pass (:func:`~flodl.backends.kernels.finish_piece`), so each block of
    ``S`` and ``p`` is read from memory once. With ``sources`` None the scratch already holds
    this rank's contribution and no norms are taken. Either way, when the summed mass is
    above 0, the scratch is left holding the average (params divided by the mass, float
    buffers by the movers); at zero mass it holds the (zero) sums.

    The checksum (taken when ``checksum``, else 0) covers the reduced sums, before any
    division: equal sums on every rank and the same deterministic division give bitwise
    equal averages.

    Returns after every bucket's op ended. Raises :class:`CollectiveAborted` when
    ``abandoned()`` turns true (checked before each op starts and after each lands),
    RuntimeError when an op failed; in both cases ops may still be in flight on the scratch.
    """
    flat = scratch.flat
    if sources is not None:
        mass, mover = mass_of(batches, gamma), mover_of(batches)
        flat[0], flat[1] = mass, mover
    ops = []
    for bucket in plan.buckets:
        if sources is not None:
            for piece in bucket.pieces:
                source = _source(sources, piece)
                scaled_copy(
                    source, mass if piece.is_param else mover, flat[piece.start : piece.end]
                )
        if abandoned():
            raise CollectiveAborted("abandoned before every bucket was started")
        ops.append(comm.start_allreduce(flat[bucket.start : bucket.end], dist.ReduceOp.SUM))

    sums: list[torch.Tensor] = []
    norms = _Norms()
    reduced = Reduced(0.0, 0.0)
    for index, (bucket, op) in enumerate(zip(plan.buckets, ops, strict=True)):
        op.wait()
        if abandoned():  # the caller has gone: stop reading its tensors
            raise CollectiveAborted("abandoned while the buckets were landing")
        if index == 0:
            reduced = read_sums(flat, plan.layout)
            by_mass, by_movers = divisors(reduced)
        if checksum:
            sums.append(checksum_part(flat[bucket.start : bucket.end]))
        for piece in bucket.pieces:
            summed = flat[piece.start : piece.end]
            if sources is not None and piece.is_param:
                mass_or_none = by_mass if reduced.total_mass > 0 else None
                norms.take(summed, _source(sources, piece), mass_or_none, scratch.spare)
            elif reduced.total_mass > 0:
                summed.div_(by_mass if piece.is_param else by_movers)

    applied = norms.applied() if sources is not None else None
    return Landed(reduced, combine_checksums(sums), applied)


@attrs.define
class _Norms:
    """Squared norms of ``p``, ``a`` and ``a - p`` summed over pieces (``a`` the average)."""

    fused: list[PieceNorms] = attrs.field(factory=list)
    tensors: list[list[torch.Tensor]] = attrs.field(factory=list)  # [diff, post, pre] each
    pre_only: list[torch.Tensor] = attrs.field(factory=list)

    def take(
        self, summed: torch.Tensor, source: torch.Tensor, mass: float | None, spare: torch.Tensor
    ) -> None:
        """Divide one landed piece by ``mass`` in place and take its norms
        (:func:`~flodl.backends.kernels.finish_piece`). ``mass`` None (a zero-mass round):
        only ``||p||``, nothing divided."""
        if mass is None:
            self.pre_only.append(squared_norm(source))
            return
        norms = finish_piece(summed, source, mass, spare)
        if isinstance(norms, PieceNorms):
            self.fused.append(norms)
        else:
            self.tensors.append(norms)

    def applied(self) -> Applied:
        """``pre``, ``post`` and ``diff`` norms of the whole round (syncs once per path)."""
        diff = post = pre = 0.0
        if self.tensors:
            summed = torch.stack([torch.stack(t) for t in self.tensors]).sum(dim=0).tolist()
            diff, post, pre = summed
        for piece in self.fused:
            diff, post, pre = diff + piece.diff, post + piece.post, pre + piece.pre
        if self.pre_only:
            pre += float(torch.stack([q.to(torch.float64) for q in self.pre_only]).sum())
        if not self.fused and not self.tensors:  # zero mass: the local state is kept
            return Applied(math.sqrt(pre), math.sqrt(pre), 0.0)
        return Applied(math.sqrt(pre), math.sqrt(post), math.sqrt(diff))


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
