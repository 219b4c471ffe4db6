"""Two hosts for real: the coordinator and rank 0 in one network namespace, ranks 1 and 2 in
another, joined by a veth pair with addresses from 198.51.100.0/24 (a documentation range).
Nothing reaches across on loopback, so every address a process hands out must be one its
peers can reach. Digits trains across them, and a SIGKILL of a rank on the far host is
recovered from. Needs root and ``ip`` (CI has both); skips otherwise."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl.checkpoint import find_latest, load_bundle
from flodl.observe.events import read_events
from tests.e2e.commands import rank_pids, read_until
from tests.worker.procs import digits_module

# own_warm_helper: the tests find a launcher's or agent's ranks among its descendants.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("own_warm_helper")]

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits.py"
NEAR, FAR = "198.51.100.1", "198.51.100.2"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str]]:
    """Two namespaces joined by a veth pair; every process in them is killed at the end."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2's `ip` to create network namespaces")
    tag = f"{os.getpid() % 100000}"
    near, far = f"flodl-a{tag}", f"flodl-b{tag}"
    try:
        ip("netns", "add", near)
    except subprocess.CalledProcessError as err:
        pytest.skip(f"cannot create a network namespace here: {err.stderr.decode().strip()}")
    try:
        ip("netns", "add", far)
        ip("link", "add", f"fa{tag}", "type", "veth", "peer", "name", f"fb{tag}")
        ip("link", "set", f"fa{tag}", "netns", near)
        ip("link", "set", f"fb{tag}", "netns", far)
        ip("-n", near, "addr", "add", f"{NEAR}/24", "dev", f"fa{tag}")
        ip("-n", far, "addr", "add", f"{FAR}/24", "dev", f"fb{tag}")
        for ns, dev in ((near, f"fa{tag}"), (far, f"fb{tag}")):
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", dev, "up")
        yield near, far
    finally:
        for ns in (near, far):
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
            ).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def end_all(procs: list[subprocess.Popen[str]]) -> None:
    """Kill what still runs of ``procs`` and reap every one."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def report_of(run_dir: Path, rank: int) -> dict[str, Any]:
    """What rank ``rank``'s last process wrote in ``run_dir/rank<N>.json``."""
    report: dict[str, Any] = json.loads((run_dir / f"rank{rank}.json").read_text())
    return report


def in_ns(ns: str, *command: str, env: dict[str, str]) -> subprocess.Popen[str]:
    # `ip netns exec` execs the command, so the Popen's pid is the process itself.
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_digits_trains_across_two_hosts_and_survives_a_far_sigkill(
    two_hosts: tuple[str, str], tmp_path: Path
) -> None:
    near, far = two_hosts
    env = dict(os.environ, FLODL_SESSION_KEY=secrets.token_hex(32), PYTHONUNBUFFERED="1")
    flodl = [sys.executable, "-m", "flodl.cli"]
    url = f"tcp://{NEAR}:29400"
    procs: list[subprocess.Popen[str]] = []
    try:
        coordinator = in_ns(
            near,
            *flodl,
            "coordinator",
            "--listen",
            url,
            "--world-size",
            "3",
            "--run-dir",
            str(tmp_path / "coordinator"),
            "--heartbeat-timeout",
            "5",
            env=env,
        )
        procs.append(coordinator)
        assert coordinator.stdout is not None
        assert url in coordinator.stdout.readline()
        for rank, ns in ((0, near), (1, far), (2, far)):
            worker = [*flodl, "worker", "--coordinator", url, "--rank", str(rank)]
            worker += ["--world-size", "3", "--heartbeat-timeout", "5"]
            worker += ["--run-dir", str(tmp_path / ns), str(DIGITS), "--epochs", "4"]
            procs.append(in_ns(ns, *worker, env=env))
        doomed = procs[3]
        assert doomed.stdout is not None
        seen = []
        for line in doomed.stdout:  # rank 2, on the far host, trains into its second epoch
            seen.append(line)
            if "epoch 1 started" in line:
                break
        else:
            pytest.fail("rank 2 never reached epoch 1:\n" + "".join(seen))
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=10)
        outputs = [p.communicate(timeout=180)[0] for p in procs[1:3]]
        rest, _ = coordinator.communicate(timeout=60)
    finally:
        end_all(procs)
    assert [procs[1].returncode, procs[2].returncode, coordinator.returncode] == [0, 0, 0], (
        outputs,
        rest,
    )
    assert doomed.returncode == -signal.SIGKILL
    assert "flodl: run completed" in rest
    accuracies = {re.search(r"test accuracy (\d\.\d+)", out).group(1) for out in outputs}  # type: ignore[union-attr]
    assert len(accuracies) == 1  # the survivors, one model
    assert float(accuracies.pop()) > 0.85
    records = read_events(tmp_path / "coordinator" / "events.jsonl")
    (dead,) = [r for r in records if r["kind"] == "RankDead"]
    assert dead["rank"] == 2 and dead["cause"] == "disconnected"
    (reformed,) = [r for r in records if r["kind"] == "GroupReformed"]
    assert reformed["members"] == [0, 1] and reformed["took_s"] < 5.0
    after = [r for r in records if r["kind"] == "SyncEnd" and r["generation"] == 1]
    assert after and all(list(r["ranks"]) == ["0", "1"] for r in after)


