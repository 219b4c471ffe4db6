"""The per-piece passes of a pre-scaled averaging round (:mod:`flodl.backends.pipeline`).

Before its all-reduce, each rank copies its share ``p * m / M`` of every parameter into
scratch and needs ``||p||``; once a bucket has landed it holds the average ``a``, and the
divergence guard needs ``||a||`` and ``||a - p||``. Done with torch ops that is two passes over
``p`` before the collective and three after it (subtract, two dot products). On a 2-core
machine, where each pass over 40 MB competes with gloo for memory bandwidth, every pass
counts, so each has a one-pass form:

* with numba installed (``pip install flodl[fast]``), compiled loops: :func:`share_piece`
  reads ``p`` once and writes the share once, :func:`gap_piece` reads ``a`` and ``p`` once
  and writes nothing;
* otherwise (or for dtypes and devices the loops do not take) the same arithmetic with torch
  ops, a cache-sized block at a time for the gap.

The squared norms are summed in the element dtype within blocks of a few thousand elements
and in float64 across blocks: they feed the divergence guard, not the model (see
:mod:`flodl.averaging.mass`). numba is imported and the loops loaded only when a gloo
group is first joined (:func:`warm_up`), so ``import flodl`` stays light.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import attrs
import torch

from flodl.averaging.mass import squared_norm

FUSED_DTYPES = (torch.float32, torch.float64)


@attrs.frozen
class _Loops:
    """The compiled loops of :mod:`flodl.averaging._fused`."""

    share: Callable[[Any, Any, float], float]
    gap: Callable[[Any, Any], tuple[float, float]]
    gap_sampled: Callable[[Any, Any, int, int, int], tuple[float, float, int]]


_lock = threading.Lock()
_loaded = threading.Event()
_loops: _Loops | None = None


def warm_up() -> bool:
    """Import numba and load the loops for every dtype they take, once per process; True if
    they are there (numba installed). Blocking: ~0.5 s from numba's disk cache, ~2 s the
    first time ever (compiling); later calls return at once. Loops that fail to load are
    reported as a RuntimeWarning and the torch path is used."""
    global _loops
    with _lock:
        if not _loaded.is_set():
            _loops = _load()
            _loaded.set()
    return _loops is not None


def compiled() -> bool:
    """Whether the compiled loops are loaded (:func:`warm_up` ran, numba is there)."""
    return _loaded_loops() is not None


def _loaded_loops() -> _Loops | None:
    return _loops if _loaded.is_set() else None


def _load() -> _Loops | None:
    try:
        from flodl.averaging import _fused
    except ImportError:  # numba is not installed: the torch path it is
        return None
    except Exception as err:  # numba present but unusable (no cache dir, broken install)
        _warn_unusable(err)
        return None
    try:
        for dtype in FUSED_DTYPES:  # compile or load each signature before a round calls it
            piece = torch.ones(2, dtype=dtype).numpy()
            _fused.share(piece, piece.copy(), 1.0)
            _fused.gap(piece, piece.copy())
            _fused.gap_sampled(piece, piece.copy(), 0, 1, 2)
    except Exception as err:
        _warn_unusable(err)
        return None
    return _Loops(share=_fused.share, gap=_fused.gap, gap_sampled=_fused.gap_sampled)


def _warn_unusable(err: Exception) -> None:
    warnings.warn(
        f"flodl: numba could not build the averaging loops ({err!r}); using torch ops",
        RuntimeWarning,
        stacklevel=3,
    )


def takes_fused(flat: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether the compiled loops can run on this pair (CPU, contiguous, same float dtype)."""
    return (
        flat.device.type == "cpu"
        and source.device.type == "cpu"
        and flat.dtype in FUSED_DTYPES
        and source.dtype == flat.dtype
        and flat.is_contiguous()
        and source.is_contiguous()
        and compiled()
    )


@torch.no_grad()
def share_piece(source: torch.Tensor, out: torch.Tensor, factor: float) -> float | torch.Tensor:
    """``out = source * factor`` (``out`` 1-D, of the flat dtype; ``source`` as many elements,
    any dtype and strides, never written), and ``||source||^2`` taken in the same pass.

    Returns a float from the compiled loop, else a 0-d tensor (unsynchronised). The loop
    multiplies in float64 and rounds each product once; the torch path multiplies by the
    factor rounded to the flat dtype (a last-bit difference: only the all-reduce's result has
    to be equal on every rank, and it is, whichever path each rank took).
    """
    loops = _loaded_loops()
    if loops is not None and takes_fused(out, source):
        return loops.share(source.detach().numpy(), out.numpy(), float(factor))
    flat_source = source.reshape(-1)
    if flat_source.dtype == out.dtype:
        torch.mul(flat_source, factor, out=out)
    else:  # scale in the flat dtype, as the reduction does
        out.copy_(flat_source).mul_(factor)
    return squared_norm(flat_source)


