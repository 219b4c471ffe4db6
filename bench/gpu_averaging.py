"""GPU averaging overhead: a flodl round against a bare all-reduce of the same buffer.

Run by ``.ci/device-check`` on a device machine (one GPU): a 10M-parameter model (float32, on
``cuda:0``) averaged by a flodl round, against one ``allreduce`` of a flat buffer of the same
size on the same communicator; medians over ``--reps`` after ``--warmup``. Two groups:

* ``nccl``: an NCCL world of one (NCCL refuses two ranks on one device). The all-reduce is a
  local copy here, so the ratio shows flodl's own passes over the model (pack, norms,
  install) against almost nothing: an upper bound on the overhead, not a network figure.
* ``gloo``: two ranks in this process on the one GPU over gloo (CUDA tensors through host
  memory), the realistic ratio on one machine.

Target (the averaging bench's GPU target): a round at most 1.10x the bare all-reduce for a
10M-parameter model. Writes ``--output`` (JSON): per group the round's and the all-reduce's
median milliseconds, their ratio, the reps, the device and torch's version.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import trio

from flodl.backends.gloo import GlooBackend
from flodl.backends.nccl import NcclBackend
from flodl.backends.torch_backend import TorchDistBackend

PARAMETERS = 10_000_000
TARGET = 1.10


def model(device: torch.device, value: float) -> list[torch.Tensor]:
    """10M parameters in 10 tensors, as a model's layers would hold them."""
    return [torch.full((PARAMETERS // 10,), value, device=device) for _ in range(10)]


async def form(backends: Sequence[TorchDistBackend], generation: int) -> None:
    info = backends[0].prepare_group(generation, "127.0.0.1")
    async with trio.open_nursery() as nursery:
        for rank, backend in enumerate(backends):
            nursery.start_soon(backend.join_group, info, rank, len(backends), generation)


async def timed(reps: int, warmup: int, step: Callable[[], Awaitable[None]]) -> float:
    """Median milliseconds of ``step`` (the GPU synchronized after each)."""
    times = []
    for i in range(warmup + reps):
        started = time.perf_counter()
        await step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - started) * 1e3)
    return float(statistics.median(times))


async def measure(
    backends: Sequence[TorchDistBackend], device: torch.device, reps: int, warmup: int
) -> dict[str, Any]:
    await form(backends, 0)
    models = [model(device, float(i + 1)) for i in range(len(backends))]
    flats = [torch.ones(PARAMETERS, device=device) for _ in backends]

    async def round_() -> None:
        async with trio.open_nursery() as nursery:
            for backend, params in zip(backends, models, strict=True):
                nursery.start_soon(backend.average, params, [], 1)

    async def bare() -> None:
        async def one(backend: TorchDistBackend, flat: torch.Tensor) -> None:
            gen = backend._groups.live()
            await backend._groups.run(gen, lambda comm, _t: comm.allreduce(flat, dist.ReduceOp.SUM))

        async with trio.open_nursery() as nursery:
            for backend, flat in zip(backends, flats, strict=True):
                nursery.start_soon(one, backend, flat)

    round_ms = await timed(reps, warmup, round_)
    bare_ms = await timed(reps, warmup, bare)
    return {
        "ranks": len(backends),
        "round_ms": round(round_ms, 3),
        "allreduce_ms": round(bare_ms, 3),
        "ratio": round(round_ms / bare_ms, 3),
        "target": TARGET,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    result: dict[str, Any] = {
        "parameters": PARAMETERS,
        "reps": args.reps,
        "warmup": args.warmup,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
    }
    nccl = [NcclBackend(device=device, op_timeout=60.0)]
    try:
        result["nccl"] = await measure(nccl, device, args.reps, args.warmup)
    finally:
        await nccl[0].close()
    gloo = [GlooBackend(op_timeout=60.0) for _ in range(2)]
    try:
        result["gloo"] = await measure(gloo, device, args.reps, args.warmup)
    finally:
        for backend in gloo:
            await backend.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu averaging bench: no CUDA device; nothing measured", file=sys.stderr)
        return 0
    result = trio.run(main_async, args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
