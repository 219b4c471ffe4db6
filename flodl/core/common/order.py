"""The epoch order every process computes alike, and the spans of it work is handed out in.

Work is handed out as ranges ``[offset, offset + size)`` of positions in the epoch order
``epoch_order(seed, epoch, n)``, a permutation of the dataset indices; a rank trains on
``order[offset:offset + size]``. Both protocol ends need it: the coordinator to size and
hand out spans, a rank to turn them into sample indices.
"""

from __future__ import annotations

import hashlib

import attrs

from flodl.errors import ConfigError

_MASK64 = (1 << 64) - 1


class SplitMix64:
    """A tiny 64-bit generator (Steele, Lea, Flood 2014), fully specified, so every process
    and Python version draws the same numbers for the same seed."""

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK64

    def next_u64(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, bound: int) -> int:
        """A uniform integer in ``[0, bound)`` (rejection sampling, no modulo bias)."""
        if bound < 1:
            raise ValueError(f"bound must be >= 1, got {bound}")
        limit = (1 << 64) - ((1 << 64) % bound)
        while True:
            x = self.next_u64()
            if x < limit:
                return x % bound


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of ``epoch``: the first 8 bytes (big-endian) of
    ``sha256(f"{seed}:{epoch}")``."""
    digest = hashlib.sha256(f"{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """The order of the ``n`` dataset indices in ``epoch``, the same in every process.

    A Fisher-Yates shuffle of ``range(n)`` driven by :class:`SplitMix64` seeded with
    :func:`epoch_seed`.
    """
    if n < 0:
        raise ConfigError(f"epoch_order: n must be >= 0, got {n}")
    order = list(range(n))
    rng = SplitMix64(epoch_seed(seed, epoch))
    for i in range(n - 1, 0, -1):
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    return order


@attrs.frozen
class Span:
    """Positions ``[offset, offset + size)`` of the epoch order."""

    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size
