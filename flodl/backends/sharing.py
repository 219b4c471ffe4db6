"""Making a versioned state equal on every member: the newest one wins, bit for bit.

Used for the outer optimizer's state (:mod:`flodl.averaging.outer`) at the first round of each
group generation: a rank that joined mid-run, or one resumed from an older bundle, holds an older
version or none, and must continue from exactly the bytes the others hold.

Three all-reduces on one worker thread: MAX of ``(version, -version)`` tells whether every member
holds the same version (then nothing more is sent); MIN of the group ranks holding the newest
picks one source; a SUM in which every other member contributes ``-0.0`` carries its bytes to
all. ``x + (-0.0) == x`` for every float ``x`` (signed zeros and NaNs included), so each member
ends with the source's exact bits, whatever order the reduction adds in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from flodl.backends.generations import Comm
from flodl.backends.pipeline import check_abandoned

__all__ = ["share_newest"]


def share_newest(
    comm: Comm,
    tensors: Sequence[torch.Tensor],
    version: int,
    rank: int,
    world_size: int,
    abandoned: Callable[[], bool],
) -> int:
    """Worker thread: make ``tensors`` (same shapes and dtypes on every member) hold the bytes of
    the member with the highest ``version`` (the lowest group rank among equals); return that
    version. Members already at that version are the sources' equals and are not written.

    Raises :class:`CollectiveAborted` once ``abandoned()`` turns true (checked between the
    collectives), RuntimeError when one fails; ``tensors`` may then be partly written.
    """
    device = tensors[0].device if tensors else torch.device("cpu")
    words = torch.tensor([version, -version], dtype=torch.int64, device=device)
    comm.allreduce(words, dist.ReduceOp.MAX)
    newest, minus_oldest = (int(w) for w in words.tolist())
    if newest == -minus_oldest:
        return newest
    check_abandoned(abandoned, "abandoned before the source was picked")
    pick = torch.tensor([rank if version == newest else world_size], device=device)
    comm.allreduce(pick, dist.ReduceOp.MIN)
    source = int(pick.item())
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        check_abandoned(abandoned, "abandoned while the newest state was shared")
        group = [t for t in tensors if t.dtype == dtype]
        if rank == source:
            flat = torch.cat([t.reshape(-1) for t in group])
        else:
            flat = torch.full((sum(t.numel() for t in group),), -0.0, dtype=dtype, device=device)
        comm.allreduce(flat, dist.ReduceOp.SUM)
        if version != newest:
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
    return newest
