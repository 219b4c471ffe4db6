"""``window_cap_s``: once ranks are timed, no rank's window takes longer than the cap at its
measured speed, however large ElChe's anchor; without the cap the same run's windows follow
the anchor. Real coordinator, scripted ranks, MockClock."""

from __future__ import annotations

from trio.testing import MockClock

from flodl.config import CoordinatorConfig
from flodl.core.coordinator.timeline import EventKind
from flodl.testing import RankScript, open_cluster


async def window_lengths(config: CoordinatorConfig) -> list[float]:
    scripts = [RankScript(ms_per_batch=10.0), RankScript(ms_per_batch=25.0)]
    async with open_cluster(scripts, dataset_size=200_000, config=config) as cluster:
        await cluster.coordinator.wait_finished()
    ends = [e for e in cluster.coordinator.timeline if e.kind is EventKind.SYNC_END]
    return [float(e.detail["window_s"]) for e in ends]


async def test_the_cap_bounds_every_timed_window(autojump_clock: MockClock) -> None:
    # Anchor 100 on the 25 ms rank: 2.5 s windows; capped at 0.5 s.
    free = await window_lengths(CoordinatorConfig(anchor=100, max_time=20.0))
    capped = await window_lengths(CoordinatorConfig(anchor=100, max_time=20.0, window_cap_s=0.5))
    assert max(free[3:]) > 2.0
    # The first windows come before the ranks are timed; from then on the cap holds (a
    # window also holds the round's messages and a batch that straddles its end).
    assert max(capped[3:]) <= 0.55, capped
    assert len(capped) > 3 * len(free)
