"""Group formation: generator choice, retries, exhaustion, re-ranking, stale replies, growth."""

from __future__ import annotations

import math

import pytest

from flodl.core.coordinator.effects import Broadcast, Send
from flodl.core.coordinator.rendezvous import DEFAULT_RETRY_TIMEOUT, Rendezvous, choose_generator
from flodl.errors import ConfigError, CoordinatorError
from flodl.wire.messages import (
    NewGroupReady,
    NewGroupSession,
    RequestNewGroup,
    SaveReason,
    ShutdownWithSave,
)


def ready(rank: int, generation: int, info: bytes = b"store:127.0.0.1:29500") -> NewGroupReady:
    return NewGroupReady(rank=rank, generation=generation, info=info)


def formed(world_size: int, ranks: set[int], *, local: set[int] | None = None) -> Rendezvous:
    """A rendezvous whose generation-0 group holds ``ranks``."""
    rv = Rendezvous(world_size, local_ranks=local or set())
    effects = rv.form_initial(0.0, ranks)
    first = effects[0]
    assert isinstance(first, Send)
    rv.on_ready(0.1, ready(first.rank, 0), ranks)
    assert rv.generation == 0
    return rv


# --- generator choice ---------------------------------------------------------------------


def test_tier1_lowest_live_local_rank() -> None:
    assert choose_generator({0, 1, 2, 3}, local_ranks={3, 2}) == 2
    # A dead local rank is not a candidate; the next local one is chosen.
    assert choose_generator({0, 1, 3}, local_ranks={2, 3}, ms_per_batch={0: 1.0}) == 3


def test_tier2_fastest_per_batch_wall() -> None:
    timings = {0: 50.0, 1: 20.0, 2: 35.0}
    assert choose_generator({0, 1, 2}, ms_per_batch=timings) == 1
    # Local ranks that are not candidates do not count.
    assert choose_generator({0, 1, 2}, local_ranks={5}, ms_per_batch=timings) == 1


def test_tier2_ties_go_to_the_lower_rank() -> None:
    assert choose_generator({4, 2, 3}, ms_per_batch={2: 30.0, 3: 10.0, 4: 10.0}) == 3


def test_tier2_no_data_sorts_last() -> None:
    assert choose_generator({0, 1, 2}, ms_per_batch={2: 900.0}) == 2
    assert choose_generator({0, 1}, ms_per_batch={0: math.nan, 1: 900.0}) == 1
    assert choose_generator({0, 1}, ms_per_batch={0: -1.0, 1: 900.0}) == 1
    assert choose_generator({3, 1, 2}) == 1  # nobody has data: lowest rank
    assert choose_generator(set()) is None


# --- formation ----------------------------------------------------------------------------


def test_initial_formation_is_generation_zero_with_every_rank() -> None:
    rv = Rendezvous(3)
    assert rv.generation is None
    assert rv.form_initial(0.0) == [Send(0, RequestNewGroup(generation=0, world_size=3))]
    assert rv.pending and rv.pending_generation == 0 and rv.generator == 0
    info = b"\x00\x01gloo\xff"
    effects = rv.on_ready(1.0, ready(0, 0, info), {0, 1, 2})
    assert effects == [
        Send(0, NewGroupSession(generation=0, new_rank=0, new_world_size=3, info=info)),
        Send(1, NewGroupSession(generation=0, new_rank=1, new_world_size=3, info=info)),
        Send(2, NewGroupSession(generation=0, new_rank=2, new_world_size=3, info=info)),
    ]
    assert rv.generation == 0
    assert rv.members == (0, 1, 2)
    assert not rv.pending
    with pytest.raises(CoordinatorError):
        rv.form_initial(2.0)


def test_initial_formation_prefers_a_local_rank() -> None:
    rv = Rendezvous(4, local_ranks=[2, 3])
    assert rv.form_initial(0.0) == [Send(2, RequestNewGroup(generation=0, world_size=4))]


