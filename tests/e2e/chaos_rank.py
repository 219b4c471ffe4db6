"""A digits training rank that injects one fault into itself at a precise moment (test code).

Started by ``flodl run`` (``launch``) like ``examples/digits.py``, with the same data, model and
optimizer, but through the async worker API so it can hand the worker its own backend: a
:class:`ChaosBackend` that delegates to the real one (gloo) and fires faults at its seams.

``--fault RANK:KIND:N`` (repeatable) plans a fault for rank RANK:

==================== =========================================================================
``kill-compute``     SIGKILL itself while computing its (N+1)-th batch (after N batches)
``kill-after-sync``  SIGKILL itself computing the first batch after its N-th completed average,
                     or starting the next round if that comes first (ranks given the same N
                     die within milliseconds of each other)
``stop-compute``     SIGSTOP itself as ``kill-compute`` (alive and silent: the heartbeat path)
``kill-collective``  SIGKILL itself in its N-th averaging round (1-based), 0.3 s after the
                     round began there, so the peers are already blocked in the all-reduce
``hang-collective``  never finish its N-th averaging round (heartbeats go on: a reduce stall)
``kill-generator``   SIGKILL itself inside ``prepare_group`` for group generation N
==================== =========================================================================

Just before the signal the moment is written to ``<run_dir>/chaos/rank<R>.fault.json``;
a process that finds that file already there (a restarted rank) does not fault again. Every
process writes ``chaos/pids/rank<R>.<pid>`` when it starts, and appends one JSON line per
completed averaging round to ``chaos/rank<R>.rounds.jsonl`` (``generation``, ``call``: the
backend's call count, ``unix``, ``sha256`` of the parameters and buffers as the worker's
``param_hashes``), which a SIGKILLed rank leaves behind where its ``rank<R>.json`` is missing;
``chaos/rank<R>.events.jsonl`` times the backend calls (prepare, join, joined, average).

Exit codes as ``examples/digits.py``: 0 completed or saved on request, 1 on a flodl error.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from digits import accuracy, build_model, load_data  # the demo's data, split and model

from flodl.backends import AverageResult, Backend, PendingAverage, open_backend
from flodl.errors import FlodlError, ShutdownRequested
from flodl.worker import WorkerConfig, open_worker
from flodl.worker.records import tensors_sha256

KINDS = (
    "kill-compute",
    "kill-after-sync",
    "stop-compute",
    "kill-collective",
    "hang-collective",
    "kill-generator",
)
COLLECTIVE_KILL_DELAY_S = 0.3


@attrs.frozen
class Fault:
    rank: int
    kind: str
    at: int


def parse_fault(text: str) -> Fault:
    """``"2:kill-compute:40"`` -> Fault(2, "kill-compute", 40)."""
    parts = text.split(":")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise SystemExit(f"--fault expects RANK:KIND:N with KIND in {KINDS}, got {text!r}")
    return Fault(int(parts[0]), parts[1], int(parts[2]))


def chaos_dir(run_dir: Path) -> Path:
    return run_dir / "chaos"


def fault_path(run_dir: Path, rank: int) -> Path:
    return chaos_dir(run_dir) / f"rank{rank}.fault.json"


def rounds_path(run_dir: Path, rank: int) -> Path:
    return chaos_dir(run_dir) / f"rank{rank}.rounds.jsonl"


def write_record(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON with one ``write``: once it returns, the record is in the page
    cache and outlives this process, whatever signal follows. No fsync: that only guards
    against the machine crashing, and it took 8 - 40 ms on a loaded disk, time that fell
    between the recorded fault moment and the signal (the recovery bench counted it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, json.dumps(data).encode())
    finally:
        os.close(fd)


class Chaos:
    """This process's planned fault (at most one per rank) and its records."""

    def __init__(self, run_dir: Path, rank: int, faults: Sequence[Fault]) -> None:
        self.run_dir = run_dir
        self.rank = rank
        mine = [f for f in faults if f.rank == rank]
        # A restarted rank finds its fault record: the fault has happened, do not repeat it.
        self.fault = mine[0] if mine and not fault_path(run_dir, rank).exists() else None
        self.batches = 0
        self.rounds_started = 0
        self.rounds_done = 0
        self.generation: int | None = None
        pids = chaos_dir(run_dir) / "pids"
        pids.mkdir(parents=True, exist_ok=True)
        (pids / f"rank{rank}.{os.getpid()}").touch()

    def due(self, kind: str, count: int) -> bool:
        return self.fault is not None and self.fault.kind == kind and self.fault.at == count

    def passed(self, kind: str, count: int) -> bool:
        """Like :meth:`due`, for a count that is checked at more than one place and may have
        gone past N since the last check."""
        return self.fault is not None and self.fault.kind == kind and count >= self.fault.at

    def fire(self, signum: signal.Signals) -> None:
        """Record the moment, then send ``signum`` to this process."""
        self.record()
        os.kill(os.getpid(), signum)

    def record(self) -> None:
        """Write the fault record (just before the signal); later processes of this rank stay
        clean."""
        assert self.fault is not None
        write_record(
            fault_path(self.run_dir, self.rank),
            {
                "rank": self.rank,
                "kind": self.fault.kind,
                "at": self.fault.at,
                "pid": os.getpid(),
                "batches": self.batches,
                "generation": self.generation,
                "unix": time.time(),
            },
        )

    def event(self, what: str, generation: int | None) -> None:
        """Append ``{event, generation, unix}`` to ``chaos/rank<R>.events.jsonl`` (timings)."""
        line = json.dumps({"event": what, "generation": generation, "unix": time.time()})
        with (chaos_dir(self.run_dir) / f"rank{self.rank}.events.jsonl").open("a") as sink:
            sink.write(line + "\n")

    def round_completed(self, generation: int | None, number: int, sha256: str) -> None:
        self.rounds_done += 1
        now = time.time()
        line = json.dumps({"generation": generation, "call": number, "unix": now, "sha256": sha256})
        with rounds_path(self.run_dir, self.rank).open("a") as sink:
            sink.write(line + "\n")


