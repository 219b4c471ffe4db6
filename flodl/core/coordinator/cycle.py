"""The averaging cycle: when a round starts, when it is acknowledged, when it has stalled.

A *round* is one parameter average among the members of the current group. The cycle
does not decide cadence (ElChe's batch counts come in as an argument); it executes windows:

* :meth:`Cycle.ready` is the count trigger (floDl v0.7+): for each member, the previous
  round is acknowledged; under ``SYNC`` the rank ran at least one step, under ``CADENCE`` and
  ``ASYNC`` it ran at least ``counts[r]`` steps or is *quiesced* (nothing in flight and its
  epoch pool drained, as the partitions ledger reports) or throttled (parked until the next
  round, so waiting for it would deadlock); at least one member moved; the group is not empty.
* :meth:`Cycle.start_round` closes the window at once (as floDl's collective path does):
  ``global_step += sum(steps)``, step counters reset, throttles cleared, and it returns
  ``SyncNow`` plus ``SetGlobalStep`` for the members.
* A member acknowledges the round with a ``SyncAck`` carrying that round's number; one for
  any other round is ignored. (floDl also takes a ``Batch`` whose step count passed the
  arm-time snapshot as an ack; flodl does not, see :meth:`Cycle.on_batch`.) Once every
  member acked, the round is *settled*.
* While a round is unsettled the run must not be shut down gracefully
  (:meth:`Cycle.may_shutdown`), and past the reduce-stall ceiling the cycle asks once for
  ``ShutdownWithSave(REDUCE_STALL)`` (:mod:`~flodl.core.coordinator.stall` keeps that clock).
* A dead member is removed with :meth:`Cycle.drop_rank` (the round may then settle on the
  survivors' acks); if the collective itself was lost, :meth:`Cycle.abandon_round` marks the
  round to be redone and :meth:`Cycle.redo_round` reissues it on the re-formed group.

Deadlines fire *at* the deadline (``now >= deadline``), so a shell that sleeps until
:meth:`Cycle.next_deadline` and then calls :meth:`Cycle.check_stall` acts without an epsilon.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence, Set

import attrs

from flodl.core.common.policy import Policy
from flodl.core.coordinator.effects import Broadcast, Effect, Send
from flodl.core.coordinator.stall import StallWatch, default_reduce_stall_ceiling
from flodl.errors import ConfigError, CoordinatorError
from flodl.wire.messages import (
    Batch,
    SaveReason,
    SetGlobalStep,
    ShutdownWithSave,
    SyncAck,
    SyncNow,
    Throttle,
)


class RoundState(enum.Enum):
    """Where the cycle is: settled, a round in flight, or a lost round waiting to be redone."""

    SETTLED = "settled"
    IN_FLIGHT = "in_flight"
    REDO_PENDING = "redo_pending"


@attrs.frozen
class RoundStarted:
    """What :meth:`Cycle.start_round` or :meth:`Cycle.redo_round` did.

    ``steps[r]`` is the number of batches rank ``r`` ran in the window this round closed
    (zero for non-members, and all zeros for a redo, which closes no window);
    ``global_step`` is the value after the round; ``effects`` are for the shell, in order.
    """

    round: int
    generation: int
    steps: tuple[int, ...]
    global_step: int
    redo: bool
    effects: tuple[Effect, ...]


class Cycle:
    """Averaging-cycle state for one run of ``world_size`` ranks (global ids ``0..W-1``).

    ``members`` is the current group (default: all ranks); it changes only through
    :meth:`drop_rank` and :meth:`add_rank`, because a rank that reconnects is not in the
    collective until the group has been re-formed with it.
    """

    def __init__(
        self,
        world_size: int,
        policy: Policy,
        *,
        members: Iterable[int] | None = None,
        reduce_stall_ceiling: float | None = None,
        heartbeat_timeout: float = 10.0,
        max_batch_diff: int | None = None,
        global_step: int = 0,
        round: int = 0,
    ) -> None:
        if world_size < 1:
            raise ConfigError(f"cycle: world_size must be >= 1, got {world_size}")
        if heartbeat_timeout <= 0:
            raise ConfigError(f"cycle: heartbeat_timeout must be > 0, got {heartbeat_timeout}")
        if reduce_stall_ceiling is None:
            reduce_stall_ceiling = default_reduce_stall_ceiling(heartbeat_timeout)
        if max_batch_diff is not None and max_batch_diff < 0:
            raise ConfigError(f"cycle: max_batch_diff must be >= 0, got {max_batch_diff}")
        if global_step < 0 or round < 0:
            raise ConfigError("cycle: global_step and round must be >= 0")
        self._world_size = world_size
        self._policy = policy
        self._stall = StallWatch(world_size, reduce_stall_ceiling)
        self._max_batch_diff = max_batch_diff
        self._members: set[int] = set(range(world_size) if members is None else members)
        for rank in self._members:
            self._check_rank(rank)
        self._steps = [0] * world_size
        self._last_step_count = [0] * world_size
        self._snapshot = [0] * world_size
        self._acked: set[int] = set(self._members)
        # Invariant: _acked is a subset of _members (only members ack; drop_rank removes
        # from both), so "every member acked" is a length comparison.
        self._blocker: int | None = None
        """The member that last kept :meth:`ready` False: checked first next time."""
        self._throttled: set[int] = set()
        self._state = RoundState.SETTLED
        self._round = round
        self._generation = 0
        self._global_step = global_step
        self._started_at: float | None = None
        self._last_sync_duration: float | None = None

    # --- read-only state ------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def members(self) -> frozenset[int]:
        """Ranks in the current group."""
        return frozenset(self._members)

    @property
    def state(self) -> RoundState:
        return self._state

    @property
    def round(self) -> int:
        """Number of the latest SyncNow sent (0 before the first)."""
        return self._round

    @property
    def generation(self) -> int:
        """Group generation named in the latest SyncNow (0 before the first)."""
        return self._generation

    @property
    def global_step(self) -> int:
        return self._global_step

    @property
    def steps(self) -> tuple[int, ...]:
        """Batches each rank ran since the last round closed its window."""
        return tuple(self._steps)

    def steps_of(self, rank: int) -> int:
        """Batches ``rank`` ran since the last round closed its window (O(1))."""
        return self._steps[rank]

    @property
    def acked(self) -> frozenset[int]:
        """Members that acknowledged the current round (all members once settled)."""
        return frozenset(self._acked)

    @property
    def throttled(self) -> frozenset[int]:
        """Ranks sent a Throttle since the last round."""
        return frozenset(self._throttled)

    @property
    def settled(self) -> bool:
        """True when no round is in flight or waiting to be redone."""
        return self._state is RoundState.SETTLED

    @property
    def stalled(self) -> bool:
        """True once the reduce-stall ceiling fired (it fires at most once)."""
        return self._stall.fired

    @property
    def reduce_stall_ceiling(self) -> float:
        return self._stall.ceiling

    @property
    def last_sync_duration(self) -> float | None:
        """Seconds from the last settled round's SyncNow to its final ack (None before one)."""
        return self._last_sync_duration

    def may_shutdown(self) -> bool:
        """The confirmed-exit gate: a graceful Shutdown is safe only when settled.

        A rank that leaves while its peers are still inside the collective strands them, so
        the shell must hold Shutdown until this is True. ShutdownWithSave (a run that cannot
        go on) does not wait for it.
        """
        return self.settled

    # --- reports from ranks ---------------------------------------------------------------

    def on_batch(self, now: float, batch: Batch) -> bool:
        """Count one finished batch of ``batch.rank``; never settles a round (returns False).

        Unlike floDl, a Batch whose step count passed the arm-time snapshot does not
        acknowledge the round: flodl hands out the next window together with SyncNow, and a
        rank that finishes the batch it was in before averaging would look acked while its
        collective is still ahead of it. Only a SyncAck for the round acknowledges it.
        Reports from ranks outside the group are ignored.
        """
        self.on_batches(batch.rank, 1, batch.step_count)
        return False

    def on_batches(self, rank: int, count: int, step_count: int) -> None:
        """Count ``count`` finished batches of ``rank`` at once, the last at ``step_count``:
        the state :meth:`on_batch` leaves after each of them in turn."""
        self._check_rank(rank)
        self._last_step_count[rank] = step_count
        if rank in self._members:
            self._steps[rank] += count

    @property
    def throttling(self) -> bool:
        """Ranks too far ahead are throttled (``max_batch_diff`` is set)."""
        return self._max_batch_diff is not None

    def on_join_result(self, now: float, rank: int, generation: int) -> None:
        """``rank`` finished joining group ``generation``, or failed to: either way its join
        no longer holds the round back, and the round's stall clock starts once every member's
        has ended. A result for an older generation than the rank's last changes nothing."""
        self._check_rank(rank)
        self._stall.on_join_result(now, rank, generation)

    def on_sync_ack(self, now: float, ack: SyncAck) -> bool:
        """Take ``ack`` into account; True when it settled the round.

        An ack for another round than the latest SyncNow (stale, or not yet issued) and an
        ack from a rank outside the group are ignored entirely.
        """
        rank = ack.rank
        self._check_rank(rank)
        if rank not in self._members or ack.round != self._round:
            return False
        # Latest, not largest: frames of one connection arrive in order, and a rank that
        # restarted counts from zero again.
        self._last_step_count[rank] = ack.step_count
        if self._state is not RoundState.IN_FLIGHT:
            return False
        self._acked.add(rank)
        return self._settle_if_complete(now)

    def _settle_if_complete(self, now: float) -> bool:
        if self._state is not RoundState.IN_FLIGHT or len(self._acked) != len(self._members):
            return False
        assert self._started_at is not None
        self._last_sync_duration = now - self._started_at
        self._state = RoundState.SETTLED
        self._started_at = None
        self._stall.stop()
        return True

    # --- the trigger ----------------------------------------------------------------------

    def ready(self, counts: Sequence[int], quiesced: Set[int] = frozenset()) -> bool:
        """The count trigger: may a round start now?

        ``counts[r]`` is ElChe's planned batch count for rank ``r`` (read under CADENCE and
        ASYNC only); ``quiesced`` holds ranks with nothing in flight whose epoch pool is
        drained. False while a round is in flight or waiting to be redone.
        """
        if len(counts) != self._world_size:
            raise CoordinatorError(
                f"cycle: counts has {len(counts)} entries for world size {self._world_size}"
            )
        if self._state is not RoundState.SETTLED or not self._members:
            return False
        # Most calls come while some member is still short of its count; the one that was
        # short last time usually still is, so it is checked first (O(1) instead of a scan).
        blocker = self._blocker
        if (
            blocker is not None
            and blocker in self._members
            and not self._due(blocker, counts, quiesced)
        ):
            return False
        moved = False
        sync = self._policy is Policy.SYNC
        throttled = self._throttled
        all_steps = self._steps
        for rank in self._members:  # _due, inlined: this loop is on the per-Batch path
            steps = all_steps[rank]
            if sync:
                if steps < 1:
                    self._blocker = rank
                    return False
            elif steps < counts[rank] and rank not in quiesced and rank not in throttled:
                self._blocker = rank
                return False
            moved = moved or steps > 0
        return moved

    def _due(self, rank: int, counts: Sequence[int], quiesced: Set[int]) -> bool:
        """Has ``rank`` done its part of the window (see :meth:`ready`)?"""
        steps = self._steps[rank]
        if self._policy is Policy.SYNC:
            return steps >= 1
        return steps >= counts[rank] or rank in quiesced or rank in self._throttled

    def start_round(self, now: float, generation: int) -> RoundStarted:
        """Arm a new round on group ``generation`` and close the current window.

        Raises CoordinatorError if a round is unsettled or the group is empty. The caller
        normally checks :meth:`ready` first; it may also force a round (e.g. a final window).
        """
        if self._state is not RoundState.SETTLED:
            raise CoordinatorError(f"cycle: cannot start a round while {self._state.value}")
        if not self._members:
            raise CoordinatorError("cycle: cannot start a round with an empty group")
        steps = tuple(self._steps[r] if r in self._members else 0 for r in range(self._world_size))
        self._global_step += sum(steps)
        self._steps = [0] * self._world_size
        self._throttled.clear()
        effects = self._arm(now, generation)
        ranks = self._sorted_members()
        effects.append(Broadcast(SetGlobalStep(global_step=self._global_step), ranks))
        return RoundStarted(
            round=self._round,
            generation=generation,
            steps=steps,
            global_step=self._global_step,
            redo=False,
            effects=tuple(effects),
        )

    def _arm(self, now: float, generation: int) -> list[Effect]:
        self._round += 1
        self._generation = generation
        self._snapshot = list(self._last_step_count)
        self._acked = set()
        self._state = RoundState.IN_FLIGHT
        self._started_at = now
        self._stall.watch(now, generation, self._members)
        sync = SyncNow(round=self._round, generation=generation)
        return [Broadcast(sync, self._sorted_members())]

    def _sorted_members(self) -> tuple[int, ...]:
        return tuple(sorted(self._members))

    # --- backstops ------------------------------------------------------------------------

    def check_stall(self, now: float) -> list[Effect]:
        """ShutdownWithSave(REDUCE_STALL) once the in-flight round is unacked past the ceiling
        (:mod:`~flodl.core.coordinator.stall`: counted from when every member had joined the
        round's generation); at most once per cycle, never on a settled round."""
        if not self._stall.check(now):
            return []
        return [Broadcast(ShutdownWithSave(reason=SaveReason.REDUCE_STALL))]

    def next_deadline(self) -> float | None:
        """When :meth:`check_stall` would fire if nothing changes (None when it cannot)."""
        return self._stall.deadline()

    def throttle(self) -> list[Effect]:
        """One Throttle to each member more than ``max_batch_diff`` steps ahead of the slowest.

        The slowest is the minimum over the members. A rank is throttled at most once until
        the next round clears the latch. No-op without ``max_batch_diff``.
        """
        if self._max_batch_diff is None or not self._members:
            return []
        floor = min(self._steps[r] for r in self._members) + self._max_batch_diff
        effects: list[Effect] = []
        for rank in self._sorted_members():
            if self._steps[rank] > floor and rank not in self._throttled:
                self._throttled.add(rank)
                effects.append(Send(rank, Throttle()))
        return effects

    # --- membership -----------------------------------------------------------------------

    def drop_rank(self, now: float, rank: int) -> bool:
        """Remove a dead or departed ``rank`` from the group; True when that settled the round.

        Its uncounted steps are discarded (they were never averaged). Idempotent.
        """
        self._check_rank(rank)
        if rank not in self._members:
            return False
        self._members.discard(rank)
        self._acked.discard(rank)
        self._throttled.discard(rank)
        self._steps[rank] = 0
        self._stall.on_member_gone(now, rank)
        return self._settle_if_complete(now)

    def add_rank(self, rank: int) -> None:
        """Add ``rank`` to the group (after a growing re-formation).

        It starts with zero steps and counts as acked for any round in flight, which it was
        not part of.
        """
        self._check_rank(rank)
        if rank in self._members:
            return
        self._members.add(rank)
        self._acked.add(rank)
        self._steps[rank] = 0

    def abandon_round(self) -> bool:
        """Mark the in-flight round as lost, to be redone on the re-formed group.

        Call after the collective was aborted (a member died inside it). The stall clock
        stops (re-formation has its own deadlines); the window's steps stay counted in the
        global step. Returns False (and does nothing) when no unsettled round is in flight.
        """
        if self._state is not RoundState.IN_FLIGHT:
            return False
        self._state = RoundState.REDO_PENDING
        self._acked = set()
        self._started_at = None
        self._stall.stop()
        return True

    def redo_round(self, now: float, generation: int) -> RoundStarted:
        """Reissue an abandoned round as a new SyncNow (next round number) on ``generation``.

        The global step does not change and no window closes (steps since the abandon stay
        for the next round). Raises CoordinatorError unless a round is waiting to be redone.
        """
        if self._state is not RoundState.REDO_PENDING:
            raise CoordinatorError(f"cycle: no round to redo while {self._state.value}")
        if not self._members:
            raise CoordinatorError("cycle: cannot redo a round with an empty group")
        effects = self._arm(now, generation)
        return RoundStarted(
            round=self._round,
            generation=generation,
            steps=(0,) * self._world_size,
            global_step=self._global_step,
            redo=True,
            effects=tuple(effects),
        )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self._world_size:
            raise CoordinatorError(f"cycle: rank {rank} is outside world size {self._world_size}")
