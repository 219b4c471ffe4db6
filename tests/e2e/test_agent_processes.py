"""`flodl coordinator` + one `flodl agent` per host, run here on one host (127.0.0.1).

The agents start before the coordinator, run different numbers of ranks, restart a rank that
is killed, and take their ranks with them when they are killed themselves.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import signal
import subprocess
from pathlib import Path

import pytest

from flodl.observe.events import read_events
from tests.e2e.commands import DIGITS, FLODL, free_port, rank_pids, read_until

# own_warm_helper: the tests find a launcher's or agent's ranks among its descendants.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("own_warm_helper")]


def agent(url: str, node: int, nproc: int, run_dir: Path, *flags: str) -> list[str]:
    return [
        *FLODL,
        "agent",
        "--coordinator",
        url,
        "--node-rank",
        str(node),
        "--nproc",
        str(nproc),
        "--run-dir",
        str(run_dir),
        "--join-timeout",
        "60",
        *flags,
    ]


def coordinator(url: str, world: int, run_dir: Path, *flags: str) -> list[str]:
    return [
        *FLODL,
        "coordinator",
        "--listen",
        url,
        "--world-size",
        str(world),
        "--run-dir",
        str(run_dir),
        *flags,
    ]


class Job:
    """The processes of one run; every one is gone when the test ends."""

    def __init__(self, tmp_path: Path) -> None:
        self.env = dict(os.environ, FLODL_SESSION_KEY=secrets.token_hex(32))
        self.url = f"tcp://127.0.0.1:{free_port()}"
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[str]] = []
        self.outputs: dict[int, str] = {}

    def start(self, command: list[str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.procs.append(proc)
        return proc

    def read_until(self, proc: subprocess.Popen[str], needle: str) -> str:
        """``proc``'s output up to the line holding ``needle`` (kept for :meth:`finish`)."""
        text = read_until(proc, needle)
        self.outputs[proc.pid] = self.outputs.get(proc.pid, "") + text
        return text

    def finish(self) -> list[str]:
        """Every process's whole output once it exited (killed after 180 s)."""
        try:
            for proc in self.procs:
                rest, _ = proc.communicate(timeout=180)
                self.outputs[proc.pid] = self.outputs.get(proc.pid, "") + rest
        finally:
            self.kill_all()
        return [self.outputs[proc.pid] for proc in self.procs]

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def accuracies(*outputs: str) -> list[float]:
    return [float(a) for out in outputs for a in re.findall(r"test accuracy (\d\.\d+)", out)]


def test_agents_started_before_the_coordinator_run_hosts_of_unequal_size(tmp_path: Path) -> None:
    job = Job(tmp_path)
    try:
        # Four epochs: after two a loaded machine drew 0.830, the windows being timing-bound.
        job.start([*agent(job.url, 1, 1, tmp_path / "host1"), str(DIGITS), "--epochs", "4"])
        job.start([*agent(job.url, 0, 2, tmp_path / "host0"), str(DIGITS), "--epochs", "4"])
        job.start(coordinator(job.url, 3, tmp_path / "coordinator"))
        host1, host0, coord = job.finish()
    finally:
        job.kill_all()
    assert [p.returncode for p in job.procs] == [0, 0, 0], (host1, host0, coord)
    assert "node 1 runs ranks 2-2 of 3" in host1
    assert "node 0 runs ranks 0-1 of 3" in host0
    assert "flodl: run completed" in coord
    found = accuracies(host0, host1)
    assert len(found) == 3 and len(set(found)) == 1 and found[0] > 0.85  # one model
    assert (tmp_path / "host1" / "rank2.log").exists()
    assert sorted(p.name for p in (tmp_path / "host0").glob("rank?.log")) == [
        "rank0.log",
        "rank1.log",
    ]


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_a_failed_rank_on_one_host_is_restarted_by_its_agent_and_rejoins(
    tmp_path: Path, fault: signal.Signals
) -> None:
    # A killed rank's exit reaches the coordinator at once. A paused one never exits on its
    # own: silent past the heartbeat timeout, it is declared dead, the coordinator tells its
    # agent (KillRank) and the agent kills it. Either way the agent restarts it.
    job = Job(tmp_path)
    flags = ("--heartbeat-timeout", "2") if fault is signal.SIGSTOP else ()
    try:
        coordinator_process = job.start(coordinator(job.url, 3, tmp_path / "coordinator", *flags))
        # Endless epochs: the run lasts until the rejoin was seen, however slow the machine.
        script = [str(DIGITS), "--epochs", "100000"]
        job.start([*agent(job.url, 0, 2, tmp_path / "host0"), *script])
        host1 = job.start([*agent(job.url, 1, 1, tmp_path / "host1", "--restarts", "1"), *script])
        job.read_until(host1, "rank 2: epoch 1 started")
        (victim,) = rank_pids(host1.pid)
        os.kill(victim, fault)
        job.read_until(coordinator_process, "rank 2 rejoined")
        coordinator_process.send_signal(signal.SIGTERM)  # every rank saves and stops
        coord, _, host1_out = job.finish()
    finally:
        job.kill_all()
    assert "rank 2: SIGKILL SIGKILL" not in host1_out, host1_out + coord
    assert re.search(r"exits: rank 2: SIGKILL 0; restarts: 1", host1_out), host1_out + coord
    assert coordinator_process.returncode == 0, coord
    records = read_events(tmp_path / "coordinator" / "events.jsonl")
    deaths = [r for r in records if r["kind"] == "RankDead" and r.get("rank") == 2]
    assert len(deaths) == 1, deaths
    assert (deaths[0]["cause"] == "silent") is (fault is signal.SIGSTOP), deaths
    # Each rank saved its bundle on the stop, the restarted one included.
    for host, rank in (("host0", 0), ("host0", 1), ("host1", 2)):
        saved = list((tmp_path / host / "checkpoints" / f"rank{rank}").glob("*.model.safetensors"))
        assert saved, (host, rank)


