"""Spawn rank processes running ``rank_script`` and talk to them (JSON lines). Not tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[2]


class RankProcess:
    """One spawned rank; :meth:`call` sends a command and returns the JSON reply."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""

    async def _read_line(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        while b"\n" not in self._buffer:
            chunk = await self.process.stdout.receive_some(65536)
            if not chunk:
                raise EOFError(f"rank process {self.process.pid} closed its stdout")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def send(self, **cmd: Any) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all((json.dumps(cmd) + "\n").encode())

    async def receive(self, timeout: float = 30.0) -> dict[str, Any]:
        with trio.fail_after(timeout):
            return await self._read_line()

    async def call(self, timeout: float = 30.0, **cmd: Any) -> dict[str, Any]:
        await self.send(**cmd)
        return await self.receive(timeout)


@asynccontextmanager
async def spawn_ranks(
    count: int, op_timeout: float = 3.0, bucket_elements: int | None = None
) -> AsyncIterator[list[RankProcess]]:
    """Start ``count`` rank processes and wait until each is ready; kill and reap them all.

    ``bucket_elements``: each rank's backend option (None: the backend's default).
    """
    buckets = [] if bucket_elements is None else ["--bucket-elements", str(bucket_elements)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ranks: list[RankProcess] = []
    try:
        for _ in range(count):
            process = await trio.lowlevel.open_process(
                [
                    sys.executable,
                    "-m",
                    "tests.backends.rank_script",
                    "--op-timeout",
                    str(op_timeout),
                    *buckets,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=ROOT,
                env=env,
            )
            ranks.append(RankProcess(process))
        for rank in ranks:
            ready = await rank.receive(timeout=60.0)
            assert ready["ready"] is True
        yield ranks
    finally:
        with trio.CancelScope(shield=True):
            for rank in ranks:
                if rank.process.returncode is None:
                    rank.process.kill()
                await rank.process.wait()
                for stream in (rank.process.stdin, rank.process.stdout):
                    if stream is not None:
                        await stream.aclose()


async def close_all(ranks: list[RankProcess]) -> list[int]:
    """Ask every live rank to close, then return the exit codes (all must exit on their own)."""
    for rank in ranks:
        if rank.process.returncode is None:
            reply = await rank.call(cmd="close", timeout=30.0)
            assert reply["ok"] is True
    codes = []
    for rank in ranks:
        with trio.fail_after(30.0):
            codes.append(await rank.process.wait())
    return codes


async def form_group(ranks: list[RankProcess], generation: int) -> None:
    """Ranks[0] prepares ``generation``; all join it concurrently as ranks 0..n-1."""
    info = (await ranks[0].call(cmd="prepare", generation=generation))["info"]
    for index, rank in enumerate(ranks):
        await rank.send(cmd="join", info=info, rank=index, world=len(ranks), generation=generation)
    for rank in ranks:
        reply = await rank.receive()
        assert reply["ok"] is True, reply
