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
    """The stall clock of the round in flight, for ranks ``0..world_size-1``."""

    def __init__(self, world_size: int, ceiling: float) -> None:
        if ceiling <= 0:
            raise ConfigError(f"cycle: reduce_stall_ceiling must be > 0, got {ceiling}")
        self.ceiling = float(ceiling)
        self._joined = [-1] * world_size
        """The newest generation each rank finished joining, or failed to (-1: none)."""
        self._generation: int | None = None
        """The generation of the round being watched (None: no round is)."""
        self._started: float | None = None
        """When its clock started (None: a member is still joining, or nothing is watched)."""
        self.fired = False
        """The ceiling fired once (for the cycle's ``stalled``)."""

    def watch(self, now: float, generation: int, members: Set[int]) -> None:
        """Watch a round of ``generation`` sent at ``now``; its clock starts now if every
        member already joined that generation, else once the last one has."""
        self._generation = generation
        self._started = None
        self._start_once_joined(now, members)

    def stop(self) -> None:
        """The round settled or was abandoned: nothing is watched."""
        self._generation = self._started = None

    def on_join_result(self, now: float, rank: int, generation: int, members: Set[int]) -> None:
        """``rank``'s join of ``generation`` ended; an older generation than its last changes
        nothing."""
        if generation > self._joined[rank]:
            self._joined[rank] = generation
            self._start_once_joined(now, members)

    def on_member_gone(self, now: float, members: Set[int]) -> None:
        """A member left the group (``members`` is what remains): it no longer holds the
        clock back."""
        self._start_once_joined(now, members)

    def _start_once_joined(self, now: float, members: Set[int]) -> None:
        generation = self._generation
        if generation is None or self._started is not None:
            return
        if all(self._joined[rank] >= generation for rank in members):
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
