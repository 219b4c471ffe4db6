"""`flodl run` with real processes: failures at start end the run at once, with no process left."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from flodl.launch.config import LaunchConfig
from flodl.launch.launcher import launch
from tests.worker.procs import DIGITS

CRASH_AT_START = "import sys\nprint('starting')\nsys.exit(3)\n"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_script_that_crashes_at_start_ends_the_run_at_once(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(CRASH_AT_START)
    config = LaunchConfig(script=str(script), nproc=2, run_dir=tmp_path / "run", echo=False)
    summary = await launch(config)
    assert summary["status"] == "failed"
    assert "exited with code 3 before joining" in summary["message"]
    assert sorted(r["exit_code"] for r in summary["ranks"]) == [3, 3]
    assert not any(_alive(r["pid"]) for r in summary["ranks"])
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["status"] == "failed"
    assert (tmp_path / "run" / "rank0.log").read_text().strip() == "starting"
    key_file = tmp_path / "run" / "session.key"
    assert key_file.stat().st_mode & 0o777 == 0o600


def test_cli_reports_failure_with_exit_status_1(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(CRASH_AT_START)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flodl.cli",
            "run",
            "--nproc",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "flodl: run failed" in result.stdout
    assert "[rank 0] starting" in result.stdout


def test_cli_rejects_bad_options_clearly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "flodl.cli", "run", "--nproc", "0", "x.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--nproc must be an integer >= 1, got 0" in result.stderr


# --- one folder per run ---------------------------------------------------------------------------


def flodl_run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flodl.cli", "run", "--nproc", "1", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_each_run_writes_a_new_folder_and_runs_latest_points_at_it(tmp_path: Path) -> None:
    (tmp_path / "crash.py").write_text(CRASH_AT_START)
    first = flodl_run(tmp_path, "crash.py")
    second = flodl_run(tmp_path, "crash.py")
    assert (first.returncode, second.returncode) == (1, 1), first.stderr + second.stderr
    runs = tmp_path / "runs"
    folders = sorted(p for p in runs.iterdir() if not p.is_symlink())
    assert len(folders) == 2
    latest = runs / "latest"
    assert latest.is_symlink() and (runs / os.readlink(latest)) in folders
    newest = json.loads((latest / "summary.json").read_text())
    assert f"flodl: run folder {Path('runs') / newest['run_dir'].split('/')[-1]}" in second.stdout
    assert f"summary: {newest['run_dir']}/summary.json" in second.stdout
    for folder in folders:  # neither run wrote into the other's folder
        assert (folder / "rank0.log").read_text() == "starting\n"
        assert json.loads((folder / "summary.json").read_text())["run_dir"] == str(
            folder.relative_to(tmp_path)
        )


def test_a_run_dir_holding_a_run_is_refused_and_overwrite_starts_clean(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # An earlier run's files, old enough to tell from this run's.
    (run_dir / "rank0.json").write_text('{"batches": 999, "final_metrics": {"acc": 0.99}}')
    (run_dir / "rank0.log").write_text("earlier run\n")
    (run_dir / "notes.txt").write_text("mine")
    (tmp_path / "crash.py").write_text(CRASH_AT_START)
    refused = flodl_run(tmp_path, "--run-dir", "run", "crash.py")
    assert refused.returncode == 2
    assert "flodl: error: run dir run already holds a run (rank0.json, rank0.log)" in refused.stderr
    assert "--resume run" in refused.stderr and "--overwrite" in refused.stderr
    assert "[rank" not in refused.stdout
    assert (run_dir / "rank0.log").read_text() == "earlier run\n"

    again = flodl_run(tmp_path, "--run-dir", "run", "--overwrite", "crash.py")
    assert again.returncode == 1, again.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ranks"][0]["batches"] != 999 and summary["final_metrics"] == {}
    assert not (run_dir / "rank0.json").exists()  # the rank wrote none this time
    assert (run_dir / "rank0.log").read_text() == "starting\n"
    assert (run_dir / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "runs").exists()


def test_a_second_launcher_is_kept_out_of_a_folder_in_use(tmp_path: Path) -> None:
    # The first run's rank connects to the test and holds the folder until the test hangs up.
    hold = tmp_path / "hold.sock"
    waiter = tmp_path / "wait.py"
    waiter.write_text(
        "import socket\n"
        "peer = socket.socket(socket.AF_UNIX)\n"
        f"peer.connect({str(hold)!r})\n"
        "peer.recv(1)\n"
    )
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "flodl.cli", "run", "--nproc", "1", "--run-dir", str(run_dir)]
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(hold))
    listener.listen(1)
    listener.settimeout(30)
    first = subprocess.Popen(
        [*argv, str(waiter)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    held: socket.socket | None = None
    try:
        held, _ = listener.accept()  # the first run's rank is up: the folder is in use
        second = subprocess.run(
            [*argv, "--overwrite", str(waiter)], capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 2
        assert (
            f"flodl: error: run dir {run_dir} is in use by another flodl run (pid {first.pid})"
            in second.stderr
        )
        assert (run_dir / "session.key").exists()  # the first run's files are untouched
        held.close()  # the rank's recv returns: it exits 0
        first.communicate(timeout=60)
    finally:
        if held is not None:
            held.close()
        listener.close()
        if first.poll() is None:
            first.kill()
        first.wait()
    assert json.loads((run_dir / "summary.json").read_text())["ranks"][0]["exit_code"] == 0


def test_a_resume_with_fewer_epochs_is_refused_and_leaves_the_runs_state(tmp_path: Path) -> None:
    """--resume of a run that trained 2 epochs by a script that now asks for 1: every rank is
    refused with the reason, and the run folder's coordinator state (what the next --resume
    reads) is left as the run that trained wrote it."""
    run_dir = tmp_path / "run"

    def flodl_run(epochs: int, *flags: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "flodl.cli", "run", "--nproc", "2", "--no-live"]
        command += ["--run-dir", str(run_dir), *flags, str(DIGITS), "--epochs", str(epochs)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    trained = flodl_run(2)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    state = run_dir / "checkpoints" / "coordinator.meta.json"
    written = state.read_bytes()
    assert json.loads(written)["epoch"] == 2
    refused = flodl_run(1, "--resume", str(run_dir))
    assert refused.returncode == 1, refused.stdout
    why = "it trains 1 epochs, and the run it resumes had reached epoch 2"
    assert why in refused.stdout
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
    assert state.read_bytes() == written  # a run that never trained wrote no state of its own