def test_a_killed_agent_takes_its_ranks_and_the_other_host_trains_on(tmp_path: Path) -> None:
    job = Job(tmp_path)
    try:
        job.start(coordinator(job.url, 3, tmp_path / "coordinator"))
        script = [str(DIGITS), "--epochs", "6"]
        host0 = job.start([*agent(job.url, 0, 2, tmp_path / "host0"), *script])
        host1 = job.start([*agent(job.url, 1, 1, tmp_path / "host1"), *script])
        job.read_until(host1, "rank 2: epoch 1 started")
        (orphan,) = rank_pids(host1.pid)
        watch = os.pidfd_open(orphan)
        host1.kill()
        try:  # the orphan saves and exits on its own: nothing else ends it
            exited, _, _ = select.select([watch], [], [], 60)
        finally:
            os.close(watch)
        assert exited, "the orphaned rank outlived its agent by a minute"
        coord, host0_out, _ = job.finish()
    finally:
        job.kill_all()
    assert host0.returncode == 0, host0_out
    assert len(accuracies(host0_out)) == 2  # node 0's ranks trained every epoch
    # The closing line says which ranks the run lost, and how.
    assert "flodl: run completed with ranks [0, 1] of 3; rank 2 lost (disconnected: " in coord
    assert "node 1's agent is gone" in coord
    # The orphan saved its own bundle before it exited.
    assert list((tmp_path / "host1" / "checkpoints").rglob("*.model.safetensors")), list(
        (tmp_path / "host1").rglob("*")
    )


def test_flodl_run_with_nnodes_serves_the_coordinator_on_node_0(tmp_path: Path) -> None:
    """torchrun's shape: the same command on every host but --node-rank; node 1 starts first."""
    job = Job(tmp_path)
    address = job.url.removeprefix("tcp://")

    def node(rank: int) -> list[str]:
        return [
            *FLODL,
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--coordinator",
            address,
            "--nproc",
            "1",
            "--run-dir",
            str(tmp_path / f"node{rank}"),
            "--no-live",
            str(DIGITS),
            "--epochs",
            "2",
        ]

    try:
        job.start(node(1))
        job.start(node(0))
        node1, node0 = job.finish()
    finally:
        job.kill_all()
    assert [p.returncode for p in job.procs] == [0, 0], (node1, node0)
    assert "flodl: run completed (all epochs done)" in node0  # node 0 speaks for the run
    assert "node 1 runs ranks 1-1 of 2" in node1
    assert "node 0 runs ranks 0-0 of 2" in node0
    found = accuracies(node0, node1)
    assert len(found) == 2 and len(set(found)) == 1 and found[0] > 0.85
    summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["root_cause"] is None
    assert (tmp_path / "node0" / "events.jsonl").exists()
