"""A digits rank for the soak bench that can be told to die at an awkward moment.

Started by ``flodl run`` (as ``examples/digits.py``: the same data, model and optimizer), through
the async worker API so it can wrap its backend. The soak bench (``bench/soak.py``) kills ranks
from outside with signals; two faults must land at a moment only the rank sees, so the bench
*arms* them with a file in ``<run_dir>/soak/`` and the first rank to reach that moment claims
the file (an atomic rename: one rank wins) and SIGKILLs itself there:

- ``arm-regroup``: inside ``join_group``, while the other members join the new group
  generation (a kill during a re-formation);
- ``arm-save``: inside a bundle write, once its first file is staged under a temporary name
  and before anything is renamed into place (a kill while saving).

Just before the signal the rank writes ``soak/faults/<pid>.json`` (kind, rank, unix time,
batches since its last round). Every process also keeps ``soak/ranks/rank<R>.<pid>``, 16
bytes the bench reads before it kills from outside: the batches trained, and the batches
trained when the last round ended (what a kill throws away is the difference).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from digits import accuracy, build_model, load_data  # the demo's data, split and model

import flodl.checkpoint.bundle as bundle_module
from flodl.backends import AverageResult, Backend, open_backend
from flodl.errors import FlodlError, ShutdownRequested
from flodl.worker import WorkerConfig, open_worker

COUNTERS = struct.Struct("<qq")
"""Batches trained, batches trained when the last round ended."""


def soak_dir(run_dir: Path) -> Path:
    return run_dir / "soak"


def read_counters(path: Path) -> tuple[int, int] | None:
    """A rank's (batches, batches at its last round), or None if its file is gone or short."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < COUNTERS.size:
        return None
    batches, at_round = COUNTERS.unpack_from(data)
    return int(batches), int(at_round)


class Counters:
    """This process's counters, in a shared mapping the bench can read at any moment."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        folder = soak_dir(run_dir) / "ranks"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{rank}.{os.getpid()}"
        with path.open("wb") as sink:
            sink.write(bytes(COUNTERS.size))
        self._fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, COUNTERS.size)
        self.batches = 0
        self.at_round = 0

    def batch(self) -> None:
        self.batches += 1
        COUNTERS.pack_into(self._map, 0, self.batches, self.at_round)

    def round(self) -> None:
        self.at_round = self.batches
        COUNTERS.pack_into(self._map, 0, self.batches, self.at_round)


class Trap:
    """Claims an armed fault and dies of it (see the module docstring)."""

    def __init__(self, run_dir: Path, rank: int, counters: Counters) -> None:
        self.folder = soak_dir(run_dir)
        self.rank = rank
        self.counters = counters

    def spring(self, kind: str, **detail: Any) -> None:
        """SIGKILL this process if ``arm-<kind>`` is there to claim; otherwise return."""
        armed = self.folder / f"arm-{kind}"
        claimed = self.folder / f"claimed-{kind}.{os.getpid()}"
        try:
            os.rename(armed, claimed)
        except FileNotFoundError:
            return
        record = {
            "kind": kind,
            "rank": self.rank,
            "pid": os.getpid(),
            "unix": time.time(),
            "batches_since_round": self.counters.batches - self.counters.at_round,
            **detail,
        }
        faults = self.folder / "faults"
        faults.mkdir(parents=True, exist_ok=True)
        # One write, no fsync: the page cache outlives this process, and an fsync here would
        # fall between the recorded moment and the kill.
        fd = os.open(faults / f"{os.getpid()}.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, json.dumps(record).encode())
        finally:
            os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)


class TrappedBackend:
    """The real backend, with the regroup trap in ``join_group`` and a round counter."""

    def __init__(self, inner: Backend, trap: Trap) -> None:
        self._inner = inner
        self._trap = trap

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def join_group(
        self, info: bytes, rank: int, world_size: int, generation: int, host: str = ""
    ) -> None:
        self._trap.spring("regroup", generation=generation)
        await self._inner.join_group(info, rank, world_size, generation, host)

    async def average(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        batches: int,
        gamma: float = 1.0,
    ) -> AverageResult:
        result = await self._inner.average(params, buffers, batches, gamma)
        self._trap.counters.round()
        return result

    async def average_moves(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        reference: Sequence[torch.Tensor],
        batches: int,
        dtype: torch.dtype,
    ) -> AverageResult:
        result = await self._inner.average_moves(params, buffers, reference, batches, dtype)
        self._trap.counters.round()
        return result


def trap_saves(trap: Trap) -> None:
    """Make every bundle write of this process spring the save trap once a file is staged."""
    real_stage = bundle_module.stage  # type: ignore[attr-defined]

    def stage(path: Path, data: bytes) -> Path:
        temp = real_stage(path, data)
        trap.spring("save", bundle=str(path))
        return temp

    bundle_module.stage = stage  # type: ignore[attr-defined]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="digits rank for the soak bench")
    parser.add_argument("--epochs", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--step-ms", type=float, default=4.0, help="sleep this long after each step (compute)"
    )
    return parser


async def train(args: argparse.Namespace) -> int:
    config = WorkerConfig.from_env()
    counters = Counters(config.run_dir, config.rank)
    trap = Trap(config.run_dir, config.rank, counters)
    trap_saves(trap)
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = build_model(args.hidden, args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    inner = open_backend(config.backend, op_timeout=config.collective_timeout)
    backend: Any = TrappedBackend(inner, trap)
    try:
        async with open_worker(config, model, optimizer, backend=backend) as worker:
            await worker.announce(len(x_train), args.batch_size, args.epochs)
            while (item := await worker.next_batch()) is not None:
                indices = list(item.indices)
                optimizer.zero_grad()
                loss = loss_fn(model(x_train[indices]), y_train[indices])
                loss.backward()
                optimizer.step()
                if args.step_ms > 0:
                    await trio.sleep(args.step_ms / 1000.0)
                counters.batch()
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
    # The worker has closed its groups and written its report: skip torch's slow teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
