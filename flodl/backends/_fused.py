"""The compiled loop behind :func:`flodl.backends.kernels.finish_piece` (imports numba).

Imported only by :mod:`flodl.backends.kernels`, on first use, and only if numba is installed.
Top-level functions, so numba can cache the machine code on disk (``cache=True``).
"""

from __future__ import annotations

from typing import Any

import numba

FUSED_BLOCK = 8192
"""Elements per block: float32 partial sums stay short (a few thousand terms, ~1e-7
relative), and the blocks are summed in float64."""

# reassoc lets the sums vectorize. Nothing may turn the division into a reciprocal multiply
# (arcp) or fuse it with another op (contract): either would change the average's bits.
_jit = numba.njit(
    nogil=True,
    cache=True,
    boundscheck=False,
    error_model="numpy",
    fastmath={"reassoc", "nsz"},
)


@_jit
def _finish_block(summed: Any, source: Any, mass: Any) -> tuple[Any, Any, Any]:
    zero = mass - mass  # 0 in the element dtype (mass is finite here)
    diff, post, pre = zero, zero, zero
    for i in range(summed.shape[0]):
        average = summed[i] / mass
        own = source[i]
        gap = average - own
        diff += gap * gap
        post += average * average
        pre += own * own
        summed[i] = average
    return diff, post, pre


@_jit
def finish(summed: Any, source: Any, mass: Any) -> tuple[float, float, float]:
    """``summed /= mass`` in place; ``(||summed - source||^2, ||summed||^2, ||source||^2)``
    after the division, for 1-D contiguous arrays of one float dtype and ``mass`` of it."""
    n = summed.shape[0]
    diff, post, pre = 0.0, 0.0, 0.0
    for start in range(0, n, FUSED_BLOCK):
        end = min(n, start + FUSED_BLOCK)
        d, s, p = _finish_block(summed[start:end], source[start:end], mass)
        diff += d
        post += s
        pre += p
    return diff, post, pre
