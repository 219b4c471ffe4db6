"""`flodl run` with real processes: failures at start end the run at once, with no process left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from flodl.launcher import LaunchConfig, launch

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
