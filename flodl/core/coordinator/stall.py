"""The reduce-stall ceiling: when an unacknowledged round counts as a hung collective.

A round's clock starts once every member has finished joining the round's group generation
(``JoinResult``, joined or not): forming a group (gloo's rendezvous, NCCL's init) is bounded
by the backend's own join timeout and is no stalled collective, however long it takes. Past
the ceiling the run saves (``ShutdownWithSave(REDUCE_STALL)``), at most once per round.

Pure: times come in as arguments. Deadlines fire *at* the deadline (``now >= deadline``).
"""

from __future__ import annotations

from collections.abc import Set

from flodl.errors import ConfigError

__all__ = ["REDUCE_STALL_FLOOR_S", "StallWatch", "default_reduce_stall_ceiling"]

REDUCE_STALL_FLOOR_S = 300.0
"""The reduce-stall ceiling is never shorter than this (seconds)."""


def default_reduce_stall_ceiling(heartbeat_timeout: float) -> float:
    """Seconds a round may stay unacknowledged: ``max(10 * heartbeat_timeout, 300)``."""
    return max(10.0 * heartbeat_timeout, REDUCE_STALL_FLOOR_S)


class StallWatch:
    """The stall clock of the round in flight, for ranks ``0..world_size-1``.

    Each report costs O(1): the members still joining the watched round's generation are kept
    as a set, so forming a group of N ranks costs O(N), not O(N^2).
    """

    def __init__(self, world_size: int, ceiling: float) -> None:
        if ceiling <= 0:
            raise ConfigError(f"cycle: reduce_stall_ceiling must be > 0, got {ceiling}")
        self.ceiling = float(ceiling)
        self._joined = [-1] * world_size
        """The newest generation each rank finished joining, or failed to (-1: none)."""
        self._generation: int | None = None
        """The generation of the round being watched (None: no round is)."""
        self._joining: set[int] = set()
        """Members whose join of the watched generation has not ended yet."""
        self._started: float | None = None
        """When the clock started (None: a member is still joining, or nothing is watched)."""
        self.fired = False
        """The ceiling fired once (for the cycle's ``stalled``)."""

    def watch(self, now: float, generation: int, members: Set[int]) -> None:
        """Watch a round of ``generation`` sent at ``now``; its clock starts now if every
        member already joined that generation, else once the last one has."""
        joined = self._joined
        self._generation = generation
        self._joining = {rank for rank in members if joined[rank] < generation}
        self._started = None
        self._start_if_joined(now)

    def stop(self) -> None:
        """The round settled or was abandoned: nothing is watched."""
        self._generation = self._started = None
        self._joining = set()

    def on_join_result(self, now: float, rank: int, generation: int) -> None:
        """``rank``'s join of ``generation`` ended; an older generation than its last changes
        nothing."""
        if generation > self._joined[rank]:
            self._joined[rank] = generation
            if self._generation is not None and generation >= self._generation:
                self.on_member_gone(now, rank)

    def on_member_gone(self, now: float, rank: int) -> None:
        """``rank`` no longer holds the clock back (it joined, or left the group)."""
        if rank in self._joining:
            self._joining.discard(rank)
            self._start_if_joined(now)

    def _start_if_joined(self, now: float) -> None:
        if self._generation is not None and self._started is None and not self._joining:
            self._started = now

    def check(self, now: float) -> bool:
        """True once, when the watched round's clock passed the ceiling; then nothing is
        watched."""
        deadline = self.deadline()
        if deadline is None or now < deadline:
            return False
        self.stop()
        self.fired = True
        return True

    def deadline(self) -> float | None:
        """When :meth:`check` would fire if nothing changes (None when it cannot)."""
        if self._started is None:
            return None
        return self._started + self.ceiling
