"""Fork rank processes running ``rank_script`` and talk to them (JSON lines). Not tests."""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from flodl.supervise.warm import WarmProcess, WarmStarter, warm_starter_if
from tests.worker.procs import kill_and_reap

ROOT = Path(__file__).resolve().parents[2]
RANK_SCRIPT = Path(__file__).with_name("rank_script.py")


class RankProcess:
    """One spawned rank and its connection; :meth:`call` sends a command and returns the JSON
    reply."""

    def __init__(self, process: WarmProcess, stream: trio.SocketStream) -> None:
        self.process = process
        self.stream = stream
        self.output = bytearray()
        """What the rank printed (its stdout and stderr), for a failure's message."""
        self._buffer = b""

    async def _read_line(self) -> dict[str, Any]:
        try:
            reply, self._buffer = await read_json_line(self.stream, self._buffer)
        except EOFError:
            raise EOFError(
                f"rank process {self.process.pid} closed its connection; it printed "
                f"{bytes(self.output)!r}"
            ) from None
        return reply

    async def send(self, **cmd: Any) -> None:
        await self.stream.send_all((json.dumps(cmd) + "\n").encode())

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

    The ranks are forked by a warm-start helper that has torch imported (the imports are paid
    once, not per rank); each connects to this harness's Unix socket, which carries the
    commands and replies. ``bucket_elements``: each rank's backend option (None: the
    backend's default).
    """
    buckets = [] if bucket_elements is None else ["--bucket-elements", str(bucket_elements)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    processes: list[WarmProcess] = []
    streams: list[trio.SocketStream] = []
    ranks: list[RankProcess] = []
    with tempfile.TemporaryDirectory(prefix="flodl-ranks-") as folder:
        control = os.path.join(folder, "control")
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        helper = warm_starter_if(True, sys.executable, env)
        async with helper as warm, trio.open_nursery() as outputs:
            assert isinstance(warm, WarmStarter)
            try:
                await listener.bind(control)
                listener.listen(count)
                argv = [sys.executable, str(RANK_SCRIPT), "--control", control]
                argv += ["--op-timeout", str(op_timeout), *buckets]
                for _ in range(count):
                    processes.append(await warm.start(argv, env, cwd=str(ROOT)))
                with trio.fail_after(60.0):
                    for _ in range(count):
                        sock, _ = await listener.accept()
                        streams.append(trio.SocketStream(sock))
                    for stream in streams:
                        ranks.append(await ready_rank(stream, processes))
                ranks.sort(key=lambda rank: processes.index(rank.process))
                for rank in ranks:
                    assert rank.process.stdout is not None
                    outputs.start_soon(copy_output, rank.process.stdout, rank.output)
                yield ranks
            finally:
                await kill_and_reap(processes)
                with trio.CancelScope(shield=True):
                    for stream in streams:
                        await stream.aclose()
                    listener.close()


async def read_json_line(stream: trio.SocketStream, buffer: bytes) -> tuple[dict[str, Any], bytes]:
    """The next JSON line of ``stream`` after what ``buffer`` holds, and what was read past it;
    EOFError (holding the unfinished line's bytes) if the stream ends first."""
    while b"\n" not in buffer:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise EOFError(buffer)  # what was read of the unfinished line
        buffer += chunk
    line, rest = buffer.split(b"\n", 1)
    message: dict[str, Any] = json.loads(line)
    return message, rest


async def copy_output(stream: trio.abc.ReceiveStream, output: bytearray) -> None:
    async with stream:
        async for chunk in stream:
            output += chunk


async def ready_rank(stream: trio.SocketStream, processes: list[WarmProcess]) -> RankProcess:
    """The rank on ``stream``, once it said it is ready (its pid names which of ``processes``
    it is)."""
    try:
        ready, rest = await read_json_line(stream, b"")
    except EOFError as ended:
        raise EOFError(f"a rank closed its connection before it was ready: {ended}") from None
    assert ready["ready"] is True
    (process,) = [p for p in processes if p.pid == ready["pid"]]
    rank = RankProcess(process, stream)
    rank._buffer = rest
    return rank


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
