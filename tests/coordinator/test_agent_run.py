"""The same run through node agents and directly: the coordinator decides the same things.

Four scripted ranks (:mod:`flodl.testing`) of unequal speed, one of which crashes, train to
the end under trio's mock clock over TCP, once connected to the coordinator directly and once
through two node agents of two ranks each (every rank's connection ending at its agent,
which speaks for it over its one connection). The coordinator's timeline (windows, anchors,
rounds, the death, the re-formation) and what its machine is handed from each rank are the
same.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
import trio
from trio.testing import MockClock

from flodl.agent.link import AgentLink
from flodl.coordinator.server import open_coordinator
from flodl.core.coordinator.machine import Status
from flodl.testing import TEST_KEY, RankScript, ScriptedRank, SimulatedGroups
from flodl.wire.messages import Message
from tests.coordinator.agent_helpers import carrying_agent

SCRIPTS = [
    RankScript(ms_per_batch=10),
    RankScript(ms_per_batch=17),
    RankScript(ms_per_batch=30),
    RankScript(ms_per_batch=10, die_after_batches=25),
]
DATASET = 3000


async def run(tmp_path: Path, through_agents: bool) -> tuple[list[str], dict[int, list[object]]]:
    """The run's timeline since its start, and per rank what the machine was handed."""
    seen: list[tuple[float, int, Message]] = []
    async with open_coordinator("tcp://127.0.0.1:0", 4, TEST_KEY, linger=0.0) as coord:
        started = trio.current_time()  # reset once the ranks start
        on_message = coord.machine.on_message

        def recording(rank: int, message: Message, now: float) -> list[object]:
            seen.append((now - started, rank, message))
            return on_message(rank, message, now)  # type: ignore[return-value]

        coord.machine.on_message = recording  # type: ignore[method-assign, assignment]
        groups = SimulatedGroups()
        ranks = [ScriptedRank(r, 4, s, groups) for r, s in enumerate(SCRIPTS)]
        async with trio.open_nursery() as nursery:
            if through_agents:
                links = [
                    await nursery.start(
                        _hold, carrying_agent(coord, node, 2, tmp_path / f"node{node}", TEST_KEY)
                    )
                    for node in (0, 1)
                ]
                urls = [links[rank // 2].ranks.url for rank in range(4)]
            else:
                urls = [coord.url] * 4
            started = trio.current_time()
            async with trio.open_nursery() as training:
                for rank, url in zip(ranks, urls, strict=True):
                    training.start_soon(rank.run, url, TEST_KEY, DATASET, 10, 1)
                await coord.wait_finished()
            nursery.cancel_scope.cancel()
        assert coord.machine.outcome.status is Status.COMPLETED
        events = sorted(
            repr((round(e.time - started, 9), e.kind.value, _rounded(e.detail)))
            for e in coord.timeline
        )
    handed = {
        rank: [
            _rounded((now, type(m).__name__, attrs.asdict(m))) for now, r, m in seen if r == rank
        ]
        for rank in range(4)
    }
    return events, handed


async def _hold(
    opening: object, *, task_status: trio.TaskStatus[AgentLink] = trio.TASK_STATUS_IGNORED
) -> None:
    async with opening as link:  # type: ignore[attr-defined]
        task_status.started(link)
        await trio.sleep_forever()


def _rounded(value: object) -> object:
    if isinstance(value, float):
        # Seven significant digits: both runs share one mock clock, so their times
        # differ by an offset whose float rounding can move the last few digits.
        return float(f"{value:.7g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_rounded(v) for v in value]
    return value


async def test_a_run_through_agents_is_decided_as_the_same_run_connected_directly(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    direct_events, direct_handed = await run(tmp_path / "direct", through_agents=False)
    agent_events, agent_handed = await run(tmp_path / "agents", through_agents=True)
    assert len(direct_handed[0]) > 100
    assert agent_events == direct_events
    for rank in range(4):
        assert agent_handed[rank] == direct_handed[rank], rank
