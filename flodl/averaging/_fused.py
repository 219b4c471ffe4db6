"""The compiled loops behind :mod:`flodl.averaging.kernels` (imports numba).

Imported only by :mod:`flodl.averaging.kernels`, on first use, and only if numba is installed.
Top-level functions, so numba can cache the machine code on disk (``cache=True``).
"""

from __future__ import annotations

from typing import Any

import numba

FUSED_BLOCK = 8192
"""Elements per block: float32 partial sums stay short (a few thousand terms, ~1e-7
relative), and the blocks are summed in float64."""

# reassoc lets the sums vectorize. Nothing may fuse the share's multiply with another op
# (contract): it is rounded once, as the docstring of share says.
_jit = numba.njit(
    nogil=True,
    cache=True,
    boundscheck=False,
    error_model="numpy",
    fastmath={"reassoc", "nsz"},
)


@_jit
def _share_block(source: Any, out: Any, factor: float) -> Any:
    pre = source[0] - source[0]  # 0 in the element dtype (blocks are never empty)
    for i in range(source.shape[0]):
        own = source[i]
        out[i] = own * factor
        pre += own * own
    return pre


@_jit
def share(source: Any, out: Any, factor: float) -> float:
    """``out = source * factor``, multiplied in float64 and rounded once to the element
    dtype; returns ``||source||^2``, for 1-D contiguous arrays of one float dtype.

    A share such as 1/3 rounded to float32 first would scale every average by the same
    ``1 + e`` round after round; rounding each product instead leaves no such bias."""
    n = source.shape[0]
    pre = 0.0
    for start in range(0, n, FUSED_BLOCK):
        end = min(n, start + FUSED_BLOCK)
        pre += _share_block(source[start:end], out[start:end], factor)
    return pre


@_jit
def _gap_block(average: Any, source: Any) -> tuple[Any, Any]:
    zero = average[0] - average[0]  # blocks are never empty
    diff, post = zero, zero
    for i in range(average.shape[0]):
        value = average[i]
        gap = value - source[i]
        diff += gap * gap
        post += value * value
    return diff, post


@_jit
def gap(average: Any, source: Any) -> tuple[float, float]:
    """``(||average - source||^2, ||average||^2)``, reading both once and writing nothing,
    for 1-D contiguous arrays of one float dtype."""
    n = average.shape[0]
    diff, post = 0.0, 0.0
    for start in range(0, n, FUSED_BLOCK):
        end = min(n, start + FUSED_BLOCK)
        d, s = _gap_block(average[start:end], source[start:end])
        diff += d
        post += s
    return diff, post


@_jit
def gap_sampled(average: Any, source: Any, phase: int, block: int, every: int) -> Any:
    """As :func:`gap`, over the blocks ``[j * every - phase, + block)`` only (clipped to the
    arrays); returns ``(diff, post, elements read)``."""
    n = average.shape[0]
    diff, post, count = 0.0, 0.0, 0
    start = -phase
    while start < n:
        lo = max(start, 0)
        hi = min(start + block, n)
        if lo < hi:
            d, s = _gap_block(average[lo:hi], source[lo:hi])
            diff += d
            post += s
            count += hi - lo
        start += every
    return diff, post, count
