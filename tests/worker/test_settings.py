"""The coordinator owns the run's settings: a worker takes those it was not given and refuses
to run with one that says otherwise, naming both values."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from flodl.core.common.policy import Policy
from flodl.errors import ConfigError
from flodl.wire.messages import RunSettings
from flodl.worker.config import WorkerConfig
from flodl.worker.settings import adopt

KEY = "ab" * 32
THEIRS = RunSettings(
    policy="async", seed=7, heartbeat_interval=0.5, heartbeat_timeout=3.0, keep_checkpoints=4
)


def from_env(**variables: str) -> WorkerConfig:
    env = {"FLODL_COORDINATOR": "tcp://h:1", "RANK": "0", "WORLD_SIZE": "2"}
    env["FLODL_SESSION_KEY"] = KEY
    return WorkerConfig.from_env({**env, **variables})


def test_unset_settings_are_the_coordinators() -> None:
    config = adopt(from_env(), THEIRS)
    assert (config.policy, config.seed, config.keep_checkpoints) == (Policy.ASYNC, 7, 4)
    assert (config.heartbeat_interval, config.heartbeat_timeout) == (0.5, 3.0)
    assert config.backend == "auto"  # the coordinator left it to the rank


def test_a_setting_that_agrees_is_fine_one_that_contradicts_is_named() -> None:
    assert adopt(from_env(FLODL_POLICY="async", FLODL_SEED="7"), THEIRS).policy is Policy.ASYNC
    with pytest.raises(ConfigError) as refused:
        adopt(from_env(FLODL_POLICY="sync"), THEIRS)
    assert str(refused.value) == (
        "FLODL_POLICY=sync (this rank) but the coordinator runs policy async: "
        "leave it unset to take the coordinator's"
    )
    with pytest.raises(
        ConfigError, match=r"FLODL_SEED=3 \(this rank\) but the coordinator runs seed 7"
    ):
        adopt(from_env(FLODL_SEED="3"), THEIRS)
    backend = RunSettings(
        policy="async", seed=7, heartbeat_interval=0.5, heartbeat_timeout=3.0, backend="gloo"
    )
    with pytest.raises(ConfigError, match=r"FLODL_BACKEND=nccl .* backend gloo"):
        adopt(from_env(FLODL_BACKEND="nccl"), backend)


def test_a_config_built_in_code_is_checked_whole() -> None:
    config = WorkerConfig(coordinator="tcp://h:1", session_key=bytes(32), rank=0, world_size=1)
    with pytest.raises(ConfigError, match="FLODL_POLICY=cadence"):
        adopt(config, THEIRS)


@pytest.mark.slow
def test_flodl_worker_takes_the_policy_and_seed_and_refuses_a_contradiction(
    tmp_path: Path,
) -> None:
    """A real coordinator (--policy async --seed 7) and real workers: one with nothing but the
    address runs async; one told --policy sync is refused with both values named."""
    digits = Path(__file__).resolve().parents[2] / "examples" / "digits.py"
    env = dict(os.environ, FLODL_SESSION_KEY=secrets.token_hex(32))
    for name in ("FLODL_POLICY", "FLODL_SEED", "FLODL_HEARTBEAT_TIMEOUT"):
        env.pop(name, None)
    flodl = [sys.executable, "-m", "flodl.cli"]
    command = [*flodl, "coordinator", "--listen", "tcp://127.0.0.1:0", "--world-size", "1"]
    command += ["--policy", "async", "--seed", "7", "--run-dir", str(tmp_path / "c")]
    coordinator = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    procs = [coordinator]
    try:
        assert coordinator.stdout is not None
        url = re.search(r"tcp://127\.0\.0\.1:\d+", coordinator.stdout.readline())
        assert url
        worker = [*flodl, "worker", "--coordinator", url.group(0), "--rank", "0"]
        worker += ["--world-size", "1", "--run-dir", str(tmp_path / "w")]
        refused = subprocess.run(
            [*worker, "--policy", "sync", str(digits), "--epochs", "1"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode != 0
        assert (
            "FLODL_POLICY=sync (this rank) but the coordinator runs policy async"
            in refused.stdout + refused.stderr
        )
        taken = subprocess.run(
            [*worker, str(digits), "--epochs", "1"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert taken.returncode == 0, taken.stdout + taken.stderr
        rest, _ = coordinator.communicate(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    assert coordinator.returncode == 0, rest
    report = json.loads((tmp_path / "w" / "rank0.json").read_text())
    assert report["policy"] == "async"
