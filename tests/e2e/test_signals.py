"""Signals belong to the launcher: Ctrl-C (to the whole process group, as a terminal sends it),
SIGINT or SIGTERM to the launcher alone, all save every rank's bundle and exit 0; a second
Ctrl-C kills the ranks and the summary names what was not saved. No process is left."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl.checkpoint import load_bundle
from tests.e2e.commands import rank_pids, short_collectives_env, wait_exits
from tests.worker.procs import DIGITS, live_in_groups

# own_warm_helper: the tests find a launcher's or agent's ranks among its descendants.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("own_warm_helper")]

# Rank 1 stops in the middle of a batch (its training thread asleep, its heartbeats going on),
# so a save-and-stop waits on it until it is killed.
STUCK_RANK = """\
import sys, time
import torch
import flodl.worker
from flodl.errors import ShutdownRequested

torch.set_num_threads(1)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
with flodl.worker.join(model, optimizer) as rank:
    try:
        for i, batch in enumerate(rank.batches(dataset_size=4096, batch_size=8, epochs=50)):
            if rank.rank == 1 and i == 200:
                print("stuck", flush=True)
                time.sleep(120)
            loss = model(torch.ones(8, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            batch.done(loss)
    except ShutdownRequested as stop:
        print(f"flodl: {stop}", flush=True)
"""


class Launcher:
    """``flodl run`` in a session of its own, so the test can signal its whole process group
    as a terminal would without signalling pytest. Killed (group and all) after ``limit`` s."""

    def __init__(
        self,
        run_dir: Path,
        nproc: int,
        script: Path,
        *args: str,
        limit: float = 120,
        env: dict[str, str] | None = None,
        flags: Sequence[str] = (),
    ):
        argv = [sys.executable, "-m", "flodl.cli", "run", "--nproc", str(nproc), *flags]
        argv += ["--run-dir", str(run_dir), str(script), *args]
        if "--resume" in args:
            raise AssertionError("pass --resume with resume()")
        self.run_dir = run_dir
        self.process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=env,
        )
        self.lines: list[str] = []
        self._watchdog = threading.Timer(limit, self._kill)
        self._watchdog.start()

    def _kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def read_until(self, needle: str) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            if needle in line:
                return
        raise AssertionError(f"{needle!r} never printed:\n{self.output}")

    def finish(self) -> int:
        rest, _ = self.process.communicate()
        self.lines.append(rest)
        self._watchdog.cancel()
        return self.process.returncode

    def children(self) -> list[int]:
        """The launcher's rank processes (its children, or its warm-start helper's)."""
        return rank_pids(self.process.pid)

    def wait_for_children(self, count: int) -> None:
        """Return once at most ``count`` of the launcher's ranks of now still run."""
        wait_exits(self.children(), limit=30, leaving=count)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def summary(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.run_dir / "summary.json").read_text())
        return data

    def assert_no_process_left(self) -> None:
        """The launcher's group and every rank's own group (children included) are gone."""
        groups = [self.process.pid] + [r["pid"] for r in self.summary()["ranks"]]
        for pgid in groups:
            with pytest.raises(ProcessLookupError):
                os.killpg(pgid, 0)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flodl.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_saved_by_every_rank(launcher: Launcher, nproc: int, signal_name: str) -> None:
    rc = launcher.finish()
    summary = launcher.summary()
    assert rc == 0, launcher.output
    assert (summary["status"], summary["save_reason"]) == ("saved", "GRACEFUL"), launcher.output
    assert summary["signals"] == [signal_name]
    assert summary["saved"] == {"ranks": list(range(nproc)), "missing": []}
    for rank in summary["ranks"]:
        assert rank["exit_code"] == 0, launcher.output
        assert rank["exit_reason"] == "shutdown_with_save:GRACEFUL"
        assert Path(rank["bundle"] + ".meta.json").is_file()
    assert f"flodl: {signal_name}: every rank saves its bundle, then stops" in launcher.output
    assert "KeyboardInterrupt" not in launcher.output
    assert "flodl: run saved (saved: GRACEFUL)" in launcher.output
    # The event log ends as a completed run's does: each rank's report, then Shutdown.
    events = [
        json.loads(line) for line in (launcher.run_dir / "events.jsonl").read_text().splitlines()
    ]
    after_save = events[[e["kind"] for e in events].index("SaveRequested") + 1 :]
    reports = {e["rank"]: e["path"] for e in after_save if e["kind"] == "CheckpointSaved"}
    assert reports == {rank["rank"]: rank["bundle"] for rank in summary["ranks"]}
    ranks = ", ".join(map(str, range(nproc)))
    assert after_save[-1]["kind"] == "Shutdown"
    assert after_save[-1]["why"].endswith(f"ranks {ranks} saved"), after_save[-1]
    # Every rank was alive: a last round averaged the window in progress, so every bundle holds
    # the same model, bit for bit.
    states = [load_bundle(rank["bundle"]).model_state for rank in summary["ranks"]]
    assert all(state.keys() == states[0].keys() for state in states)
    assert all(torch.equal(state[k], states[0][k]) for state in states for k in state)
    launcher.assert_no_process_left()


