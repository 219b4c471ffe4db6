"""The node agent's small parts: folding its ranks' messages into frames, its restart budget,
what it says when it ends, and the environment of its ranks."""

from __future__ import annotations

from pathlib import Path

from flodl.agent.agent import AgentResult, agent_rank_environment
from flodl.agent.config import AgentConfig
from flodl.agent.link import FRAME_BYTES, NodeAssignment, _folded
from flodl.agent.sessions import Said
from flodl.supervise.ranks import RestartBudget
from flodl.wire.messages import AgentStop, Message, RankClosed, RankOpen, RanksUp


def test_messages_queued_together_go_up_as_one_frame_and_the_others_keep_their_place() -> None:
    items: list[Message | Said] = [
        RankOpen(0),
        Said(66, b"a"),
        Said(64, b"b"),
        Said(66, b"c"),
        AgentStop("signalled"),
        Said(65, b"d"),
        RankClosed(1),
    ]
    assert _folded(items) == [
        RankOpen(0),
        RanksUp((66, 64, 66), (b"a", b"b", b"c")),
        AgentStop("signalled"),
        RanksUp((65,), (b"d",)),
        RankClosed(1),
    ]
    big = [Said(64, b"x" * (FRAME_BYTES // 2 + 1)) for _ in range(3)]
    assert [len(m.tags) for m in _folded(big) if isinstance(m, RanksUp)] == [1, 1, 1]


def test_a_hosts_restarts_are_shared_by_its_ranks() -> None:
    budget = RestartBudget(2)
    assert [budget.take() for _ in range(3)] == [True, True, False]
    assert budget.left == 0


def test_the_closing_line_and_status_say_how_the_run_ended_for_the_node() -> None:
    assignment = NodeAssignment(2, 2, 4, "10.0.0.2")
    ended = AgentResult(assignment, {2: ["SIGKILL", "0"], 3: ["0"]}, 1, None, False)
    assert ended.exit_status() == 0  # rank 2 was killed and replaced: the run went on
    assert ended.exit_status(strict=True) == 1  # --strict hears of it
    assert (
        AgentResult(assignment, {2: ["0"], 3: ["0"]}, 0, None, False).exit_status(strict=True) == 0
    )
    assert ended.closing_line("flodl agent") == (
        "flodl agent: the run ended; exits: rank 2: SIGKILL 0, rank 3: 0; restarts: 1"
    )
    lost = AgentResult(assignment, {2: ["1"]}, 0, "ChannelClosed: gone", False)
    assert lost.exit_status() == 1
    assert "lost the coordinator (ChannelClosed: gone)" in lost.closing_line("x")
    assert AgentResult(assignment, {}, 0, None, True).exit_status() == 1  # ranks were killed


def test_a_ranks_environment_names_its_place_and_its_agents_socket(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    config = AgentConfig(
        coordinator="tcp://10.0.0.1:29400",
        node_rank=1,
        nproc=2,
        script=str(script),
        run_dir=tmp_path,
        restarts=3,
    )
    env = agent_rank_environment(
        config,
        NodeAssignment(2, 2, 4, "10.0.0.2"),
        1,
        tmp_path / "session.key",
        restart_count=1,
        coordinator="unix:///tmp/flodl-agent-x/ranks.sock",
    )
    expected = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "FLODL_COORDINATOR": "unix:///tmp/flodl-agent-x/ranks.sock",
        "FLODL_HOST": "10.0.0.2",
    }
    assert {name: env.get(name) for name in expected} == expected
    assert "GROUP_WORLD_SIZE" not in env and "FLODL_SESSION_KEY" not in env