def test_reformation_reranks_survivors_in_ascending_global_order() -> None:
    rv = formed(5, {0, 1, 2, 3, 4})
    effects = rv.begin(10.0, {4, 0, 3, 1}, ms_per_batch={0: 80.0, 1: 40.0, 3: 40.0, 4: 10.0})
    assert effects == [Send(4, RequestNewGroup(generation=1, world_size=4))]
    sessions = rv.on_ready(11.0, ready(4, 1, b"g1"), {0, 1, 3, 4})
    assert sessions == [
        Send(0, NewGroupSession(generation=1, new_rank=0, new_world_size=4, info=b"g1")),
        Send(1, NewGroupSession(generation=1, new_rank=1, new_world_size=4, info=b"g1")),
        Send(3, NewGroupSession(generation=1, new_rank=2, new_world_size=4, info=b"g1")),
        Send(4, NewGroupSession(generation=1, new_rank=3, new_world_size=4, info=b"g1")),
    ]
    assert (rv.generation, rv.members) == (1, (0, 1, 3, 4))
    # The next re-formation is generation 2.
    assert rv.begin(20.0, {0, 1, 3}) == [Send(0, RequestNewGroup(generation=2, world_size=3))]


def test_deaths_during_the_wait_are_folded_in() -> None:
    rv = formed(4, {0, 1, 2, 3})
    rv.begin(5.0, {0, 1, 2})  # rank 3 died; generator 0
    # Rank 1 dies while we wait; the generator's reply builds the group from who is alive now.
    sessions = rv.on_ready(6.0, ready(0, 1), {0, 2})
    assert sessions == [
        Send(0, NewGroupSession(generation=1, new_rank=0, new_world_size=2, info=ready(0, 1).info)),
        Send(2, NewGroupSession(generation=1, new_rank=1, new_world_size=2, info=ready(0, 1).info)),
    ]


def test_begin_while_pending_does_nothing() -> None:
    rv = formed(3, {0, 1, 2})
    rv.begin(1.0, {0, 1})
    assert rv.begin(1.5, {0}) == []
    assert rv.pending_generation == 1 and rv.generator == 0


def test_begin_before_the_initial_group_is_refused() -> None:
    with pytest.raises(CoordinatorError):
        Rendezvous(2).begin(0.0, {0, 1})


# --- stale and foreign replies ------------------------------------------------------------


def test_replies_from_other_ranks_or_generations_are_dropped() -> None:
    rv = formed(3, {0, 1, 2})
    rv.begin(1.0, {0, 1, 2})  # generation 1, generator 0
    assert rv.on_ready(1.1, ready(1, 1), {0, 1, 2}) == []  # not the generator
    assert rv.on_ready(1.2, ready(0, 0), {0, 1, 2}) == []  # stale generation
    assert rv.on_ready(1.3, ready(0, 2), {0, 1, 2}) == []  # future generation
    assert rv.pending and rv.generation == 0
    assert len(rv.on_ready(1.4, ready(0, 1), {0, 1, 2})) == 3
    assert rv.on_ready(1.5, ready(0, 1), {0, 1, 2}) == []  # duplicate after formation


def test_late_reply_from_a_replaced_generator_is_dropped() -> None:
    rv = formed(3, {0, 1, 2})
    rv.begin(0.0, {0, 1, 2})
    rv.poll(DEFAULT_RETRY_TIMEOUT, {0, 1, 2})  # generator 0 timed out; 1 asked
    assert rv.generator == 1
    assert rv.on_ready(6.0, ready(0, 1), {0, 1, 2}) == []
    assert len(rv.on_ready(6.1, ready(1, 1), {0, 1, 2})) == 3


# --- retries and exhaustion ---------------------------------------------------------------


def test_retry_when_the_generator_dies() -> None:
    rv = formed(4, {0, 1, 2, 3}, local={0})
    assert rv.begin(10.0, {0, 1, 2, 3}, ms_per_batch={1: 30.0, 2: 20.0, 3: 25.0}) == [
        Send(0, RequestNewGroup(generation=1, world_size=4))
    ]
    assert rv.poll(10.5, {0, 1, 2, 3}) == []  # alive and inside its window
    # Generator 0 dies: the next candidate by the same rule is the fastest, rank 2.
    assert rv.poll(11.0, {1, 2, 3}) == [Send(2, RequestNewGroup(generation=1, world_size=3))]
    assert rv.tried == frozenset({0})
    assert rv.next_deadline() == 16.0


