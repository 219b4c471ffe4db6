"""The failure report with real processes: a rank that raised is named as having raised (never
as killed by the launcher's teardown), a rank killed by someone else is named by its signal,
and ``flodl coordinator`` writes its summary and exits non-zero when the run did not complete.
No process is left."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

# Rank 1 raises after a few batches; rank 0 trains on until the run is stopped around it.
RAISES = """\
import os
import torch
import flodl.worker

torch.set_num_threads(1)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def check(i):
    if i == 5:
        raise ValueError(f"bad batch {i} on purpose")


with flodl.worker.join(model, optimizer) as rank:
    for i, batch in enumerate(rank.batches(dataset_size=4096, batch_size=8, epochs=50)):
        if rank.rank == 1:
            check(i)
        if rank.rank == 1 and i == 3 and os.environ.get("SAY_PID"):
            print(f"pid {os.getpid()}", flush=True)
        loss = model(torch.ones(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        batch.done(loss)
"""

FLODL = [sys.executable, "-m", "flodl.cli"]


def _start(argv: list[str], **env: str) -> subprocess.Popen[str]:
    """A process in a session of its own (its pid is its group), killed after 60 s."""
    process = subprocess.Popen(
        argv,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    watchdog = threading.Timer(60, _kill_group, (process.pid,))
    watchdog.daemon = True
    watchdog.start()
    return process


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def assert_no_process_left(groups: list[int]) -> None:
    for pgid in groups:
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)


def _summary(run_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return data


def _script(tmp_path: Path, text: str = RAISES) -> Path:
    script = tmp_path / "train.py"
    script.write_text(text)
    return script


def test_a_rank_that_raises_is_the_root_cause(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = _start([*FLODL, "run", "--nproc", "2", "--run-dir", str(run_dir), _s(tmp_path)])
    output, _ = launcher.communicate()
    summary = _summary(run_dir)
    assert launcher.returncode == 1, output
    assert summary["status"] != "completed"
    cause = summary["root_cause"]
    assert (cause["rank"], cause["kind"]) == (1, "raised"), cause
    assert cause["error"] == "ValueError: bad batch 5 on purpose"
    if "Traceback" in (run_dir / "rank1.log").read_text():
        assert cause["traceback_tail"][0] == "Traceback (most recent call last):"
        assert cause["traceback_tail"][-1] == cause["error"]
        assert 'raise ValueError(f"bad batch {i} on purpose")' in "\n".join(cause["traceback_tail"])
    else:  # the rank hung before Python printed it: its report names the error
        assert cause["traceback_tail"] == []
    assert cause["pid"] == summary["ranks"][1]["pid"]
    assert abs(cause["time_unix"] - summary["started_unix"]) < 60 and cause["time"].endswith("Z")
    rank0 = summary["ranks"][0]
    assert not rank0["killed_by_launcher"] and rank0["signal"] is None
    assert summary["ranks"][1]["error"] == "ValueError: bad batch 5 on purpose"
    assert "Root cause (first failure):" in output
    assert "kind:  raised" in output and "error: ValueError: bad batch 5 on purpose" in output
    assert_no_process_left([launcher.pid] + [r["pid"] for r in summary["ranks"]])


def test_a_rank_killed_by_sigkill_is_named_by_its_signal(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    script = _script(tmp_path, RAISES.replace("i == 5", "i == -1"))  # nobody raises
    argv = [*FLODL, "run", "--nproc", "2", "--run-dir", str(run_dir), str(script)]
    launcher = _start(argv, SAY_PID="1")
    output, pid = _kill_rank_1_once_it_trains(launcher)
    summary = _summary(run_dir)
    assert pid, output
    assert launcher.returncode == 1, output
    cause = summary["root_cause"]
    assert (cause["rank"], cause["pid"]) == (1, pid), cause
    assert (cause["kind"], cause["signal"], cause["exit_code"]) == ("killed", "SIGKILL", None)
    assert not cause["killed_by_launcher"]
    assert summary["ranks"][1]["signal"] == "SIGKILL"
    assert "exit:  signal SIGKILL" in output
    assert_no_process_left([launcher.pid] + [r["pid"] for r in summary["ranks"]])


def _kill_rank_1_once_it_trains(launcher: subprocess.Popen[str]) -> tuple[str, int | None]:
    """SIGKILL rank 1 once it says its pid (a few batches in, SAY_PID); the launcher's whole
    output once it exited, and the pid killed (None: rank 1 never said it)."""
    assert launcher.stdout is not None
    lines, pid = [], None
    for line in launcher.stdout:
        lines.append(line)
        if found := re.search(r"\[rank 1\] pid (\d+)", line):
            pid = int(found.group(1))
            os.kill(pid, signal.SIGKILL)
            break
    return "".join(lines) + launcher.communicate()[0], pid


def _s(tmp_path: Path) -> str:
    return str(_script(tmp_path))


def test_flodl_coordinator_writes_its_summary_and_fails_when_the_run_did_not_complete(
    tmp_path: Path,
) -> None:
    key = secrets.token_hex(32)
    run_dir = tmp_path / "coordinator"
    listen = ("--listen", "tcp://127.0.0.1:0", "--world-size", "2")
    coordinator = _start(
        [*FLODL, "coordinator", *listen, "--run-dir", str(run_dir)], FLODL_SESSION_KEY=key
    )
    assert coordinator.stdout is not None
    url = re.search(r"tcp://127\.0\.0\.1:\d+", coordinator.stdout.readline())
    assert url, "the coordinator printed no URL"
    script = _s(tmp_path)
    workers = [
        _start(
            [
                *(*FLODL, "worker", "--coordinator", url.group(0), "--rank", str(rank)),
                *("--world-size", "2", "--run-dir", str(tmp_path / f"host{rank}"), script),
            ],
            FLODL_SESSION_KEY=key,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate()[0] for p in (coordinator, *workers)]
    assert coordinator.returncode == 1, outputs[0]
    assert "ValueError: bad batch 5 on purpose" in outputs[2]
    summary = _summary(run_dir)
    assert summary["status"] == "saved" and summary["save_reason"] == "SINGLE_SURVIVOR"
    assert [r["joined"] for r in summary["ranks"]] == [True, True]
    cause = summary["root_cause"]
    assert (cause["rank"], cause["kind"], cause["cause"]) == (1, "lost", "disconnected"), cause
    assert summary["deaths"][0]["rank"] == 1
    assert "Root cause (first failure):" in outputs[0]
    assert f"summary: {run_dir / 'summary.json'}" in outputs[0]
    assert_no_process_left([p.pid for p in (coordinator, *workers)])


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_run_that_lost_a_rank_and_completed_exits_0_unless_strict(
    tmp_path: Path, strict: bool
) -> None:
    """What a scheduler reads: the run recovered and completed, so it succeeded; the summary and
    the first line of the closing text name the rank it lost. --strict makes the loss fail it."""
    run_dir = tmp_path / "run"
    nobody_raises = RAISES.replace("i == 5", "i == -1").replace("epochs=50", "epochs=10")
    script = _script(tmp_path, nobody_raises)
    flags = ["--strict"] if strict else []
    argv = [*FLODL, "run", "--nproc", "3", "--run-dir", str(run_dir), *flags, str(script)]
    launcher = _start(argv, SAY_PID="1")
    output, pid = _kill_rank_1_once_it_trains(launcher)
    assert pid, output
    summary = _summary(run_dir)
    assert summary["status"] == "completed", output
    assert launcher.returncode == (1 if strict else 0), output
    (lost,) = summary["lost"]
    assert (lost["rank"], lost["why"]) == (1, "killed by SIGKILL"), lost
    assert summary["lost_ranks"] == [1] and summary["ranks_at_end"] == [0, 2]
    headline = r"flodl: run completed with ranks \[0, 2\] of 3; rank 1 killed by SIGKILL at \S+Z"
    assert re.search(headline, output), output
    assert "recovered in" in output  # it died while training: the survivors re-formed
    assert_no_process_left([launcher.pid] + [r["pid"] for r in summary["ranks"]])
