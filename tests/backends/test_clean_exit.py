"""Pitfall P4: a process exiting with live gloo groups may SIGABRT; ``close()`` prevents it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.backends.harness import ROOT


@pytest.mark.long
@pytest.mark.slow
def test_thirty_two_rank_jobs_all_exit_zero() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.backends.job_script", "--jobs", "30", "--concurrent", "4"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    statuses = json.loads(done.stdout.strip().splitlines()[-1])["statuses"]
    assert len(statuses) == 60
    outcomes = [os.WEXITSTATUS(s) if os.WIFEXITED(s) else -os.WTERMSIG(s) for s in statuses]
    assert outcomes == [0] * 60, f"non-zero exits: {sorted(set(outcomes))}\n{done.stderr}"
