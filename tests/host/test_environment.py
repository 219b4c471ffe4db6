"""flodl.host.environment: the rank's environment is written and read by one description."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl.config import CoordinatorConfig, Policy
from flodl.errors import ConfigError
from flodl.host.environment import RankEnv, write_session_key
from flodl.launch.config import LaunchConfig
from flodl.launch.launcher import rank_environment
from flodl.worker.config import WorkerConfig


def test_only_what_is_set_is_written() -> None:
    assert RankEnv(coordinator="tcp://h:1", rank=2, world_size=4).variables() == {
        "FLODL_COORDINATOR": "tcp://h:1",
        "RANK": "2",
        "WORLD_SIZE": "4",
    }


def test_what_is_written_reads_back_the_same() -> None:
    written = RankEnv(
        coordinator="unix:///tmp/c.sock",
        rank=1,
        world_size=3,
        local_rank=0,
        local_world_size=1,
        session_key_file=Path("/tmp/key"),
        backend="gloo",
        policy=Policy.ASYNC,
        heartbeat_timeout=4.5,
        heartbeat_interval=0.5,
        run_dir=Path("/tmp/run"),
        seed=9,
        host="10.0.0.2",
        op_timeout=7.0,
        resume=Path("/tmp/ckpt"),
        debug_param_hashes=True,
    )
    assert RankEnv.from_env(written.variables()) == written


def test_empty_variables_are_unset_and_bad_ones_are_named() -> None:
    env = {"FLODL_COORDINATOR": "tcp://h:1", "RANK": "0", "WORLD_SIZE": "1", "FLODL_SEED": " "}
    assert RankEnv.from_env(env).seed is None
    with pytest.raises(ConfigError, match="FLODL_OP_TIMEOUT must be > 0 seconds"):
        RankEnv.from_env({**env, "FLODL_OP_TIMEOUT": "0"})


def test_the_launchers_environment_is_what_a_rank_reads(tmp_path: Path) -> None:
    key = bytes(range(32))
    config = LaunchConfig(
        script="train.py",
        nproc=3,
        backend="gloo",
        run_dir=tmp_path,
        seed=5,
        coordinator=CoordinatorConfig(policy="sync", heartbeat_timeout=6.0),
    )
    key_file = write_session_key(tmp_path, key)
    env = rank_environment(config, 2, "tcp://127.0.0.1:9", key_file, 9, resume=tmp_path / "b")
    rank = WorkerConfig.from_env(env)
    assert (rank.coordinator, rank.rank, rank.world_size, rank.local_rank) == (
        "tcp://127.0.0.1:9",
        2,
        3,
        2,
    )
    assert rank.session_key == key and "FLODL_SESSION_KEY" not in env
    assert (rank.backend, rank.policy, rank.heartbeat_timeout, rank.seed) == (
        "gloo",
        Policy.SYNC,
        6.0,
        5,
    )
    assert rank.run_dir == tmp_path.resolve() and rank.resume == (tmp_path / "b").resolve()
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "9")
