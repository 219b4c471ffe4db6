"""Warm starts: ranks forked from a helper with torch imported, seen as cold ones would be.

Real processes throughout: the helper (``python -m flodl.supervise.zygote``) and the scripts it
forks; every test leaves the helper gone and every rank reaped.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import trio

from flodl.supervise.ranks import start_rank_process
from flodl.supervise.warm import WarmProcess, WarmStarter, WarmStartError, open_warm_starter
from tests.worker.procs import pid_alive

pytestmark = pytest.mark.slow

REPORT = """\
import json, os, random, sys
import numpy
print(json.dumps({
    "argv": sys.argv, "rank": os.environ.get("RANK"), "cwd": os.getcwd(), "path0": sys.path[0],
    "own_session": os.getsid(0) == os.getpid(), "torch_imported": "torch" in sys.modules,
    "numpy": int(numpy.random.randint(1 << 30)), "random": random.random(),
    "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").decode(),
}))
sys.exit(int(os.environ["CODE"]))
"""


async def output_of(process: WarmProcess) -> str:
    assert process.stdout is not None
    chunks = [chunk async for chunk in process.stdout]
    return b"".join(chunks).decode()


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


async def start(warm: WarmStarter, script: Path, *args: str, **env: str) -> WarmProcess:
    return await warm.start([sys.executable, str(script), *args], {**os.environ, **env})


async def test_a_forked_rank_has_its_own_argv_env_folder_session_and_exit_code(
    tmp_path: Path,
) -> None:
    script = write(tmp_path, "report.py", REPORT)
    async with open_warm_starter(sys.executable, dict(os.environ)) as warm:
        helper = warm.helper_pid
        ranks = [
            await start(warm, script, "--n", str(r), RANK=str(r), CODE=str(r + 3)) for r in (0, 1)
        ]
        outputs = [await output_of(rank) for rank in ranks]
        codes = [await rank.wait() for rank in ranks]
    assert codes == [3, 4]
    reports = [json.loads(text) for text in outputs]
    for rank, report in enumerate(reports):
        assert report["argv"] == [str(script), "--n", str(rank)]
        assert report["rank"] == str(rank)
        assert report["cwd"] == os.getcwd() and report["path0"] == str(tmp_path)
        assert report["own_session"] and report["torch_imported"]
        assert report["cmdline"] == f"{sys.executable} {script} --n {rank}"
    # Each draws its own numbers, as two fresh processes would.
    assert reports[0]["numpy"] != reports[1]["numpy"]
    assert reports[0]["random"] != reports[1]["random"]
    assert not pid_alive(helper) and not any(pid_alive(rank.pid) for rank in ranks)


async def test_a_forked_rank_never_walks_what_the_helper_imported(tmp_path: Path) -> None:
    """The helper's objects are in the collector's permanent generation: the rank's
    collections (and its exit's) never touch, and so never copy, those shared pages."""
    script = write(
        tmp_path,
        "collector.py",
        "import gc, torch\n"
        "gc.collect()\n"
        "walked = any(o is torch.nn.Module for o in gc.get_objects())\n"
        "print(gc.get_freeze_count(), walked)\n",
    )
    async with open_warm_starter(sys.executable, dict(os.environ)) as warm:
        rank = await start(warm, script)
        frozen, walked = (await output_of(rank)).split()
        assert await rank.wait() == 0
    assert int(frozen) > 100_000  # torch's classes, functions and module dictionaries
    assert walked == "False"


async def test_a_script_that_raises_exits_1_with_only_its_own_frames(tmp_path: Path) -> None:
    script = write(tmp_path, "fails.py", "def go():\n    raise ValueError('boom')\n\ngo()\n")
    async with open_warm_starter(sys.executable, dict(os.environ)) as warm:
        rank = await start(warm, script)
        output = await output_of(rank)
        assert await rank.wait() == 1
    assert output.startswith("Traceback (most recent call last):\n"), output
    assert output.count('  File "') == 2 and str(script) in output  # <module>, go
    assert output.rstrip().endswith("ValueError: boom")


async def test_a_killed_rank_reports_the_signal_and_later_signals_do_nothing(
    tmp_path: Path,
) -> None:
    script = write(
        tmp_path,
        "waits.py",
        "import signal\nprint('up', flush=True)\nsignal.pause()\n",  # until a signal ends it
    )
    async with open_warm_starter(sys.executable, dict(os.environ)) as warm:
        rank = await start(warm, script)
        assert rank.stdout is not None
        assert await rank.stdout.receive_some() == b"up\n"
        os.killpg(rank.pid, signal.SIGSTOP)  # the rank leads its own process group
        rank.kill()
        assert await rank.wait() == -signal.SIGKILL
        rank.kill()  # exited: nothing is sent, nothing raises
        assert rank.returncode == -signal.SIGKILL


async def test_a_helper_that_cannot_start_makes_ranks_start_cold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(tmp_path, "report.py", REPORT)
    # An interpreter that cannot import flodl (isolated, no site-packages): the helper fails.
    python = write(tmp_path, "python", f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    python.chmod(0o755)
    async with open_warm_starter(str(python), dict(os.environ)) as warm:
        with pytest.raises(WarmStartError, match="helper is gone"):
            await start(warm, script, CODE="0")
        argv = [sys.executable, str(script)]
        process = await start_rank_process(warm, argv, {**os.environ, "CODE": "5"})
        assert isinstance(process, trio.Process)
        assert await process.wait() == 5
    assert "starting the rank cold" in capsys.readouterr().out


async def test_a_warm_start_runs_a_script_file_only() -> None:
    async with open_warm_starter(sys.executable, dict(os.environ)) as warm:
        with pytest.raises(WarmStartError, match="script file"):
            await warm.start([sys.executable, "-c", "pass"], dict(os.environ))
