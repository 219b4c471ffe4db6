"""Ranks and their coordinator start in any order: workers started before the coordinator
keep trying to reach it, and a coordinator missing a worker starts without it at the join
timeout while --min-ranks allows, else fails naming it."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from flodl.observe.events import read_events
from tests.e2e.commands import DIGITS, FLODL, free_port, read_until

pytestmark = pytest.mark.slow


def start(command: Sequence[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def worker(url: str, rank: int, world: int, run_dir: Path) -> list[str]:
    return [
        *FLODL,
        "worker",
        "--coordinator",
        url,
        "--rank",
        str(rank),
        "--world-size",
        str(world),
        "--run-dir",
        str(run_dir),
        "--join-timeout",
        "60",
        str(DIGITS),
        "--epochs",
        "2",
    ]


def coordinator(url: str, world: int, run_dir: Path, *flags: str) -> list[str]:
    command = [*FLODL, "coordinator", "--listen", url, "--world-size", str(world)]
    return [*command, "--run-dir", str(run_dir), *flags]


def waiting_workers(url: str, env: dict[str, str], run_dir: Path) -> list[subprocess.Popen[str]]:
    """Two of three workers, started with no coordinator yet, once each says it keeps trying
    (after its imports, which take seconds on a busy machine)."""
    procs = [start(worker(url, rank, 3, run_dir), env) for rank in range(2)]
    try:
        for proc in procs:
            read_until(proc, f"no coordinator at {url} yet; trying again for up to 60 s")
    except BaseException:
        finish(procs)
        raise
    return procs


def finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    """Every process's output once it exited; any still running after 180 s is killed."""
    try:
        return [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def test_workers_started_before_the_coordinator_join_and_train(tmp_path: Path) -> None:
    env = dict(os.environ, FLODL_SESSION_KEY=secrets.token_hex(32))
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = [start(worker(url, rank, 2, tmp_path / "w"), env) for rank in range(2)]
    try:
        # Nothing listens: they say they keep trying rather than fail.
        for proc in procs:
            read_until(proc, f"no coordinator at {url} yet; trying again for up to 60 s")
        assert procs[0].poll() is None and procs[1].poll() is None
        procs.append(start(coordinator(url, 2, tmp_path / "c"), env))
    finally:
        outputs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert "flodl: run completed" in outputs[2]
    assert all("test accuracy" in out for out in outputs[:2])


@pytest.mark.parametrize("min_ranks", [2, 3])
def test_a_missing_worker_is_given_up_on_at_the_join_timeout(
    tmp_path: Path, min_ranks: int
) -> None:
    env = dict(os.environ, FLODL_SESSION_KEY=secrets.token_hex(32))
    url = f"tcp://127.0.0.1:{free_port()}"
    # The workers wait for the coordinator, so its join timeout counts once they are ready.
    workers = waiting_workers(url, env, tmp_path / "w")
    flags = ["--join-timeout", "8", "--min-ranks", str(min_ranks)]
    procs = [start(coordinator(url, 3, tmp_path / "c", *flags), env), *workers]
    outputs = finish(procs)  # rank 2 never starts
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    why = "ranks [2] did not join within the join timeout (8 s)"
    if min_ranks == 2:
        assert [p.returncode for p in procs] == [0, 0, 0], outputs
        assert summary["status"] == "completed"
        (going_on,) = [
            r for r in read_events(tmp_path / "c" / "events.jsonl") if r["kind"] == "GoingOnWithout"
        ]
        assert going_on["why"] == why and going_on["ranks"] == [0, 1]
        assert going_on["t"] >= 8.0
        assert f"{why}; going on with ranks [0, 1]" in outputs[0]
        assert all("test accuracy" in out for out in outputs[1:])
    else:
        assert procs[0].returncode == 1, outputs
        assert summary["status"] == "failed"
        assert summary["message"] == f"{why}; 2 joined, fewer than min_ranks 3"
        assert why in outputs[0]
        for out, proc in zip(outputs[1:], procs[1:], strict=True):
            assert proc.returncode != 0 and why in out  # each worker is told why
