"""The digits demo on real rank processes with real gloo groups.

* every policy runs to completion (through ``flodl run``'s launcher), parameters bitwise
  identical on all ranks after every average (Sync, Cadence), accuracy >= 95% (Cadence);
* a frozen coordinator (SIGSTOP: the connection stays open, nothing arrives) makes every rank
  write its death record and exit with status 1 instead of hanging;
* after a rank is SIGKILLed the survivors re-form the group and finish the run.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from flodl.config import CoordinatorConfig
from flodl.coordinator.server import open_coordinator
from flodl.core.common.policy import Policy
from flodl.core.coordinator.machine import Status
from flodl.core.coordinator.timeline import EventKind, TimelineEvent
from flodl.launch.config import LaunchConfig
from flodl.launch.launcher import launch
from tests.worker.procs import DIGITS, ROOT, digits_ranks, read_until, spawn

pytestmark = pytest.mark.slow


def report(run_dir: Path, rank: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run_dir / f"rank{rank}.json").read_text())
    return data


def hashes_by_round(data: dict[str, Any]) -> dict[int, str]:
    return {int(h["round"]): str(h["sha256"]) for h in data["param_hashes"]}


async def run_digits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: Policy, nproc: int, *args: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    monkeypatch.setenv("FLODL_DEBUG_PARAM_HASHES", "1")
    run_dir = tmp_path / "run"
    config = LaunchConfig(
        script=str(DIGITS),
        script_args=args,
        nproc=nproc,
        backend="gloo",
        run_dir=run_dir,
        coordinator=CoordinatorConfig(policy=policy, heartbeat_timeout=5, heartbeat_interval=0.5),
        echo=False,
        exit_grace=20,
    )
    with trio.fail_after(150):
        summary = await launch(config)
    logs = "\n".join((run_dir / f"rank{r}.log").read_text() for r in range(nproc))
    assert summary["status"] == "completed", logs
    assert [r["exit_code"] for r in summary["ranks"]] == [0] * nproc, logs
    return summary, [report(run_dir, r) for r in range(nproc)]


async def test_cadence_three_unequal_ranks_reach_93_percent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary, reports = await run_digits(
        tmp_path, monkeypatch, Policy.CADENCE, 3, "--epochs", "8", "--slow", "2:3"
    )
    for data in reports:
        assert data["exit_reason"] == "completed", data
        # Typically 0.97-0.98; the test split holds 359 digits, so a few of them swing a run
        # by a point (windows follow measured speeds, which load changes).
        assert data["final_metrics"]["test_accuracy"] >= 0.93, (data, summary["epochs"])
        assert data["steps"] == data["batches"] + data["syncs"], data
    # After every round the three ranks hold bitwise-identical parameters.
    rounds = [hashes_by_round(data) for data in reports]
    assert len(rounds[0]) == summary["rounds"] >= 3, summary
    assert rounds[0] == rounds[1] == rounds[2]
    # ElChe gave the rank that is three times slower fewer batches than the fast ones.
    batches = [data["batches"] for data in reports]
    assert batches[2] < batches[0] and batches[2] < batches[1], summary["batch_counts"]
    assert sum(batches) == 8 * -(-1438 // 16)  # every one of the 1438 samples, the last batch short


@pytest.mark.parametrize("policy", [Policy.SYNC, Policy.ASYNC])
async def test_sync_and_async_runs_complete(
    policy: Policy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 4 epochs: after 2 the model is still learning fast, a few points from the 0.8 floor.
    summary, reports = await run_digits(tmp_path, monkeypatch, policy, 2, "--epochs", "4")
    for data in reports:
        assert data["syncs"] >= 1
        assert data["final_metrics"]["test_accuracy"] >= 0.8
    if policy is Policy.SYNC:
        # One average per batch window: every rank acked every round, identical after each.
        assert hashes_by_round(reports[0]) == hashes_by_round(reports[1])
        assert reports[0]["syncs"] == reports[1]["syncs"] == summary["rounds"]


async def test_ranks_give_up_on_a_frozen_coordinator(tmp_path: Path) -> None:
    key = secrets.token_bytes(32)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    coordinator_env = {**os.environ, "PYTHONPATH": str(ROOT), "FLODL_SESSION_KEY": key.hex()}
    coordinator_argv = [sys.executable, "-m", "tests.worker.coordinator_process", "2", "cadence"]
    async with spawn([([*coordinator_argv, "3"], coordinator_env, None)]) as (coordinator,):
        line = bytearray()
        with trio.fail_after(30):
            await read_until(coordinator, b"\n", line)
        url = line.decode().split()[1]
        args = ["--epochs", "500", "--slow", "1:2"]
        ranks = digits_ranks(2, url, key, run_dir, args, piped=0, heartbeat_timeout=3.0)
        async with spawn(ranks) as processes:
            output = bytearray()
            with trio.fail_after(60):
                await read_until(processes[0], b"epoch 0 started", output)
            os.kill(coordinator.pid, signal.SIGSTOP)  # alive, connected, and silent
            frozen_at = trio.current_time()
            with trio.fail_after(40):
                for process in processes:
                    await process.wait()
            waited = trio.current_time() - frozen_at
            with trio.fail_after(10):
                await read_until(processes[0], b"silent for 3 s", output)
    assert [p.returncode for p in processes] == [1, 1]
    assert 2.0 <= waited < 30.0
    for rank in range(2):
        record = json.loads((run_dir / f"flodl.rank{rank}.death.json").read_text())
        assert record["rank"] == rank and record["world_size"] == 2
        assert "silent for 3 s" in record["error"]
        assert record["unix_time_secs"] > 0
        assert report(run_dir, rank)["exit_reason"].startswith("coordinator_lost")


async def test_survivors_of_a_sigkilled_rank_reform_and_finish(tmp_path: Path) -> None:
    key = secrets.token_bytes(32)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = CoordinatorConfig(policy=Policy.CADENCE, heartbeat_timeout=5, heartbeat_interval=0.5)
    async with open_coordinator("tcp://127.0.0.1:0", 3, key, config, linger=20) as coord:
        ranks = digits_ranks(3, coord.url, key, run_dir, ["--epochs", "6"], piped=2)
        async with spawn(ranks) as processes:
            output = bytearray()
            with trio.fail_after(60):
                await read_until(processes[2], b"epoch 1 started", output)
            processes[2].send_signal(signal.SIGKILL)
            with trio.fail_after(90):
                outcome = await coord.wait_finished()
                for process in processes:
                    await process.wait()
    logs = "\n".join((run_dir / f"rank{r}.log").read_text() for r in range(2))
    assert outcome.status is Status.COMPLETED, (outcome, logs)
    assert [p.returncode for p in processes] == [0, 0, -signal.SIGKILL], logs
    reformed = coord.timeline.of_kind(EventKind.GROUP_REFORMED)
    assert [e.detail["members"] for e in reformed] == [[0, 1]]
    survivors = [report(run_dir, r) for r in range(2)]
    generations = {int(h["generation"]) for h in survivors[0]["param_hashes"]}
    assert generations == {0, reformed[0].detail["generation"]}
    # The round the kill interrupted can end apart: gloo finished it on one survivor (the
    # dead rank's last piece reached it) and failed it on the other (a CI run had rank 1
    # with round 3 and rank 0 without). Every other round is the same bytes on both.
    rounds = [hashes_by_round(data) for data in survivors]
    split = set(rounds[0]) ^ set(rounds[1])
    assert len(split) <= 1, rounds
    last_before_reform = max(
        int(h["round"]) for data in survivors for h in data["param_hashes"] if h["generation"] == 0
    )
    assert split <= {last_before_reform}, rounds
    redone = {e.detail.get("redoes") for e in coord.timeline.of_kind(EventKind.SYNC_START)}
    assert split <= redone, (split, redone)  # and the coordinator redid it on both
    assert {r: h for r, h in rounds[0].items() if r not in split} == {
        r: h for r, h in rounds[1].items() if r not in split
    }
    for data in survivors:
        assert data["exit_reason"] == "completed"
        # 6 epochs: 0.95-0.98 in six runs here; after 3, unkilled runs drew 0.90-0.96 and a
        # loaded CI run 0.866, the model still learning fast.
        assert data["final_metrics"]["test_accuracy"] >= 0.9
    assert not (run_dir / "rank2.json").exists()  # SIGKILL: no report, no goodbye


async def test_a_rank_paused_past_the_timeout_is_let_go_and_ends_when_it_wakes(
    tmp_path: Path,
) -> None:
    key = secrets.token_bytes(32)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = CoordinatorConfig(policy=Policy.CADENCE, heartbeat_timeout=2, heartbeat_interval=0.5)
    reformed = trio.Event()

    def on_event(seq: int, event: TimelineEvent) -> None:
        if event.kind is EventKind.GROUP_REFORMED:
            reformed.set()

    async with open_coordinator("tcp://127.0.0.1:0", 3, key, config, linger=20) as coord:
        coord.add_event_sink(on_event)
        args = ["--epochs", "6"]
        ranks = digits_ranks(3, coord.url, key, run_dir, args, piped=2, heartbeat_timeout=2)
        async with spawn(ranks) as processes:
            output = bytearray()
            with trio.fail_after(60):
                await read_until(processes[2], b"epoch 1 started", output)
            processes[2].send_signal(signal.SIGSTOP)  # alive and connected, but silent
            with trio.fail_after(30):
                await reformed.wait()  # declared dead, and the others went on without it
            processes[2].send_signal(signal.SIGCONT)
            with trio.fail_after(30):
                await processes[2].wait()  # it wakes up let go: it ends, the run goes on
            with trio.fail_after(90):
                outcome = await coord.wait_finished()
                for process in processes[:2]:
                    await process.wait()
            output += await processes[2].stdout.receive_some(1 << 20)  # type: ignore[union-attr]
    logs = "\n".join((run_dir / f"rank{r}.log").read_text() for r in range(2))
    assert outcome.status is Status.COMPLETED, (outcome, logs)
    assert [p.returncode for p in processes] == [0, 0, 1], output.decode(errors="replace")
    (dead,) = coord.timeline.of_kind(EventKind.RANK_DEAD)
    assert (dead.detail["rank"], dead.detail["cause"]) == (2, "silent")
    members = [e.detail["members"] for e in coord.timeline.of_kind(EventKind.GROUP_REFORMED)]
    assert members == [[0, 1]]
    # Awake, it reads the coordinator's Abort, or its own watchdog (its clock ran on while it
    # was paused) gives up on the coordinator first: either way it ends, and never reports
    # the model it kept outside the group as the run's result.
    paused = report(run_dir, 2)["exit_reason"]
    assert paused.startswith(("aborted", "coordinator_lost")), paused
    assert all(report(run_dir, r)["exit_reason"] == "completed" for r in range(2))
