"""elche_for_world: a saved ElChe fitted to the resumed run's world size."""

from __future__ import annotations

import pytest

from flodl.checkpoint import elche_for_world
from flodl.core.cadence.elche import ElChe, Phase
from flodl.errors import CheckpointError, ConfigError
from tests.core.elche_feed import report

MS = [10.0, 20.0, 30.0, 40.0]  # time per batch of ranks 0..3; rank 3 is the slowest


def stable_four_ranks() -> ElChe:
    """4 ranks after 6 reports: Stable phase, rank 3 elected anchor rank, counts 10*40/ms."""
    elche = ElChe(4, anchor=10)
    counts = elche.batch_counts
    for _ in range(6):
        counts = report(elche, [ms * c for ms, c in zip(MS, counts, strict=True)], counts)
    assert elche.anchor_rank == 3
    assert elche.phase is Phase.STABLE
    assert counts == [40, 20, 13, 10]  # round(10*40/30) = 13
    return elche


def test_same_world_size_restores_exactly() -> None:
    saved = stable_four_ranks().state()
    assert elche_for_world(saved, 4).state() == saved


def test_shrink_drops_the_anchor_rank_and_elects_the_slowest_survivor() -> None:
    saved = stable_four_ranks().state()
    elche = elche_for_world(saved, 2)
    assert elche.world_size == 2
    assert elche.smoothed_ms == [10.0, 20.0]
    assert elche.anchor_rank == 1  # the slowest kept rank
    assert elche.batch_counts == [20, 10]  # anchor 10 for rank 1, 10*20/10 for rank 0
    assert (elche.anchor, elche.calibration_count, elche.phase) == (10, 6, Phase.STABLE)


def test_shrink_to_three() -> None:
    elche = elche_for_world(stable_four_ranks().state(), 3)
    assert elche.anchor_rank == 2
    assert elche.batch_counts == [30, 15, 10]
    assert elche.phase is Phase.STABLE


def test_shrink_keeping_the_anchor_rank_keeps_it() -> None:
    elche = ElChe(3, anchor=8)
    counts = report(elche, [40.0, 10.0, 20.0], [1, 1, 1])  # rank 0: the first anchor rank
    assert counts == [8, 32, 16]
    fitted = elche_for_world(elche.state(), 2)
    assert fitted.anchor_rank == 0
    assert fitted.batch_counts == [8, 32]
    assert fitted.phase is Phase.WARMUP


def test_grow_adds_untimed_ranks_that_run_the_anchor() -> None:
    saved = stable_four_ranks().state()
    elche = elche_for_world(saved, 6)
    assert elche.world_size == 6
    assert elche.smoothed_ms == [*MS, None, None]
    assert elche.batch_counts == [40, 20, 13, 10, 10, 10]
    assert (elche.anchor, elche.anchor_rank, elche.phase) == (10, 3, Phase.STABLE)
    # The first report times the new ranks: rank 4 at 5 ms runs 10*40/5, rank 5 at 40 ms
    # ties with the incumbent anchor rank, which stays.
    ms = [*MS, 5.0, 40.0]
    counts = elche.batch_counts
    counts = report(elche, [m * c for m, c in zip(ms, counts, strict=True)], counts)
    assert counts == [40, 20, 13, 10, 80, 10]
    assert elche.anchor_rank == 3


def test_bad_inputs() -> None:
    saved = stable_four_ranks().state()
    with pytest.raises(ConfigError, match="world size 0"):
        elche_for_world(saved, 0)
    with pytest.raises(CheckpointError, match="newer"):
        elche_for_world(saved | {"version": 99}, 4)
    with pytest.raises(CheckpointError, match="malformed"):
        elche_for_world({"version": 1}, 4)