def test_ctrl_c_to_the_whole_group_saves_and_resumes_with_other_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = Launcher(run_dir, 3, DIGITS, "--epochs", "8")
    first.read_until("epoch 2 started")
    os.killpg(first.process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    assert_saved_by_every_rank(first, 3, "SIGINT")
    saved_step = first.summary()["global_step"]

    resumed = run_cli(
        *("--nproc", "2", "--run-dir", str(run_dir), "--resume", str(run_dir)),
        *(str(DIGITS), "--epochs", "8"),
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"]
    assert summary["global_step"] > saved_step
    # It went on from the saved weights: its first epoch's loss is where the stopped run had
    # got to, not a fresh start's (1.1). The final accuracy only says it trained on: on 359
    # test digits at Adam's lr 0.01 it spreads widely (0.90 - 0.98 for resumed runs), against
    # 0.1 for an untrained model.
    first = summary["epochs"][0]
    assert first["epoch"] >= 2 and first["avg_loss"] < 0.5, summary["epochs"]
    assert summary["final_metrics"]["test_accuracy"] >= 0.85, summary["epochs"]
    # Each log holds one run: the first run's are set aside, the resumed run's are fresh. (The
    # resumed run may start at epoch 0 again: a rank prints "epoch 2 started" as soon as it is
    # handed work of epoch 2, which the idle fill can do before epoch 0 is done.)
    for rank in range(2):
        first_log = (run_dir / f"rank{rank}.1.log").read_text()
        fresh = (run_dir / f"rank{rank}.log").read_text()
        assert "epoch 0 started" in first_log and "test accuracy" not in first_log
        assert not fresh.startswith(first_log) and "test accuracy" in fresh
        assert fresh.count("test accuracy") == 1
    assert (run_dir / "rank2.1.log").exists() and not (run_dir / "rank2.log").exists()
    assert (run_dir / "events.1.jsonl").exists() and (run_dir / "events.jsonl").exists()


def readme_example(path: Path) -> Path:
    """The README's example, with more epochs than the test lets it train and a line printed at
    each average (so the test knows the group trains)."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    code = re.search(r"## Example\n\n```python\n(.*?)```", readme, re.S)
    assert code is not None, "README.md has no example"
    loop = "    for batch in rank.batches(dataset_size=len(X), batch_size=32, epochs=5):\n"
    assert loop in code.group(1), "the README's loop changed: update this test"
    said = '        if batch.averaged:\n            print("averaged", flush=True)\n'
    path.write_text(code.group(1).replace(loop, loop.replace("5", "500") + said))
    return path


def test_ctrl_c_to_the_readme_example_saves_and_exits_0_without_a_traceback(
    tmp_path: Path,
) -> None:
    """The README's script catches nothing: a stop it was asked for still ends each rank with
    status 0, no traceback, and a line that says the rank saved."""
    launcher = Launcher(tmp_path / "run", 2, readme_example(tmp_path / "train.py"))
    launcher.read_until("[rank 1] averaged")
    os.killpg(launcher.process.pid, signal.SIGINT)
    assert_saved_by_every_rank(launcher, 2, "SIGINT")
    assert "Traceback" not in launcher.output
    for rank in range(2):
        said = f"[rank {rank}] flodl: rank {rank}: coordinator asked to save and stop: GRACEFUL"
        assert said in launcher.output


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_launcher_alone_saves(tmp_path: Path, signum: signal.Signals) -> None:
    launcher = Launcher(tmp_path / "run", 2, DIGITS, "--epochs", "8")
    launcher.read_until("epoch 1 started")
    os.kill(launcher.process.pid, signum)
    assert_saved_by_every_rank(launcher, 2, signum.name)


def test_ctrl_z_does_not_pause_the_launcher_and_the_run_completes(tmp_path: Path) -> None:
    """A terminal's Ctrl-Z (SIGTSTP to the launcher's group; the ranks run in sessions of their
    own) would leave the ranks training under a stopped coordinator until they give up on it:
    the launcher declines it, says why, and the run goes on to the end."""
    launcher = Launcher(tmp_path / "run", 2, DIGITS, "--epochs", "4")
    launcher.read_until("epoch 1 started")
    os.killpg(launcher.process.pid, signal.SIGTSTP)
    launcher.read_until("flodl: Ctrl-Z (SIGTSTP) ignored")
    assert launcher.finish() == 0, launcher.output
    summary = launcher.summary()
    assert summary["status"] == "completed" and summary["lost_ranks"] == [], launcher.output
    assert summary["signals"] == []
    launcher.assert_no_process_left()


def test_a_launcher_paused_past_the_heartbeat_timeout_names_the_pause_and_the_saves(
    tmp_path: Path,
) -> None:
    """SIGSTOP to the launcher (what Ctrl-Z would do, or a suspended machine): the ranks give
    up on their silent coordinator and each saves its own bundle. Once the launcher runs again,
    its summary counts those bundles and names the pause as the root cause, not a rank."""
    timeout = ["--heartbeat-timeout", "3"]
    launcher = Launcher(tmp_path / "run", 2, DIGITS, "--epochs", "50", flags=timeout)
    launcher.read_until("epoch 1 started")
    ranks = launcher.children()
    os.kill(launcher.process.pid, signal.SIGSTOP)
    try:
        wait_exits(ranks, limit=60)  # each gave up on the coordinator, saved, and exited
    finally:
        os.kill(launcher.process.pid, signal.SIGCONT)
    assert launcher.finish() == 1, launcher.output  # the run did not do its work
    summary = launcher.summary()
    assert summary["status"] == "saved", launcher.output
    assert summary["saved"] == {"ranks": [0, 1], "missing": []}
    for rank in summary["ranks"]:
        assert rank["exit_reason"].startswith("coordinator_lost"), rank
        assert rank["bundle"].endswith("-lost") and Path(rank["bundle"] + ".meta.json").is_file()
    cause = summary["root_cause"]
    assert (cause["rank"], cause["kind"]) == (None, "coordinator"), cause
    assert cause["error"].startswith("the coordinator did not run for "), cause
    assert "the ranks gave up on it" in launcher.output  # the pause's line, as it was noticed
    assert "(ranks 0, 1 on losing the coordinator)" in launcher.output
    # The ranks lost first (one or both, as the coordinator noticed them on waking) are named
    # for what they did, not for their long CoordinatorError.
    assert " gave up on its coordinator at " in launcher.output
    launcher.assert_no_process_left()


@pytest.mark.long
def test_a_second_ctrl_c_kills_and_the_summary_says_what_was_not_saved(tmp_path: Path) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_RANK)
    launcher = Launcher(tmp_path / "run", 2, script)
    launcher.read_until("[rank 1] stuck")
    os.killpg(launcher.process.pid, signal.SIGINT)
    launcher.read_until("[rank 0] flodl: coordinator asked to save and stop")
    launcher.wait_for_children(1)  # rank 0 has exited; rank 1 is still asleep
    os.killpg(launcher.process.pid, signal.SIGINT)
    rc = launcher.finish()
    summary = launcher.summary()
    assert rc == 1, launcher.output
    assert summary["status"] == "partially_saved", launcher.output
    assert summary["signals"] == ["SIGINT", "SIGINT"]
    assert summary["saved"]["ranks"] == [0]
    missing = summary["saved"]["missing"]
    assert [m["rank"] for m in missing] == [1]
    assert "killed by the launcher after a second SIGINT" in missing[0]["why"]
    ranks = summary["ranks"]
    assert ranks[0]["exit_code"] == 0 and Path(ranks[0]["bundle"] + ".meta.json").is_file()
    assert ranks[1]["exit_code"] == -signal.SIGKILL and ranks[1]["bundle"] is None
    assert "saved: rank 0; not saved: rank 1 (killed" in summary["message"]
    assert "flodl: SIGINT: killing the ranks" in launcher.output
    assert "rank 1 NOT saved: killed" in launcher.output
    launcher.assert_no_process_left()
    assert time.time() - summary["started_unix"] < 60  # killed, not waited out


def test_ranks_do_not_outlive_a_sigkilled_launcher(tmp_path: Path) -> None:
    """Out of the launcher's process group, a rank still ends when its launcher dies: it sees
    the coordinator's connection close and gives up (a round under way ends first, within
    the short collective timeout it is given)."""
    env = short_collectives_env()
    launcher = Launcher(tmp_path / "run", 2, DIGITS, "--epochs", "50", env=env)
    launcher.read_until("epoch 1 started")
    ranks = launcher.children()
    assert len(ranks) == 2
    os.kill(launcher.process.pid, signal.SIGKILL)
    launcher.finish()
    wait_exits(ranks, limit=30)  # beyond the heartbeat timeout (10 s)
    assert live_in_groups(ranks) == []


# --- flodl coordinator / flodl worker -------------------------------------------------------------


def hangup_as_a_shell_leaves_it() -> None:
    """SIGHUP at its default, as a terminal's shell starts a command: the test runner itself
    may run with SIGHUP ignored, which its children would inherit (and then keep, as nohup)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _multihost(tmp_path: Path) -> tuple[subprocess.Popen[str], list[subprocess.Popen[str]]]:
    env = dict(os.environ, FLODL_SESSION_KEY=secrets.token_hex(32))
    flodl = [sys.executable, "-m", "flodl.cli"]
    coordinator = subprocess.Popen(
        [
            *(*flodl, "coordinator", "--listen", "tcp://127.0.0.1:0", "--world-size", "2"),
            *("--run-dir", str(tmp_path / "coordinator")),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=hangup_as_a_shell_leaves_it,
    )
    assert coordinator.stdout is not None
    url = re.search(r"tcp://127\.0\.0\.1:\d+", coordinator.stdout.readline())
    assert url, "the coordinator printed no URL"
    workers = [
        subprocess.Popen(
            [
                *(*flodl, "worker", "--coordinator", url.group(0), "--rank", str(rank)),
                *("--world-size", "2", "--run-dir", str(tmp_path / f"host{rank}")),
                *(str(DIGITS), "--epochs", "50"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=hangup_as_a_shell_leaves_it,
        )
        for rank in range(2)
    ]
    return coordinator, workers


def read_until(proc: subprocess.Popen[str], needle: str) -> str:
    """``proc``'s output up to the line holding ``needle`` (all of it if never)."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            break
    return "".join(seen)


@pytest.mark.parametrize(
    ("target", "signum"),
    [
        ("worker", signal.SIGTERM),
        ("coordinator", signal.SIGTERM),
        ("worker", signal.SIGHUP),
        ("coordinator", signal.SIGHUP),
    ],
    ids=["worker-SIGTERM", "coordinator-SIGTERM", "worker-SIGHUP", "coordinator-SIGHUP"],
)
def test_a_stop_signal_to_a_worker_or_the_coordinator_saves_every_rank(
    tmp_path: Path, target: str, signum: signal.Signals
) -> None:
    """SIGHUP (an ssh session that drops) is sent twice, as a closing terminal may: the second
    neither kills the worker nor stops the coordinator at once."""
    coordinator, workers = _multihost(tmp_path)
    procs = [coordinator, *workers]
    timers = [threading.Timer(120, p.kill) for p in procs]
    for timer in timers:
        timer.start()
    signalled = workers[1] if target == "worker" else coordinator
    said = "asking the coordinator" if target == "worker" else "every rank saves its bundle"
    before = ""
    try:
        read_until(workers[1], "epoch 1 started")
        signalled.send_signal(signum)
        if signum == signal.SIGHUP:
            before = read_until(signalled, f"flodl: SIGHUP: {said}")
            signalled.send_signal(signum)
        outputs = [p.communicate()[0] for p in procs]
        outputs[procs.index(signalled)] = before + outputs[procs.index(signalled)]
    finally:
        for proc, timer in zip(procs, timers, strict=True):
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    asked = "rank 1 asked to stop" if target == "worker" else f"stop requested ({signum.name})"
    assert "flodl: run stopped, every rank asked to save (save_reason GRACEFUL)" in outputs[0]
    assert asked in outputs[0], outputs[0]
    if target == "worker":
        assert f"flodl: {signum.name}: asking the coordinator to save every rank" in outputs[2]
    assert "; ranks 0, 1 saved on their own hosts" in outputs[0], outputs[0]
    summary = json.loads((tmp_path / "coordinator" / "summary.json").read_text())
    expected = [signum.name] * (2 if signum == signal.SIGHUP else 1)
    assert summary["signals"] == ([] if target == "worker" else expected)
    for rank, entry in enumerate(summary["ranks"]):  # as each rank reported it
        assert entry["save_error"] is None
        assert entry["bundle"].startswith(str(tmp_path / f"host{rank}" / "checkpoints"))
    for rank in range(2):
        assert "coordinator asked to save and stop: GRACEFUL (saved to" in outputs[1 + rank]
        saved = tmp_path / f"host{rank}" / "checkpoints" / f"rank{rank}"
        metas = [json.loads(p.read_text()) for p in saved.glob("*.meta.json")]
        assert [m["save_reason"] for m in metas] == ["GRACEFUL"], outputs
    for proc in procs:
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)
