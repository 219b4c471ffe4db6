"""`flodl run` gives a script what torchrun gives it, and runs a plain torchrun script (its
own init_process_group and a DDP model, no flodl in it) unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("torchrun_script.py")
SAME_AS_TORCHRUN = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "OMP_NUM_THREADS",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)
"""Set by both alike. Not set by flodl: TORCHELASTIC_USE_AGENT_STORE (no agent hosts a store:
the script's rank 0 does, at MASTER_PORT), TORCHELASTIC_ERROR_FILE and
TORCHELASTIC_SIGNALS_TO_HANDLE (torchelastic's own machinery)."""


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "FLODL_"))}
    for name in (*SAME_AS_TORCHRUN, "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def envs(folder: Path, n: int) -> list[dict[str, Any]]:
    return [json.loads((folder / f"env{rank}.json").read_text()) for rank in range(n)]


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, env=clean_env(), cwd=cwd, capture_output=True, text=True, timeout=180
    )


def test_flodl_run_sets_what_torchrun_sets(tmp_path: Path) -> None:
    (tmp_path / "torchrun").mkdir()
    (tmp_path / "ours").mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3"]
    done = run([*torchrun, str(SCRIPT), str(tmp_path / "torchrun")], tmp_path)
    assert done.returncode == 0, done.stderr
    flodl = [sys.executable, "-m", "flodl.cli", "run", "--nproc", "3", "--no-live"]
    flodl += ["--run-dir", str(tmp_path / "run")]
    done = run([*flodl, str(SCRIPT), str(tmp_path / "ours")], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OMP_NUM_THREADS=1 for each rank" in done.stdout
    coordinator = None
    for theirs, ours in zip(
        envs(tmp_path / "torchrun", 3), envs(tmp_path / "ours", 3), strict=True
    ):
        for name in SAME_AS_TORCHRUN:
            assert ours.get(name) == theirs.get(name), name
        assert theirs["MASTER_ADDR"] == "localhost" and ours["MASTER_ADDR"] == "127.0.0.1"
        assert ours["MASTER_PORT"] != ours["FLODL_COORDINATOR"].rsplit(":", 1)[-1]
        assert ours["TORCHELASTIC_RUN_ID"] == "run"  # the run folder's name
        coordinator = coordinator or ours["FLODL_COORDINATOR"]
        assert ours["FLODL_COORDINATOR"] == coordinator  # flodl's own address, apart
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert "never calls flodl.worker.join" in summary["message"]


def test_a_plain_ddp_script_runs_under_flodl_run_unchanged(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    command = [sys.executable, "-m", "flodl.cli", "run", "--nproc", "2", "--no-live"]
    command += ["--run-dir", str(tmp_path / "run"), str(SCRIPT), str(tmp_path / "out"), "--train"]
    done = run(command, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        assert f"[rank {rank}] rank {rank}: replicas equal: True" in done.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert [r["exit_code"] for r in summary["ranks"]] == [0, 0]


def test_the_same_ddp_script_runs_under_flodl_worker(tmp_path: Path) -> None:
    """Two `flodl worker`s (as on two hosts) start the plain script with torchrun's layout and
    MASTER_ADDR/MASTER_PORT (--master-port, as torchrun's flag); it never needs the
    coordinator, which is not even started."""
    import secrets
    import socket

    (tmp_path / "out").mkdir()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(clean_env(), FLODL_SESSION_KEY=secrets.token_hex(32))
    procs = []
    for rank in range(2):
        command = [sys.executable, "-m", "flodl.cli", "worker", "--coordinator"]
        command += ["tcp://127.0.0.1:9", "--rank", str(rank), "--world-size", "2"]
        command += ["--master-port", str(port), "--run-dir", str(tmp_path / "w")]
        command += [str(SCRIPT), str(tmp_path / "out"), "--train"]
        procs.append(
            subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
        )
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    assert [p.returncode for p in procs] == [0, 0], outputs
    for rank, out in enumerate(outputs):
        assert f"rank {rank}: replicas equal: True" in out
    for theirs in envs(tmp_path / "out", 2):
        assert (theirs["MASTER_ADDR"], theirs["MASTER_PORT"]) == ("127.0.0.1", str(port))
        assert theirs["GROUP_RANK"] == "0" and theirs["LOCAL_WORLD_SIZE"] == "1"
