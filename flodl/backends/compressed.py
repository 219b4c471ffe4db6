"""A round that all-reduces 16 bits per parameter: the mass-weighted mean of the ranks' moves
from a reference every member holds bit for bit (``--average-dtype bf16`` or ``fp16``).

Rounding the parameters themselves to 16 bits would cost them most of their precision at every
round. Their moves since the last round are small next to them, so each rank sends
``(p - ref) * m / M`` in 16 bits (``ref``: the parameters the last round left, the same bytes on
every member; ``m``: the rank's mass, ``M``: the round's total, from a first all-reduce of two
float64 numbers) and the average is ``ref + sum`` in the parameters' dtype. Every member adds the
same sum to the same reference, so the ranks end bitwise identical, as after a full-precision
round. Float buffers are averaged over the ranks that moved, in full precision (they are few).

The collectives run on a worker thread of the round (:meth:`Generations.run`), which reads the
live tensors and never writes them (an abandoned thread may still be running when training goes
on); ``abandoned()`` is checked between the collectives, and the caller installs the result
once the round landed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch
import torch.distributed as dist

from flodl.averaging.mass import combine_norms, mass_of, norm32, relative_divergence
from flodl.backends.base import AverageResult
from flodl.backends.generations import Comm
from flodl.backends.pipeline import check_abandoned

__all__ = ["LandedMoves", "average_moves"]


@attrs.frozen
class LandedMoves:
    """A compressed round's result, computed on the round's worker thread and installed into
    the live tensors by :meth:`install` once the round is known to have landed."""

    params: list[torch.Tensor]
    """The average of each parameter (new tensors; the live ones are untouched until
    :meth:`install`)."""
    buffers: list[torch.Tensor]
    """The mean of each float buffer."""
    result: AverageResult

    @torch.no_grad()
    def install(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
        """Copy the average into ``params`` and the means into the float ``buffers``."""
        for live, averaged in zip(params, self.params, strict=True):
            live.copy_(averaged)
        floats = [b for b in buffers if b.is_floating_point()]
        for live, mean in zip(floats, self.buffers, strict=True):
            live.copy_(mean)


@torch.no_grad()
def average_moves(
    comm: Comm,
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    reference: Sequence[torch.Tensor],
    batches: int,
    dtype: torch.dtype,
    abandoned: Callable[[], bool],
) -> LandedMoves:
    """Worker thread: average ``params`` with every member through their moves from
    ``reference`` reduced in ``dtype``, and the float buffers over the ranks that moved. Reads
    the live tensors and never writes them: the result is installed by the caller once the
    round landed (:meth:`LandedMoves.install`). A round whose total mass is 0 is ``skipped``
    and keeps every rank's own tensors.

    Raises :class:`CollectiveAborted` once ``abandoned()`` turns true, RuntimeError when a
    collective fails.
    """
    mass = mass_of(batches, 1.0)
    device = params[0].device if params else torch.device("cpu")  # NCCL reduces device memory
    sums = torch.tensor([mass, 1.0 if mass > 0 else 0.0], dtype=torch.float64, device=device)
    comm.allreduce(sums, dist.ReduceOp.SUM)
    total, movers = (float(x) for x in sums.tolist())
    pre_norm = combine_norms([norm32(p.detach()) for p in params])
    floats = [b for b in buffers if b.is_floating_point()]
    if total <= 0.0:
        kept = AverageResult(0.0, pre_norm, pre_norm, True, total, round(movers))
        return LandedMoves(list(params), floats, kept)
    check_abandoned(abandoned, "abandoned before the moves were reduced")
    share = mass / total
    moves = torch.cat(
        [
            ((p.detach() - r) * share).reshape(-1).to(dtype)
            for p, r in zip(params, reference, strict=True)
        ]
    )
    comm.allreduce(moves, dist.ReduceOp.SUM)
    means: list[torch.Tensor] = []
    if floats:
        check_abandoned(abandoned, "abandoned before the buffers were reduced")
        sent = [b.detach().double() * (1.0 if mass > 0 else 0.0) for b in floats]
        summed = torch.cat([b.reshape(-1) for b in sent])
        comm.allreduce(summed, dist.ReduceOp.SUM)
        summed /= max(movers, 1.0)
        offset = 0
        for b in floats:
            means.append(summed[offset : offset + b.numel()].view(b.shape).to(b.dtype))
            offset += b.numel()
    averaged: list[torch.Tensor] = []
    diffs: list[torch.Tensor] = []
    offset = 0
    for p, r in zip(params, reference, strict=True):
        n = p.numel()
        average = (r + moves[offset : offset + n].view(p.shape).to(r.dtype)).to(p.dtype)
        offset += n
        diffs.append(norm32(p.detach() - average))
        averaged.append(average)
    post_norm = combine_norms([norm32(a) for a in averaged])
    divergence = relative_divergence(combine_norms(diffs), post_norm)
    return LandedMoves(
        averaged, means, AverageResult(divergence, pre_norm, post_norm, False, total, round(movers))
    )