def test_one_agent_per_host_restarts_a_far_rank_and_a_far_agent_takes_its_ranks(
    two_hosts: tuple[str, str], tmp_path: Path
) -> None:
    """2 hosts x 2 ranks, one agent each, started before the coordinator (on host A). A rank
    killed on host B is restarted by B's agent and rejoins; then B's agent is killed: its
    ranks save their bundles and go, and A's ranks train on, to one model that classifies."""
    near, far = two_hosts
    env = dict(os.environ, FLODL_SESSION_KEY=secrets.token_hex(32), PYTHONUNBUFFERED="1")
    flodl = [sys.executable, "-m", "flodl.cli"]
    url = f"tcp://{NEAR}:29400"
    # Endless epochs: the run lasts until the test has seen every step, however slow the
    # machine (a loaded CI run finished 100 epochs before the restarted rank was back).
    script = [str(DIGITS), "--epochs", "100000"]
    procs: list[subprocess.Popen[str]] = []
    try:
        for node, ns in ((0, near), (1, far)):
            command = [*flodl, "agent", "--coordinator", url, "--node-rank", str(node)]
            command += ["--nproc", "2", "--restarts", "1", "--run-dir", str(tmp_path / ns)]
            procs.append(in_ns(ns, *command, *script, env=env))
        coordinator = [*flodl, "coordinator", "--listen", url, "--world-size", "4"]
        coordinator += ["--run-dir", str(tmp_path / "coordinator"), "--heartbeat-timeout", "5"]
        procs.append(in_ns(near, *coordinator, env=env))
        agent_a, agent_b, coord = procs
        read_until(agent_b, "rank 3: epoch 1 started")
        # B's ranks, 2 and 3, were started in that order; kill the second.
        victim_rank, victim = 3, rank_pids(agent_b.pid)[1]
        os.kill(victim, signal.SIGKILL)
        # Its agent reaps it, starts it again, and the new process rejoins the running group
        # and trains (so that it has a bundle to save when its agent dies below).
        read_until(coord, f"rank {victim_rank} rejoined")
        read_until(agent_b, f"rank {victim_rank}: epoch")
        read_until(agent_b, "epoch")
        orphans = rank_pids(agent_b.pid)
        assert len(orphans) == 2 and victim not in orphans
        agent_b.kill()
        read_until(coord, "ranks [0, 1]")  # the group re-formed without host B
        coord.send_signal(signal.SIGTERM)  # A's ranks average once more, save and stop
        out_a, _ = agent_a.communicate(timeout=180)
        rest, _ = coord.communicate(timeout=60)
    finally:
        end_all(procs)
    assert agent_a.returncode == 0 and coord.returncode == 0, out_a + rest
    records = read_events(tmp_path / "coordinator" / "events.jsonl")
    joined = [r["rank"] for r in records if r["kind"] == "RankJoined"]
    assert sorted(joined[:4]) == [0, 1, 2, 3] and len(joined) >= 5  # and the restarted rank
    dead = {r["rank"] for r in records if r["kind"] == "RankDead"}
    assert dead == {2, 3}, records
    reformed = [r for r in records if r["kind"] == "GroupReformed"][-1]
    assert reformed["members"] == [0, 1]
    after = [r for r in records if r["kind"] == "SyncEnd" and r["seq"] > reformed["seq"]]
    assert after and all(list(r["ranks"]) == ["0", "1"] for r in after), records
    # B's ranks saved what they trained when their agent went: the one never killed for sure;
    # the restarted one if it had trained a batch since it came back (under load it can still
    # be waiting for its first window when the agent dies, and then it has nothing to keep).
    saved = {p.parent.name for p in (tmp_path / far / "checkpoints").rglob("*.model.safetensors")}
    trained = {f"rank{r}" for r in (2, 3) if report_of(tmp_path / far, r)["batches"] > 0}
    assert f"rank{5 - victim_rank}" in trained and saved == trained, (saved, trained)
    # A's two ranks saved one model on the stop, and it classifies.
    digits = digits_module()
    _, _, x_test, y_test = digits.load_data(0)
    states = []
    for rank in (0, 1):
        latest = find_latest(tmp_path / near / "checkpoints" / f"rank{rank}")
        assert latest is not None, rank
        states.append(load_bundle(latest).model_state)
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    model = digits.build_model(64, 0)
    model.load_state_dict(states[0])
    assert digits.accuracy(model, x_test, y_test) > 0.85
