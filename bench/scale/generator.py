"""The split mode's load-generator processes: started, driven and reaped by the bench
(:func:`open_generators`), and what runs in each (:func:`generator_main`).

A generator is this package run again (``python -m bench.scale --generator-child ...``, from
the repository root), so it needs nothing but a checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.lowlevel

from .hosts import WireHost, assigned_ranks, open_wire_host
from .ranks import BATCH_PERIOD_S, HEARTBEAT_PERIOD_S, KEY
from .record import Recorder, summarize_ms
from .sockets import WireGenerator, WireRank, open_wire_rank

REPOSITORY = Path(__file__).resolve().parents[2]
"""Where a generator starts: ``-m bench.scale`` finds the bench (and flodl) from there."""
GENERATOR_FLAG = "--generator-child"
CONNECT_AT_ONCE = 32
"""Ranks of one generator that connect and handshake at the same time (listener backlogs are
finite; a unix socket with a full backlog refuses rather than queues)."""
GENERATOR_REPLY_LIMIT_S = 30.0
GENERATOR_EXIT_GRACE_S = 10.0
GENERATOR_LAG_LIMIT_S = 0.050
"""A generator whose metronome runs this late at p99 is not keeping up with its schedule."""


@attrs.frozen
class CpuPlan:
    """Which cores the coordinator and the generators are pinned to (None: not pinned)."""

    coordinator: frozenset[int] | None
    generators: frozenset[int] | None

    def describe(self) -> str:
        if self.coordinator is None or self.generators is None:
            return "not pinned (--no-pin, no os.sched_setaffinity, or fewer than 2 usable cores)"
        return (
            f"os.sched_setaffinity: coordinator process on cores {sorted(self.coordinator)}, "
            f"load generators on cores {sorted(self.generators)}"
        )


def cpu_plan(pin: bool = True) -> CpuPlan:
    """The first usable core for the coordinator, the others for the generators."""
    if not pin or not hasattr(os, "sched_setaffinity"):
        return CpuPlan(None, None)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return CpuPlan(None, None)
    return CpuPlan(frozenset(cores[:1]), frozenset(cores[1:]))


class LineReader:
    """Newline-ended lines from a byte stream (the bench <-> generator control pipes)."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def next_line(self) -> bytes | None:
        """The next line without its newline; None at the end of the stream."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return line
            data = await self._stream.receive_some(65536)
            if not data:
                return None
            self._buffer += data


def partition_ranks(ranks: int, generators: int, per_host: int = 0) -> list[range]:
    """``range(ranks)`` cut into ``generators`` contiguous parts of near-equal size (whole
    hosts of ``per_host`` ranks each, when given)."""
    unit = per_host or 1
    units = ranks // unit
    bounds = [units * part // generators * unit for part in range(generators + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(generators) if bounds[i + 1] > bounds[i]]


class GeneratorProcess:
    """One load-generator child process, driven over its stdin/stdout."""

    def __init__(self, process: trio.Process, ranks: range) -> None:
        self.process = process
        self.ranks = ranks
        self.finishing = False
        assert process.stdin is not None and process.stdout is not None
        self._stdin = process.stdin
        self._lines = LineReader(process.stdout)

    def __str__(self) -> str:
        return f"load generator for ranks {self.ranks.start}..{self.ranks.stop - 1}"

    async def command(self, word: str) -> None:
        await self._stdin.send_all(word.encode() + b"\n")

    async def stop(self) -> dict[str, Any]:
        """End its measured window; its figures for the window."""
        await self.command("stop")
        with trio.fail_after(GENERATOR_REPLY_LIMIT_S):
            line = await self._lines.next_line()
        if line is None:
            raise RuntimeError(f"{self} closed its output without reporting")
        stats: dict[str, Any] = json.loads(line)
        return stats

    async def watch(self) -> None:
        """Raise if the process exits before the bench lets it go."""
        returncode = await self.process.wait()
        if not self.finishing:
            raise RuntimeError(f"{self} exited early with code {returncode}")

    async def finish(self) -> None:
        """Close its stdin (it exits then) and wait up to the grace period for the exit."""
        self.finishing = True
        await self._stdin.aclose()
        with trio.move_on_after(GENERATOR_EXIT_GRACE_S):
            await self.process.wait()


@contextlib.asynccontextmanager
async def open_generators(
    url: str,
    world_size: int,
    seed: int,
    generators: int,
    cores: frozenset[int] | None,
    per_host: int = 0,
) -> AsyncIterator[list[GeneratorProcess]]:
    """Start ``generators`` child processes that together run ranks 0..world_size-1 at ``url``
    (through simulated agents of ``per_host`` ranks each, when given).

    On exit every child has exited: those that do not exit within the grace period after their
    stdin closed, and all of them when the block is cancelled or raises, are killed and reaped.
    A child that exits early, or with an error, raises RuntimeError.
    """
    started: list[GeneratorProcess] = []
    try:
        async with trio.open_nursery() as nursery:
            for part in partition_ranks(world_size, generators, per_host):
                command = [
                    sys.executable,
                    "-m",
                    "bench.scale",
                    GENERATOR_FLAG,
                    url,
                    f"--first={part.start}",
                    f"--count={len(part)}",
                    f"--world={world_size}",
                    f"--seed={seed}",
                    f"--per-host={per_host}",
                ]
                if cores is not None:
                    command.append("--cores=" + ",".join(str(core) for core in sorted(cores)))
                process = await trio.lowlevel.open_process(
                    command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPOSITORY
                )
                generator = GeneratorProcess(process, part)
                started.append(generator)
                nursery.start_soon(generator.watch)
            yield started
            for generator in started:
                await generator.finish()
            failed = [g for g in started if g.process.returncode != 0]
            if failed:
                codes = ", ".join(f"{g}: {g.process.returncode}" for g in failed)
                raise RuntimeError(f"load generators did not exit cleanly ({codes})")
    finally:
        with trio.CancelScope(shield=True):
            for generator in started:
                if generator.process.returncode is None:
                    generator.process.kill()
                await generator.process.wait()


async def run_generator(
    url: str, ranks: range, world_size: int, seed: int, per_host: int = 0
) -> None:
    """Run ``ranks`` (stamping their messages) until stdin ends; answer start/stop on stdio.

    ``start`` opens the measured window; ``stop`` closes it and prints one JSON line with the
    generator's figures for it; ``kill RANK`` kills a rank, ``killhost NODE`` a host. Phases
    are drawn for all ranks in order, as the in-process mode does, so a rank has the same
    phases in every mode. ``per_host`` > 0: the agents layout (:mod:`.hosts`), ``ranks``
    being whole hosts of that many ranks.
    """
    recorder = Recorder(world_size)
    hub = WireGenerator(recorder)
    rng = random.Random(seed)
    phases = [
        (rng.uniform(0.0, BATCH_PERIOD_S), rng.uniform(0.0, HEARTBEAT_PERIOD_S))
        for _ in range(world_size)
    ]
    limiter = trio.CapacityLimiter(CONNECT_AT_ONCE)
    wires: dict[int, WireRank] = {}
    control = LineReader(trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())))

    hosts: dict[int, WireHost] = {}

    async def join(rank: int) -> None:
        async with limiter:
            sock, keys = await open_wire_rank(url, KEY, rank, world_size)
        wire = WireRank(rank, world_size, hub, sock, keys, *phases[rank])
        wires[rank] = wire
        hub.add(wire)
        wire.start()

    async def join_host(node: int) -> None:
        async with limiter:
            sock, encoder, decoder = await open_wire_host(url, KEY, node, per_host)
        assigned = await assigned_ranks(sock, decoder)
        first = assigned.first_rank
        host = WireHost(node, world_size, hub, sock, (encoder, decoder), first)
        hosts[node] = host
        hub.add(host)
        host.open_ranks(phases[first : first + per_host])
        hub.flush_hosts()

    def kill(rank: int) -> None:
        if per_host:
            hosts[rank // per_host].kill_rank(rank)
            hub.flush_hosts()
        else:
            hub.close(wires[rank])

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.metronome.run)
            nursery.start_soon(hub.serve)
            if per_host:
                for node in range(ranks.start // per_host, ranks.stop // per_host):
                    nursery.start_soon(join_host, node)
            else:
                for rank in ranks:
                    nursery.start_soon(join, rank)
            cpu_before = wall_before = 0.0
            while (line := await control.next_line()) is not None:
                if line == b"start":
                    cpu_before, wall_before = time.process_time(), time.perf_counter()
                    recorder.measuring = True
                elif line.startswith(b"kill "):
                    # The rank's process dies: its socket closes with no goodbye (through
                    # an agent: the agent reports its exit, then that the rank is gone).
                    kill(int(line.split()[1]))
                elif line.startswith(b"killhost "):
                    # The agent dies (SIGKILL): its socket closes, its ranks with it.
                    hub.close(hosts[int(line.split()[1])])
                elif line == b"stop":
                    recorder.measuring = False
                    cpu = time.process_time() - cpu_before
                    wall = time.perf_counter() - wall_before
                    stats = {
                        "pid": os.getpid(),
                        "first_rank": ranks.start,
                        "ranks": len(ranks),
                        "cores": sorted(os.sched_getaffinity(0)),
                        "seconds": round(wall, 3),
                        "cpu_s": round(cpu, 3),
                        "cpu_share_of_wall": round(cpu / wall, 3),
                        "sent_per_s": round(sum(recorder.sent.values()) / wall, 1),
                        "sent_by_kind": dict(sorted(recorder.sent.items())),
                        "received_by_kind": dict(sorted(recorder.delivered.items())),
                        "lag": summarize_ms(recorder.rank_lag),
                        "late_rank_ticks": recorder.late_rank_ticks,
                    }
                    print(json.dumps(stats), flush=True)
            nursery.cancel_scope.cancel()
    finally:
        hub.close_all()


def generator_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description="load generator of the coordinator scale bench")
    parser.add_argument("url")
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--cores", help="comma-separated cores to pin this process to")
    parser.add_argument("--per-host", type=int, default=0, help="ranks per simulated agent")
    args = parser.parse_args(argv)
    if args.cores:
        os.sched_setaffinity(0, {int(core) for core in args.cores.split(",")})
    gc.collect()
    ranks = range(args.first, args.first + args.count)
    trio.run(run_generator, args.url, ranks, args.world, args.seed, args.per_host)
    return 0