@attrs.frozen
class NormSample:
    """Which elements the divergence norms read: in each parameter piece of at least
    ``whole_below`` elements, the blocks of ``block`` elements that start at the flat indices
    ``0, every, 2 * every, ...`` (a fixed set, the same every round and on every rank); the
    squares read are scaled by ``piece length / elements read``. Smaller pieces (biases,
    norms' weights) are read whole. The default reads 1/16 of the large tensors.

    An estimate, not a bound: a fixed sample has no worst case better than missing all the
    drift (it could lie only between the blocks). Blocks of 1024 (4 KiB of float32, whole
    pages for the prefetcher) keep the cost at about the read fraction; see
    docs/benchmarks.md (a) for the error measured against the exact norms."""

    block: int = 1024
    every: int = 16 * 1024
    whole_below: int = 4 * 16 * 1024

    def __attrs_post_init__(self) -> None:
        if not 0 < self.block <= self.every or self.whole_below < 0:
            raise ValueError(f"bad norm sample {self!r}")

    def takes(self, length: int) -> bool:
        """Whether a piece of ``length`` elements is sampled (else read whole)."""
        return length >= max(self.whole_below, 1) and self.block < self.every

    def spans(self, start: int, length: int) -> list[tuple[int, int]]:
        """The sampled ``(lo, hi)`` of a piece at flat index ``start`` (piece-relative)."""
        out = []
        lo = -(start % self.every)
        while lo < length:
            a, b = max(lo, 0), min(lo + self.block, length)
            if a < b:
                out.append((a, b))
            lo += self.every
        return out


@torch.no_grad()
def gap_piece(
    average: torch.Tensor,
    source: torch.Tensor,
    spare: torch.Tensor,
    sample: NormSample | None = None,
    start: int = 0,
) -> tuple[float, float] | list[torch.Tensor]:
    """``||average - source||^2`` and ``||average||^2`` for one landed piece (``average`` 1-D;
    neither is written). A tuple of floats from the compiled loop, else the torch path's
    0-d tensors ``[diff, post]`` (a ``spare``-sized block at a time, so the subtraction and
    the norms read blocks already in cache).

    With ``sample`` (and a piece it :meth:`~NormSample.takes`; ``start``: the piece's flat
    index) both are estimates from the sampled blocks, scaled up; both paths read the same
    elements."""
    if sample is not None and sample.takes(average.numel()):
        return _sampled_gap(average, source, spare, sample, start)
    loops = _loaded_loops()
    if loops is not None and takes_fused(average, source):
        return loops.gap(average.numpy(), source.detach().numpy())
    step = spare.numel()
    diff: list[torch.Tensor] = []
    post: list[torch.Tensor] = []
    flat_source = source.reshape(-1)
    for start in range(0, average.numel(), step):
        block = average[start : start + step]
        gap = spare[: block.numel()]
        torch.sub(block, flat_source[start : start + step], out=gap)
        diff.append(squared_norm(gap))
        post.append(squared_norm(block))
    return [_sum(diff, average.device), _sum(post, average.device)]


def _sum(squares: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The float64 sum of 0-d ``squares``, on ``device`` (where the piece lives, so an empty
    piece's zero stacks with the other pieces' sums)."""
    if not squares:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([q.to(torch.float64) for q in squares]).sum()


def _sampled_gap(
    average: torch.Tensor,
    source: torch.Tensor,
    spare: torch.Tensor,
    sample: NormSample,
    start: int,
) -> tuple[float, float] | list[torch.Tensor]:
    n = average.numel()
    loops = _loaded_loops()
    if loops is not None and takes_fused(average, source):
        diff, post, count = loops.gap_sampled(
            average.numpy(),
            source.detach().numpy(),
            start % sample.every,
            sample.block,
            sample.every,
        )
        scale = n / max(count, 1)
        return diff * scale, post * scale
    flat_source = source.reshape(-1)
    diffs: list[torch.Tensor] = []
    posts: list[torch.Tensor] = []
    count = 0
    for lo, hi in sample.spans(start, n):  # the torch path (no numba): one block at a time
        block_diff, block_post = gap_piece(average[lo:hi], flat_source[lo:hi], spare)
        # A float where a short block took the loop.
        diffs.append(torch.as_tensor(block_diff, device=average.device))
        posts.append(torch.as_tensor(block_post, device=average.device))
        count += hi - lo
    scale = n / max(count, 1)
    return [_sum(diffs, average.device) * scale, _sum(posts, average.device) * scale]