class ChaosBackend:
    """A backend that delegates to ``inner`` and fires the planned collective/generator faults."""

    def __init__(self, inner: Backend, chaos: Chaos) -> None:
        self.inner = inner
        self.chaos = chaos
        self.name = inner.name

    @property
    def generation(self) -> int | None:
        return self.inner.generation

    @property
    def broken(self) -> bool:
        return self.inner.broken

    def prepare_group(self, generation: int, host: str) -> bytes:
        if self.chaos.due("kill-generator", generation):
            self.chaos.fire(signal.SIGKILL)
        self.chaos.event("prepare", generation)
        info = self.inner.prepare_group(generation, host)
        self.chaos.event("prepared", generation)
        return info

    async def join_group(
        self, info: bytes, rank: int, world_size: int, generation: int, host: str = ""
    ) -> None:
        self.chaos.event("join", generation)
        await self.inner.join_group(info, rank, world_size, generation, host)
        self.chaos.generation = self.inner.generation
        self.chaos.event("joined", generation)

    async def average(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        batches: int,
        gamma: float = 1.0,
    ) -> AverageResult:
        chaos = self.chaos
        # The N-th completed average may be followed by the next round before any batch: a
        # redo whose window was trained before it, say. The fault fires there, not a round on.
        if chaos.passed("kill-after-sync", chaos.rounds_done):
            chaos.fire(signal.SIGKILL)
        chaos.rounds_started += 1
        if chaos.due("kill-collective", chaos.rounds_started):
            await trio.sleep(COLLECTIVE_KILL_DELAY_S)  # the peers are inside the all-reduce now
            chaos.fire(signal.SIGKILL)
        if chaos.due("hang-collective", chaos.rounds_started):
            chaos.record()
            await trio.sleep_forever()  # cancelled by the worker (ShutdownWithSave)
        chaos.event("average", self.inner.generation)
        result = await self.inner.average(params, buffers, batches, gamma)
        digest = tensors_sha256([*params, *buffers])  # as the worker's param_hashes
        chaos.round_completed(self.inner.generation, chaos.rounds_started, digest)
        return result

    async def start_background_average(
        self,
        nursery: trio.Nursery,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        batches: int,
        gamma: float = 1.0,
    ) -> PendingAverage:
        return await self.inner.start_background_average(nursery, params, buffers, batches, gamma)

    async def average_moves(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        reference: Sequence[torch.Tensor],
        batches: int,
        dtype: torch.dtype,
    ) -> AverageResult:
        return await self.inner.average_moves(params, buffers, reference, batches, dtype)

    async def share_newest(self, tensors: Sequence[torch.Tensor], version: int) -> int:
        return await self.inner.share_newest(tensors, version)

    async def close(self) -> None:
        await self.inner.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="digits rank with one injected fault")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="sleep this long after each step (slower run)"
    )
    parser.add_argument("--fault", action="append", default=[], type=parse_fault)
    return parser


async def train(args: argparse.Namespace) -> int:
    config = WorkerConfig.from_env()
    chaos = Chaos(config.run_dir, config.rank, args.fault)
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = build_model(args.hidden, args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    inner = open_backend(config.backend, op_timeout=config.collective_timeout)
    backend = ChaosBackend(inner, chaos)
    try:
        async with open_worker(config, model, optimizer, backend=backend) as worker:
            await worker.announce(len(x_train), args.batch_size, args.epochs)
            while (item := await worker.next_batch()) is not None:
                if chaos.due("kill-compute", chaos.batches):
                    chaos.fire(signal.SIGKILL)
                if chaos.passed("kill-after-sync", chaos.rounds_done):
                    chaos.fire(signal.SIGKILL)
                if chaos.due("stop-compute", chaos.batches):
                    chaos.fire(signal.SIGSTOP)
                indices = list(item.indices)
                optimizer.zero_grad()
                loss = loss_fn(model(x_train[indices]), y_train[indices])
                loss.backward()
                optimizer.step()
                if args.step_ms > 0:
                    await trio.sleep(args.step_ms / 1000.0)
                chaos.batches += 1
                await worker.batch_done(loss.item())
            test_accuracy = accuracy(model, x_test, y_test)
            worker.report_final(test_accuracy=test_accuracy)
            print(f"rank {config.rank}: test accuracy {test_accuracy:.4f}", flush=True)
    except ShutdownRequested as stop:
        print(f"flodl: {stop}", file=sys.stderr, flush=True)
        return 0
    except FlodlError as err:
        print(f"flodl: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return trio.run(train, build_parser().parse_args(argv))


if __name__ == "__main__":
    code = main()
    # The worker has closed its groups and written its report. Skip the interpreter's
    # teardown of torch (0.7 s on a quiet core, 1.5-5 s with four ranks on two busy cores),
    # which the launcher would otherwise wait out at the end of every run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
