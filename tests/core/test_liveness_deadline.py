"""Liveness.next_deadline (a lazy heap) always equals the brute-force minimum over last-seen."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.core.coordinator.liveness import Liveness

WORLD = 6
TIMEOUT = 10.0

# (operation, rank, time): admit, frame, disconnect, check, or ask for the deadline.
operations = st.lists(
    st.tuples(
        st.sampled_from(["admit", "frame", "disconnect", "check", "deadline"]),
        st.integers(0, WORLD - 1),
        st.floats(0.0, 50.0, allow_nan=False),
    ),
    max_size=300,
)


def expected_deadline(liveness: Liveness) -> float | None:
    seen = [liveness.last_seen(r) for r in range(WORLD)]
    present = [t for t in seen if t is not None]
    return min(present) + TIMEOUT if present else None


@settings(max_examples=300, deadline=None)
@given(operations)
def test_next_deadline_matches_the_minimum_last_seen(ops: list[tuple[str, int, float]]) -> None:
    liveness = Liveness(WORLD, heartbeat_timeout=TIMEOUT)
    for op, rank, now in ops:
        if op == "admit" and not liveness.is_alive(rank):
            liveness.admit(rank, now)
        elif op == "frame":
            liveness.on_frame(rank, now)
        elif op == "disconnect":
            liveness.on_disconnect(rank, now)
        elif op == "check":
            liveness.check(now)
        assert liveness.next_deadline() == expected_deadline(liveness)


def test_deadline_follows_the_oldest_rank_through_many_frames() -> None:
    liveness = Liveness(3, heartbeat_timeout=TIMEOUT, initial=[0, 1, 2], now=0.0)
    for step in range(1, 1000):  # rank 0 stays silent; 1 and 2 chatter (heap grows, compacts)
        liveness.on_frame(1 + step % 2, float(step))
    assert liveness.next_deadline() == 0.0 + TIMEOUT
    liveness.on_disconnect(0, 1000.0)
    assert liveness.next_deadline() == 998.0 + TIMEOUT  # rank 1 last spoke at step 998
