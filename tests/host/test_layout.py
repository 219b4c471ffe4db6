"""A worker's place in the job, from its flags, torchrun's variables or Slurm's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flodl.errors import ConfigError
from flodl.host.layout import RankLayout, layout_from


def slurm(node: int, local: int, *, nodes: int = 2, per_node: int = 2) -> dict[str, str]:
    """What srun sets for one task of ``nodes`` x ``per_node`` tasks."""
    return {
        "SLURM_PROCID": str(node * per_node + local),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_LOCALID": str(local),
        "SLURM_NODEID": str(node),
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
    }


def test_two_nodes_of_two_tasks_under_slurm() -> None:
    layouts = [layout_from(slurm(node, local)) for node in range(2) for local in range(2)]
    assert layouts == [
        RankLayout(0, 4, 0, 2, 0, source="slurm"),
        RankLayout(1, 4, 1, 2, 0, source="slurm"),
        RankLayout(2, 4, 0, 2, 1, source="slurm"),
        RankLayout(3, 4, 1, 2, 1, source="slurm"),
    ]


def test_uneven_nodes_and_ntasks_per_node() -> None:
    env = {**slurm(2, 0, nodes=3), "SLURM_NTASKS": "5", "SLURM_PROCID": "4"}
    env["SLURM_TASKS_PER_NODE"] = "2(x2),1"
    assert layout_from(env) == RankLayout(4, 5, 0, 1, 2, source="slurm")
    env["SLURM_NTASKS_PER_NODE"] = "3"
    env["SLURM_LOCALID"] = "2"
    assert layout_from(env).local_world_size == 3


def test_torchrun_wins_over_slurm_and_flags_over_both() -> None:
    torchrun = {
        "TORCHELASTIC_RUN_ID": "x",
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
    }
    env = {**slurm(0, 0), **torchrun}
    assert layout_from(env) == RankLayout(5, 8, 1, 4, 1, source="torchrun")
    # The flags give the rank and world; the place on the host is still LOCAL_RANK's.
    assert layout_from(env, rank=2, world_size=3) == RankLayout(2, 3, 1, 4)
    assert layout_from(env, rank=2, world_size=3, local_rank=0) == RankLayout(2, 3, 0, 4)


def test_workers_of_one_host_started_by_hand_get_their_own_gpus() -> None:
    # `flodl worker --rank R --world-size N` twice on one host: not both on GPU 0.
    assert layout_from({}, rank=1, world_size=4, local_rank=1) == RankLayout(1, 4, 1, 2)
    assert layout_from({}, rank=3, world_size=4, local_rank=1, local_world_size=2) == RankLayout(
        3, 4, 1, 2
    )
    assert layout_from({"LOCAL_RANK": "2"}, rank=2, world_size=4) == RankLayout(2, 4, 2, 3)
    assert layout_from({}, rank=2, world_size=4) == RankLayout(2, 4)  # one worker on the host
    with pytest.raises(ConfigError, match="go with --rank and --world-size"):
        layout_from({}, local_rank=1)
    with pytest.raises(ConfigError, match="local rank 2 is not below the ranks of this host 2"):
        layout_from({}, rank=0, world_size=4, local_rank=2, local_world_size=2)


def test_what_is_missing_or_wrong_is_named() -> None:
    with pytest.raises(ConfigError, match="--rank and --world-size are needed"):
        layout_from({})
    with pytest.raises(ConfigError, match="give both --rank and --world-size"):
        layout_from({}, rank=1)
    with pytest.raises(ConfigError, match="SLURM_NTASKS must be an integer, got 'four'"):
        layout_from({**slurm(0, 0), "SLURM_NTASKS": "four"})
    with pytest.raises(ConfigError, match=r"rank 4 is not below the world size 4 \(slurm\)"):
        layout_from({**slurm(0, 0), "SLURM_PROCID": "4"})


def test_srun_flodl_worker_starts_the_script_as_its_slurm_rank(tmp_path: Path) -> None:
    script = tmp_path / "dump.py"
    script.write_text(
        "import json, os, sys\n"
        "keys = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'GROUP_RANK')\n"
        "print(json.dumps({k: os.environ.get(k) for k in keys}))\n"
    )
    seen = []
    for node in range(2):
        for local in range(2):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FLODL"))}
            env.update(slurm(node, local), FLODL_SESSION_KEY="ab" * 32)
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
                env.pop(name, None)
            command = [sys.executable, "-m", "flodl.cli", "worker"]
            command += ["--coordinator", "tcp://127.0.0.1:9", "--run-dir", str(tmp_path / "w")]
            done = subprocess.run(
                [*command, str(script)], env=env, capture_output=True, text=True, timeout=60
            )
            assert done.returncode == 0, done.stderr
            seen.append(json.loads(done.stdout))
    assert seen == [
        {"RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r % 2)}
        | {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(r // 2)}
        for r in range(4)
    ]
