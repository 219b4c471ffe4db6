"""Who is alive: a last-seen ledger, dead-rank detection, and the unrecoverable reasons.

Rules:

* Any frame from a rank refreshes its last-seen time (:meth:`Liveness.on_frame`).
* A rank is dead from silence when ``now - last_seen >= heartbeat_timeout``: it dies *at*
  the deadline, so a shell that sleeps until :meth:`Liveness.next_deadline` and then calls
  :meth:`Liveness.check` declares it without an epsilon.
* A closed or broken connection is dead at once (:meth:`Liveness.on_disconnect`).
* A rank that sent ``Exiting`` is latched: when its connection then closes (or it falls
  silent), it is lost with cause ``EXITED``, which is not a failure, but it is no longer alive.
* Each rank is lost at most once per admission: later closes or silences are not counted
  again. A lost rank comes back only through :meth:`Liveness.admit` (a rank rejoining).
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Iterable, KeysView

import attrs

from flodl.errors import ConfigError, CoordinatorError
from flodl.wire.messages import SaveReason

DEFAULT_HEARTBEAT_TIMEOUT = 10.0
"""Seconds of silence after which a rank is dead (floDl uses 30; configurable)."""


class LossCause(enum.Enum):
    """Why a rank stopped being alive."""

    SILENT = "silent"
    DISCONNECTED = "disconnected"
    EXITED = "exited"


@attrs.frozen
class RankLost:
    """Rank ``rank`` stopped being alive at time ``at`` for ``cause``."""

    rank: int
    cause: LossCause
    at: float

    @property
    def is_failure(self) -> bool:
        """True unless the rank announced its exit first."""
        return self.cause is not LossCause.EXITED


class Liveness:
    """Last-seen ledger of the ranks of one run (global ids ``0..world_size-1``).

    Ranks are alive only after :meth:`admit` (the shell admits a rank when its handshake
    completes); ``initial`` admits a set of ranks at ``now`` on construction.
    """

    def __init__(
        self,
        world_size: int,
        *,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        initial: Iterable[int] = (),
        now: float = 0.0,
    ) -> None:
        if world_size < 1:
            raise ConfigError(f"liveness: world_size must be >= 1, got {world_size}")
        if not heartbeat_timeout > 0:
            raise ConfigError(f"liveness: heartbeat_timeout must be > 0, got {heartbeat_timeout}")
        self._world_size = world_size
        self._timeout = float(heartbeat_timeout)
        self._last_seen: dict[int, float] = {}
        # Lazy min-heap of (last_seen, rank): an entry is current while it equals the rank's
        # last-seen time; stale ones are dropped when they reach the top (next_deadline).
        self._heap: list[tuple[float, int]] = []
        self._exiting: set[int] = set()
        self._losses: list[RankLost] = []
        for rank in initial:
            self.admit(rank, now)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def heartbeat_timeout(self) -> float:
        return self._timeout

    @property
    def alive(self) -> frozenset[int]:
        return frozenset(self._last_seen)

    @property
    def alive_view(self) -> KeysView[int]:
        """The ranks alive now, as a live view (O(1); :attr:`alive` copies them)."""
        return self._last_seen.keys()

    def is_alive(self, rank: int) -> bool:
        return rank in self._last_seen

    def is_exiting(self, rank: int) -> bool:
        """True when ``rank`` is alive and announced its exit."""
        return rank in self._exiting

    @property
    def losses(self) -> tuple[RankLost, ...]:
        """Every loss so far, in the order it was declared."""
        return tuple(self._losses)

    @property
    def failures(self) -> int:
        """How many losses were failures (silence or disconnect without ``Exiting``)."""
        return sum(1 for loss in self._losses if loss.is_failure)

    def last_seen(self, rank: int) -> float | None:
        return self._last_seen.get(rank)

    def admit(self, rank: int, now: float) -> None:
        """Start tracking ``rank`` as alive, last seen ``now`` (first join or rejoin).

        Raises CoordinatorError if the rank is out of range or already alive.
        """
        if not 0 <= rank < self._world_size:
            raise CoordinatorError(
                f"liveness: rank {rank} is outside world size {self._world_size}"
            )
        if rank in self._last_seen:
            raise CoordinatorError(f"liveness: rank {rank} is already alive")
        self._last_seen[rank] = now
        self._push(rank, now)
        self._exiting.discard(rank)

    def on_frame(self, rank: int, now: float) -> bool:
        """Any frame from ``rank`` arrived at ``now``; False (ignored) if it is not alive.

        Last-seen never moves backwards.
        """
        seen = self._last_seen.get(rank)
        if seen is None:
            return False
        if now > seen:
            self._last_seen[rank] = now
            self._push(rank, now)
        return True

    def on_exiting(self, rank: int, now: float) -> bool:
        """``rank`` announced it is leaving on purpose; False if it is not alive.

        It stays alive until its connection closes; then it is lost as ``EXITED``.
        """
        if not self.on_frame(rank, now):
            return False
        self._exiting.add(rank)
        return True

    def on_disconnect(self, rank: int, now: float) -> RankLost | None:
        """``rank``'s connection closed or broke: it is lost at once.

        Returns the loss, or None when the rank was not alive (already counted).
        """
        if rank not in self._last_seen:
            return None
        return self._lose(rank, now, LossCause.DISCONNECTED)

    def check(self, now: float) -> list[RankLost]:
        """Declare every rank silent for ``>= heartbeat_timeout``; ascending rank order."""
        # Compare against the same sum next_deadline() returns, so a shell woken exactly at
        # that deadline always sees the death (now - seen could round below the timeout).
        silent = sorted(r for r, seen in self._last_seen.items() if now >= seen + self._timeout)
        return [self._lose(rank, now, LossCause.SILENT) for rank in silent]

    def next_deadline(self) -> float | None:
        """The earliest time :meth:`check` could declare a silent rank (None: nobody alive)."""
        if not self._last_seen:
            return None
        heap, last_seen = self._heap, self._last_seen
        while last_seen.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] + self._timeout

    def _push(self, rank: int, seen: float) -> None:
        heap = self._heap
        if len(heap) > 2 * len(self._last_seen) + 64:
            # Never asked for a deadline in a while: rebuild from the current entries only.
            heap[:] = [(t, r) for r, t in self._last_seen.items()]
            heapq.heapify(heap)
            return  # the rebuild already holds (seen, rank)
        heapq.heappush(heap, (seen, rank))

    def _lose(self, rank: int, now: float, cause: LossCause) -> RankLost:
        del self._last_seen[rank]
        if rank in self._exiting:
            self._exiting.discard(rank)
            cause = LossCause.EXITED
        loss = RankLost(rank=rank, cause=cause, at=now)
        self._losses.append(loss)
        return loss


@attrs.frozen
class MaxFailure:
    """How many failed ranks end the run: an absolute count or a fraction of the world.

    Build with :meth:`absolute` or :meth:`percent`; the run ends when failures reach
    :meth:`limit`.
    """

    count: int | None = None
    fraction: float | None = None

    def __attrs_post_init__(self) -> None:
        if (self.count is None) == (self.fraction is None):
            raise ConfigError("max_failure: give exactly one of count or fraction")
        if self.count is not None and (type(self.count) is not int or self.count < 1):
            raise ConfigError(f"max_failure: count must be an integer >= 1, got {self.count!r}")
        if self.fraction is not None and not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"max_failure: fraction must be in (0, 1], got {self.fraction!r}")

    @classmethod
    def absolute(cls, n: int) -> MaxFailure:
        """The run ends at the ``n``-th failure (``n >= 1``)."""
        return cls(count=n)

    @classmethod
    def percent(cls, p: float) -> MaxFailure:
        """The run ends when failures reach ``ceil(p * world_size)``; ``p`` in ``(0, 1]``."""
        return cls(fraction=p)

    def limit(self, world_size: int) -> int:
        """The failure count at which the run ends."""
        if self.count is not None:
            return self.count
        assert self.fraction is not None
        return math.ceil(self.fraction * world_size)


def unrecoverable_reason(
    *,
    world_size: int,
    alive: int,
    failures: int,
    max_failure: MaxFailure | None,
    collective: bool,
) -> SaveReason | None:
    """Why the run cannot go on after losses, checked in spec order; None if it can.

    1. ``max_failure`` set and ``failures >= limit`` -> MAX_FAILURE;
    2. a collective backend with fewer than 2 alive -> SINGLE_SURVIVOR;
    3. nobody alive -> ALL_RANKS_LOST.
    """
    if max_failure is not None and failures >= max_failure.limit(world_size):
        return SaveReason.MAX_FAILURE
    if collective and alive < 2:
        return SaveReason.SINGLE_SURVIVOR
    if alive == 0:
        return SaveReason.ALL_RANKS_LOST
    return None
