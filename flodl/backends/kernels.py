"""The end of an averaging round on one piece of the buffer: divide, and take three norms.

When a bucket of summed parameters ``S`` lands, each rank turns it into the average
``a = S / M`` in place and measures ``||a - p||``, ``||a||`` and ``||p||`` against its own
parameters ``p``. Done with torch ops that is five passes over each block (divide, subtract,
three dot products); on a 2-core machine they cost ~10 ms per 10M parameters, as much as a
third of the all-reduce itself. :func:`finish_piece` does it in one pass:

* with numba installed (``pip install flodl[fast]``), a compiled loop that reads ``S`` and
  ``p`` once and writes ``a`` once (~4 ms per 10M float32 parameters here);
* otherwise (or for dtypes and devices the loop does not take) :func:`finish_piece_torch`,
  the same arithmetic with torch ops a cache-sized block at a time.

On CPU both divide with one correctly rounded IEEE division per element, so they write bitwise
the same average, and ranks that take different paths still agree bit for bit. (On a GPU torch
divides by a scalar as a multiply by its reciprocal; every rank of an NCCL group runs that same
kernel, so they agree too.) The squared norms
are summed in the element dtype within blocks of a few thousand elements and in float64
across blocks: they feed the divergence guard, not the model (see
:mod:`flodl.backends.averaging`). numba is imported and the loop loaded only when a gloo group
is first joined (:func:`warm_up`), so ``import flodl`` stays light.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import attrs
import torch

from flodl.backends.averaging import squared_norm

FUSED_DTYPES = (torch.float32, torch.float64)


@attrs.frozen
class PieceNorms:
    """Squared norms of one piece: ``||a - p||^2``, ``||a||^2`` and ``||p||^2``."""

    diff: float
    post: float
    pre: float


_Kernel = Callable[[Any, Any, Any], tuple[float, float, float]]


_lock = threading.Lock()
_loaded = threading.Event()
_kernel: _Kernel | None = None


def warm_up() -> bool:
    """Import numba and load the loop for every dtype it takes, once per process; True if it
    is there (numba installed). Blocking: ~0.5 s from numba's disk cache, ~2 s the first time
    ever (compiling); later calls return at once. A loop that fails to load is reported as a
    RuntimeWarning and the torch path is used (it writes the same bits)."""
    global _kernel
    with _lock:
        if not _loaded.is_set():
            _kernel = _load()
            _loaded.set()
    return _kernel is not None


def fused_kernel() -> _Kernel | None:
    """The compiled loop once :func:`warm_up` loaded it; None before, or without numba."""
    return _kernel if _loaded.is_set() else None


def _load() -> _Kernel | None:
    try:
        from flodl.backends import _fused
    except ImportError:  # numba is not installed: the torch path it is
        return None
    except Exception as err:  # numba present but unusable (no cache dir, broken install)
        _warn_unusable(err)
        return None
    try:
        for dtype in FUSED_DTYPES:  # compile or load each signature before a round calls it
            piece = torch.ones(2, dtype=dtype).numpy()
            _fused.finish(piece, piece.copy(), piece.dtype.type(1))
    except Exception as err:
        _warn_unusable(err)
        return None
    kernel: _Kernel = _fused.finish
    return kernel


def _warn_unusable(err: Exception) -> None:
    warnings.warn(
        f"flodl: numba could not build the averaging loop ({err!r}); using torch ops",
        RuntimeWarning,
        stacklevel=3,
    )


def takes_fused(summed: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether the compiled loop can run on this pair (CPU, contiguous, same float dtype)."""
    return (
        summed.device.type == "cpu"
        and source.device.type == "cpu"
        and summed.dtype in FUSED_DTYPES
        and source.dtype == summed.dtype
        and summed.is_contiguous()
        and source.is_contiguous()
        and fused_kernel() is not None
    )


@torch.no_grad()
def finish_piece(
    summed: torch.Tensor, source: torch.Tensor, mass: float, spare: torch.Tensor
) -> PieceNorms | list[torch.Tensor]:
    """Divide ``summed`` (1-D) by ``mass`` in place; the squared norms against ``source``.

    Returns :class:`PieceNorms` from the compiled loop, or the torch path's 0-d tensors
    ``[diff, post, pre]`` (left unsynchronised, so accelerators are not stalled per block).
    ``source`` (as many elements; never written) may have any dtype; ``spare`` is a scratch
    block for the torch path.
    """
    if takes_fused(summed, source):
        kernel = fused_kernel()
        assert kernel is not None
        array = summed.numpy()
        diff, post, pre = kernel(array, source.detach().numpy(), array.dtype.type(mass))
        return PieceNorms(diff, post, pre)
    return finish_piece_torch(summed, source, mass, spare)


@torch.no_grad()
def finish_piece_torch(
    summed: torch.Tensor, source: torch.Tensor, mass: float, spare: torch.Tensor
) -> list[torch.Tensor]:
    """:func:`finish_piece` with torch ops, a ``spare``-sized block at a time (the divide
    first, so the subtraction and the three norms read blocks that are already in cache)."""
    step = spare.numel()
    diff: list[torch.Tensor] = []
    post: list[torch.Tensor] = []
    pre: list[torch.Tensor] = []
    for start in range(0, summed.numel(), step):
        average = summed[start : start + step]
        own = source[start : start + step]
        average.div_(mass)
        gap = spare[: average.numel()]
        torch.sub(average, own, out=gap)
        diff.append(squared_norm(gap))
        post.append(squared_norm(average))
        pre.append(squared_norm(own))
    return [_sum(diff), _sum(post), _sum(pre)]


def _sum(squares: list[torch.Tensor]) -> torch.Tensor:
    if not squares:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([q.to(torch.float64) for q in squares]).sum()