def test_retry_after_five_seconds_of_silence_at_the_deadline() -> None:
    rv = formed(3, {0, 1, 2})
    rv.begin(10.0, {0, 1, 2})
    assert rv.next_deadline() == 15.0
    assert rv.poll(14.999, {0, 1, 2}) == []
    assert rv.poll(15.0, {0, 1, 2}) == [Send(1, RequestNewGroup(generation=1, world_size=3))]
    assert rv.poll(19.999, {0, 1, 2}) == []
    assert rv.poll(20.0, {0, 1, 2}) == [Send(2, RequestNewGroup(generation=1, world_size=3))]
    assert rv.tried == frozenset({0, 1})


def test_all_candidates_tried_exhausts_with_single_survivor() -> None:
    rv = formed(2, {0, 1})
    rv.begin(0.0, {0, 1})
    rv.poll(5.0, {0, 1})
    assert rv.poll(10.0, {0, 1}) == [
        Broadcast(ShutdownWithSave(reason=SaveReason.SINGLE_SURVIVOR), None)
    ]
    assert rv.exhausted and not rv.pending
    assert rv.poll(20.0, {0, 1}) == []
    assert rv.begin(21.0, {0, 1}) == []
    assert rv.next_deadline() is None


def test_exhaustion_uses_the_callers_reason() -> None:
    rv = formed(3, {0, 1, 2})
    rv.begin(0.0, {0, 1, 2})
    effects = rv.poll(1.0, {1}, reason=SaveReason.MAX_FAILURE)  # generator dead, 1 left
    assert effects == [Broadcast(ShutdownWithSave(reason=SaveReason.MAX_FAILURE), None)]


def test_fewer_than_two_survivors_exhausts_at_once() -> None:
    rv = formed(3, {0, 1, 2})
    assert rv.begin(0.0, {2}) == [
        Broadcast(ShutdownWithSave(reason=SaveReason.SINGLE_SURVIVOR), None)
    ]
    assert rv.exhausted


def test_fewer_than_two_members_at_reply_time_exhausts() -> None:
    rv = formed(3, {0, 1, 2})
    rv.begin(0.0, {0, 1})
    assert rv.on_ready(1.0, ready(0, 1), {0}) == [
        Broadcast(ShutdownWithSave(reason=SaveReason.SINGLE_SURVIVOR), None)
    ]
    assert rv.generation == 0


def test_a_one_rank_world_forms_a_group_of_one() -> None:
    rv = Rendezvous(1)
    assert rv.form_initial(0.0) == [Send(0, RequestNewGroup(generation=0, world_size=1))]
    assert rv.on_ready(0.1, ready(0, 0, b"x"), {0}) == [
        Send(0, NewGroupSession(generation=0, new_rank=0, new_world_size=1, info=b"x"))
    ]


# --- growth -------------------------------------------------------------------------------


def test_growing_reformation_includes_the_rejoining_rank() -> None:
    rv = formed(4, {0, 1, 3})  # rank 2 was missing
    assert rv.begin(30.0, {0, 1, 2, 3}) == [Send(0, RequestNewGroup(generation=1, world_size=4))]
    sessions = rv.on_ready(31.0, ready(0, 1, b"g"), {0, 1, 2, 3})
    assert [(s.rank, s.message) for s in sessions if isinstance(s, Send)] == [
        (r, NewGroupSession(generation=1, new_rank=r, new_world_size=4, info=b"g"))
        for r in range(4)
    ]
    assert rv.members == (0, 1, 2, 3)


def test_a_rank_joining_during_the_wait_is_folded_in() -> None:
    rv = formed(4, {0, 1, 2})
    rv.begin(1.0, {0, 1})  # rank 2 died
    sessions = rv.on_ready(2.0, ready(0, 1), {0, 1, 3})  # rank 3 joined meanwhile
    assert [s.rank for s in sessions if isinstance(s, Send)] == [0, 1, 3]
    assert rv.members == (0, 1, 3)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError):
        Rendezvous(0)
    with pytest.raises(ConfigError):
        Rendezvous(2, retry_timeout=0.0)
    with pytest.raises(CoordinatorError):
        Rendezvous(2).form_initial(0.0, {0, 2})
