"""Forming the collective group: the first one, and again after deaths or a rejoin.

One formation (generation ``g``) goes:

1. :meth:`Rendezvous.form_initial` (``g = 0``, all ranks) or :meth:`Rendezvous.begin`
   (``g = last + 1``, the survivors, or a larger set when a rank rejoins) picks a
   *generator* with :func:`choose_generator` and sends it ``RequestNewGroup``.
2. The generator answers ``NewGroupReady`` with backend data (``info``, opaque bytes).
   A reply from any other rank, or for another generation, is dropped.
3. :meth:`Rendezvous.on_ready` sends ``NewGroupSession`` to each member of the *current*
   alive set (passed in, so deaths and joins during the wait are folded in): ``new_rank``
   is the member's index in ascending global order, ``info`` is forwarded verbatim.
4. If the generator dies or stays silent ``retry_timeout`` seconds (at the deadline:
   ``now - asked >= retry_timeout``), :meth:`Rendezvous.poll` adds it to the tried set and
   asks the next alive, untried candidate, chosen by the same rule.
5. With fewer than 2 members, or no candidate left, the formation is exhausted:
   ``ShutdownWithSave(reason)`` goes out once (reason given by the caller, else
   SINGLE_SURVIVOR), and the rendezvous does nothing more.

Candidates for generator are the ranks that were asked to form the group; ``alive`` is
always an argument, so the caller's liveness ledger stays the only source of truth.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Set

from flodl.core.coordinator.effects import Broadcast, Effect, Send
from flodl.errors import ConfigError, CoordinatorError
from flodl.wire.messages import (
    NewGroupReady,
    NewGroupSession,
    RequestNewGroup,
    SaveReason,
    ShutdownWithSave,
)

DEFAULT_RETRY_TIMEOUT = 5.0
"""Seconds a generator may stay silent before the next candidate is asked."""


def choose_generator(
    candidates: Iterable[int],
    *,
    local_ranks: Set[int] = frozenset(),
    ms_per_batch: Mapping[int, float] | None = None,
) -> int | None:
    """The rank that should generate the group's backend data, or None without candidates.

    Tier 1: the lowest candidate local to the coordinator's host. Tier 2: the candidate with
    the smallest per-batch wall time (ms); ties go to the lower rank; a rank without timing
    (missing, NaN or negative) sorts after every rank with timing.
    """
    pool = sorted(set(candidates))
    if not pool:
        return None
    local = [r for r in pool if r in local_ranks]
    if local:
        return local[0]
    timings = ms_per_batch or {}

    def key(rank: int) -> tuple[float, int]:
        ms = timings.get(rank)
        if ms is None or math.isnan(ms) or ms < 0:
            return (math.inf, rank)
        return (ms, rank)

    return min(pool, key=key)


class Rendezvous:
    """Group formation for a run of ``world_size`` ranks (global ids ``0..W-1``).

    ``generation`` is that of the last group formed (None before the first); a group needs
    at least two members (one when the world has a single rank).
    """

    def __init__(
        self,
        world_size: int,
        *,
        local_ranks: Iterable[int] = (),
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
    ) -> None:
        if world_size < 1:
            raise ConfigError(f"rendezvous: world_size must be >= 1, got {world_size}")
        if not retry_timeout > 0:
            raise ConfigError(f"rendezvous: retry_timeout must be > 0, got {retry_timeout}")
        self._world_size = world_size
        self._local_ranks = frozenset(local_ranks)
        self._timeout = float(retry_timeout)
        self._min_size = min(2, world_size)
        self._generation: int | None = None
        self._members: tuple[int, ...] = ()
        # The formation in progress, if any.
        self._pending: int | None = None
        self._candidates: frozenset[int] = frozenset()
        self._ms_per_batch: dict[int, float] = {}
        self._generator: int | None = None
        self._asked_at = 0.0
        self._tried: set[int] = set()
        self._exhausted = False

    # --- read-only state ------------------------------------------------------------------

    @property
    def generation(self) -> int | None:
        """Generation of the last group formed (None before the first)."""
        return self._generation

    @property
    def members(self) -> tuple[int, ...]:
        """Global ranks of the last group formed, ascending (index = rank in the group)."""
        return self._members

    @property
    def pending(self) -> bool:
        """True while a formation waits for its generator."""
        return self._pending is not None

    @property
    def pending_generation(self) -> int | None:
        return self._pending

    @property
    def generator(self) -> int | None:
        """The rank asked for the pending formation (None when none is pending)."""
        return self._generator

    @property
    def tried(self) -> frozenset[int]:
        """Generators that died or timed out in the pending formation."""
        return frozenset(self._tried)

    @property
    def exhausted(self) -> bool:
        """True once a formation failed for good (ShutdownWithSave was returned)."""
        return self._exhausted

    # --- starting a formation -------------------------------------------------------------

    def form_initial(
        self,
        now: float,
        ranks: Iterable[int] | None = None,
        *,
        ms_per_batch: Mapping[int, float] | None = None,
        reason: SaveReason | None = None,
    ) -> list[Effect]:
        """Start forming generation 0 with ``ranks`` (default: every rank).

        Raises CoordinatorError if a group was already formed or a formation is pending.
        """
        if self._generation is not None or self._pending is not None:
            raise CoordinatorError("rendezvous: the initial group was already started")
        members = range(self._world_size) if ranks is None else ranks
        return self._start(now, 0, members, ms_per_batch, reason)

    def begin(
        self,
        now: float,
        members: Iterable[int],
        *,
        ms_per_batch: Mapping[int, float] | None = None,
        reason: SaveReason | None = None,
    ) -> list[Effect]:
        """Start re-forming the group (next generation) with ``members``.

        ``members`` are the survivors, plus any rejoining rank for a growing re-formation.
        Does nothing while a formation is pending (later deaths and joins are folded in when
        the generator answers) or after exhaustion. Raises CoordinatorError before the
        initial group was started.
        """
        if self._exhausted or self._pending is not None:
            return []
        if self._generation is None:
            raise CoordinatorError("rendezvous: form the initial group before re-forming it")
        return self._start(now, self._generation + 1, members, ms_per_batch, reason)

    def _start(
        self,
        now: float,
        generation: int,
        members: Iterable[int],
        ms_per_batch: Mapping[int, float] | None,
        reason: SaveReason | None,
    ) -> list[Effect]:
        candidates = frozenset(members)
        for rank in candidates:
            if not 0 <= rank < self._world_size:
                raise CoordinatorError(
                    f"rendezvous: rank {rank} is outside world size {self._world_size}"
                )
        if self._exhausted:
            return []
        self._pending = generation
        self._candidates = candidates
        self._ms_per_batch = dict(ms_per_batch or {})
        self._tried = set()
        if len(candidates) < self._min_size:
            return self._exhaust(reason)
        return self._ask(now, candidates)

    def _ask(self, now: float, alive: Set[int]) -> list[Effect]:
        pool = (self._candidates & alive) - self._tried
        generator = choose_generator(
            pool, local_ranks=self._local_ranks, ms_per_batch=self._ms_per_batch
        )
        assert generator is not None and self._pending is not None
        self._generator = generator
        self._asked_at = now
        expected = len(self._candidates & alive)
        return [Send(generator, RequestNewGroup(generation=self._pending, world_size=expected))]

    def _exhaust(self, reason: SaveReason | None) -> list[Effect]:
        self._pending = None
        self._generator = None
        self._exhausted = True
        final = reason if reason is not None else SaveReason.SINGLE_SURVIVOR
        return [Broadcast(ShutdownWithSave(reason=final))]

    # --- progress -------------------------------------------------------------------------

    def on_ready(
        self,
        now: float,
        reply: NewGroupReady,
        alive: Set[int],
        *,
        reason: SaveReason | None = None,
    ) -> list[Effect]:
        """The generator answered: send NewGroupSession to every member of ``alive``.

        ``alive`` is the membership now (the caller's live set, including any rejoining
        rank). A reply from another rank than the current generator, or for another
        generation, is dropped (returns []). Fewer than two members exhausts the formation.
        """
        if self._pending is None or reply.generation != self._pending:
            return []
        if reply.rank != self._generator:
            return []
        members = tuple(sorted(alive))
        if len(members) < self._min_size:
            return self._exhaust(reason)
        self._generation = self._pending
        self._members = members
        self._pending = None
        self._generator = None
        self._tried = set()
        size = len(members)
        return [
            Send(
                rank,
                NewGroupSession(
                    generation=self._generation,
                    new_rank=index,
                    new_world_size=size,
                    info=reply.info,
                ),
            )
            for index, rank in enumerate(members)
        ]

    def poll(
        self, now: float, alive: Set[int], *, reason: SaveReason | None = None
    ) -> list[Effect]:
        """Retry when the generator died (not in ``alive``) or ``retry_timeout`` elapsed.

        The failed generator joins the tried set and the next alive, untried candidate is
        asked; with none left, or fewer than two candidates alive, the formation is
        exhausted. Returns [] when nothing is due.
        """
        if self._pending is None or self._generator is None:
            return []
        dead = self._generator not in alive
        if not dead and now < self._asked_at + self._timeout:  # same sum as next_deadline()
            return []
        self._tried.add(self._generator)
        remaining = (self._candidates & alive) - self._tried
        if not remaining or len(self._candidates & alive) < self._min_size:
            return self._exhaust(reason)
        return self._ask(now, alive)

    def next_deadline(self) -> float | None:
        """When :meth:`poll` would retry a silent generator (None when nothing is pending)."""
        if self._pending is None:
            return None
        return self._asked_at + self._timeout
