"""WorkerConfig.from_env: what the launcher sets, defaults, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl.core.common.policy import Policy
from flodl.errors import ConfigError
from flodl.worker.config import WorkerConfig

KEY = "00112233445566778899aabbccddeeff"


def env(**overrides: str) -> dict[str, str]:
    base = {
        "FLODL_COORDINATOR": "tcp://127.0.0.1:4000",
        "FLODL_SESSION_KEY": KEY,
        "RANK": "1",
        "WORLD_SIZE": "3",
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v != "<unset>"}


def test_full_environment_is_read() -> None:
    config = WorkerConfig.from_env(
        env(
            LOCAL_RANK="0",
            FLODL_BACKEND="gloo",
            FLODL_POLICY="async",
            FLODL_HEARTBEAT_TIMEOUT="4.5",
            FLODL_HEARTBEAT_INTERVAL="0.5",
            FLODL_RUN_DIR="/tmp/run",
            FLODL_SEED="9",
            FLODL_HOST="10.0.0.2",
            FLODL_OP_TIMEOUT="7",
            FLODL_RESUME="/tmp/ckpt",
            FLODL_DEBUG_PARAM_HASHES="1",
        )
    )
    assert config.coordinator == "tcp://127.0.0.1:4000"
    assert config.session_key == bytes.fromhex(KEY)
    assert (config.rank, config.world_size, config.local_rank) == (1, 3, 0)
    assert config.backend == "gloo" and config.policy is Policy.ASYNC
    assert (config.heartbeat_timeout, config.heartbeat_interval) == (4.5, 0.5)
    assert config.run_dir == Path("/tmp/run") and config.seed == 9
    assert config.host == "10.0.0.2" and config.collective_timeout == 7.0
    assert config.resume == Path("/tmp/ckpt") and config.debug_param_hashes
    assert KEY not in repr(config)


def test_defaults() -> None:
    config = WorkerConfig.from_env(env())
    assert config.local_rank == 1  # LOCAL_RANK defaults to RANK
    assert config.backend == "auto" and config.policy is Policy.CADENCE
    assert (config.heartbeat_timeout, config.heartbeat_interval) == (10.0, 1.0)
    assert config.run_dir == Path(".") and config.seed == 0 and config.host is None
    assert config.collective_timeout == 30.0  # max(30, 2 x 10)
    assert WorkerConfig.from_env(env(FLODL_HEARTBEAT_TIMEOUT="40")).collective_timeout == 80.0
    assert config.resume is None and not config.debug_param_hashes


def test_session_key_from_a_file(tmp_path: Path) -> None:
    key_file = tmp_path / "session.key"
    key_file.write_text(KEY)
    config = WorkerConfig.from_env(
        env(FLODL_SESSION_KEY="<unset>", FLODL_SESSION_KEY_FILE=str(key_file))
    )
    assert config.session_key == bytes.fromhex(KEY)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"FLODL_COORDINATOR": "<unset>"}, "FLODL_COORDINATOR is not set"),
        ({"RANK": "<unset>"}, "RANK is not set"),
        ({"WORLD_SIZE": "three"}, "WORLD_SIZE must be an integer, got 'three'"),
        ({"RANK": "3"}, r"RANK 3 is not in range\(WORLD_SIZE=3\)"),
        ({"FLODL_SESSION_KEY": "<unset>"}, "no session key"),
        ({"FLODL_SESSION_KEY": "zz"}, "must be hex"),
        ({"FLODL_POLICY": "eventually"}, "FLODL_POLICY must be one of sync, cadence, async"),
        ({"FLODL_BACKEND": "mpi"}, "FLODL_BACKEND must be one of"),
        ({"FLODL_HEARTBEAT_TIMEOUT": "-1"}, "FLODL_HEARTBEAT_TIMEOUT must be > 0"),
        ({"FLODL_HEARTBEAT_TIMEOUT": "soon"}, "must be a number of seconds"),
        ({"FLODL_HEARTBEAT_INTERVAL": "10"}, "must be below FLODL_HEARTBEAT_TIMEOUT"),
        ({"FLODL_SEED": "-2"}, "FLODL_SEED must be >= 0"),
        ({"FLODL_DEBUG_PARAM_HASHES": "maybe"}, "FLODL_DEBUG_PARAM_HASHES must be 0 or 1"),
    ],
)
def test_bad_environment_names_the_variable(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WorkerConfig.from_env(env(**overrides))
