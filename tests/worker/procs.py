"""Start real rank processes (and a coordinator process) for the worker tests. Not tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import BinaryIO

import trio

from flodl.supervise.warm import RankHandle, warm_starter_if

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits.py"


def digits_module() -> ModuleType:
    """``examples/digits.py`` imported (its data, model and accuracy, to check a bundle)."""
    spec = importlib.util.spec_from_file_location("digits_example", DIGITS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rank_env(
    rank: int,
    world_size: int,
    url: str,
    key: bytes,
    run_dir: Path,
    *,
    policy: str = "cadence",
    heartbeat_timeout: float = 5.0,
    heartbeat_interval: float = 0.5,
    **extra: str,
) -> dict[str, str]:
    """What the launcher would give rank ``rank`` (plus ``extra``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    env.update(
        {
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "FLODL_COORDINATOR": url,
            "FLODL_SESSION_KEY": key.hex(),
            "FLODL_BACKEND": "gloo",
            "FLODL_POLICY": policy,
            "FLODL_HEARTBEAT_TIMEOUT": str(heartbeat_timeout),
            "FLODL_HEARTBEAT_INTERVAL": str(heartbeat_interval),
            "FLODL_RUN_DIR": str(run_dir),
            "FLODL_OP_TIMEOUT": "10",
            "FLODL_DEBUG_PARAM_HASHES": "1",
            **extra,
        }
    )
    return env


async def read_until(process: RankHandle, text: bytes, seen: bytearray) -> None:
    """Read ``process``'s stdout into ``seen`` until ``text`` shows up (EOFError if it ends)."""
    assert process.stdout is not None
    while text not in seen:
        chunk = await process.stdout.receive_some(4096)
        if not chunk:
            raise EOFError(f"process {process.pid} ended its output before {text!r}: {seen!r}")
        seen += chunk


@asynccontextmanager
async def spawn(
    commands: Sequence[tuple[list[str], dict[str, str], Path | None]],
) -> AsyncIterator[list[RankHandle]]:
    """Start one process per ``(argv, env, log)``: output to ``log``, or a pipe when None.

    A script (``[python, script, *args]``) is forked by a warm-start helper that has torch
    imported (the suite's, ``tests/conftest.py``, when the first script's environment is the
    one it imported in, else one of this call's own); a module (``-m``) starts cold. Either way
    each is a process of its own, with its own output. On exit every process still running is
    killed, every process is reaped, and a helper of the call's own is gone.
    """
    scripts = [env for argv, env, _ in commands if not argv[1].startswith("-")]
    processes: list[RankHandle] = []
    logs = []
    try:
        async with AsyncExitStack() as stack:
            warm = None
            if scripts:
                helper = warm_starter_if(True, sys.executable, scripts[0])
                warm = await stack.enter_async_context(helper)
            relays = await stack.enter_async_context(trio.open_nursery())
            try:
                for argv, env, log in commands:
                    handle = None if log is None else open(log, "wb")
                    if handle is not None:
                        logs.append(handle)
                    if warm is not None and not argv[1].startswith("-"):
                        process: RankHandle = await warm.start(argv, env, cwd=str(ROOT))
                        if handle is not None:
                            assert process.stdout is not None
                            relays.start_soon(copy_output, process.stdout, handle)
                            process.stdout = None
                    else:
                        out: int | object = subprocess.PIPE if handle is None else handle
                        process = await trio.lowlevel.open_process(
                            argv,
                            env=env,
                            cwd=ROOT,
                            stdin=subprocess.DEVNULL,
                            stdout=out,  # type: ignore[arg-type]
                            stderr=subprocess.STDOUT,
                        )
                    processes.append(process)
                yield processes
            finally:
                await kill_and_reap(processes)
    finally:
        for handle in logs:
            handle.close()


async def kill_and_reap(processes: Sequence[RankHandle]) -> None:
    """Kill each of ``processes`` still running and wait for every one; shielded, so it also
    finishes when the caller is being cancelled."""
    with trio.CancelScope(shield=True):
        for process in processes:
            if process.returncode is None:
                process.kill()
        for process in processes:
            await process.wait()


async def copy_output(stream: trio.abc.ReceiveStream, sink: BinaryIO) -> None:
    """Write what ``stream`` brings to ``sink`` until it ends (the process exited)."""
    async with stream:
        async for chunk in stream:
            sink.write(chunk)
            sink.flush()


def digits_command(*args: str) -> list[str]:
    return [sys.executable, str(DIGITS), *args]


def digits_ranks(
    world: int,
    url: str,
    key: bytes,
    run_dir: Path,
    args: Sequence[str],
    *,
    piped: int,
    heartbeat_timeout: float = 5.0,
) -> list[tuple[list[str], dict[str, str], Path | None]]:
    """``world`` digits ranks for :func:`spawn`: each runs ``examples/digits.py args``; rank
    ``piped``'s output comes on a pipe, the others' go to ``run_dir/rank<N>.log``."""
    return [
        (
            digits_command(*args),
            rank_env(r, world, url, key, run_dir, heartbeat_timeout=heartbeat_timeout),
            None if r == piped else run_dir / f"rank{r}.log",
        )
        for r in range(world)
    ]


def live_in_groups(groups: Sequence[int]) -> list[int]:
    """Processes, zombies aside, in any of the process groups ``groups`` (an orphan's zombie
    waits on init)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            found.append(int(stat.parent.name))
    return found


def pid_alive(pid: int) -> bool:
    """A process with this pid exists (a zombie counts: it is not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
