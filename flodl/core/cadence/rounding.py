"""How ElChe rounds: halves away from zero, and ceilings that forgive float noise.

floDl rounds with Rust's ``f64::round``, not Python's banker's rounding, so counts computed here
match its counts to the batch; a product such as ``10 * 0.3`` must not round up past 3 because
it came out as 3.0000000000000004.
"""

from __future__ import annotations

import math

__all__ = ["ceil_exact", "rust_round"]


def rust_round(x: float) -> int:
    """Round halves away from zero (Rust's ``f64::round``): 2.5 -> 3, 3.5 -> 4, -2.5 -> -3."""
    if x >= 0:
        return math.floor(x + 0.5)
    return -math.floor(-x + 0.5)


def ceil_exact(x: float) -> int:
    """``ceil`` that forgives float noise in a product, so that ``ceil(10 * 0.3)`` is 3, not 4."""
    return math.ceil(x - 1e-9 * max(1.0, abs(x)))
