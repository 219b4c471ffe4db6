"""The DDP side of the throughput bench: torch DistributedDataParallel over gloo.

:func:`run_ddp` hosts a ``TCPStore`` on 127.0.0.1 (port chosen by the OS), starts ``world``
copies of this file as rank processes and collects what each wrote. Every rank trains
:mod:`training_task` on its slice of each global batch (``batch_size`` samples per rank per
step, the epoch order seeded ``seed + epoch`` and shared, as a ``DistributedSampler`` would),
for the same number of epochs as the flodl side. The slow rank sleeps ``(factor - 1)`` x its
step's *compute* time: the step's wall time less the gradient all-reduce, timed by a comm
hook that wraps DDP's default all-reduce hook (so a slower device does not also get slower
communication). The same hook gives each rank's wait in the all-reduce, which for a fast
rank is mostly waiting for the slow one (reported as its idle time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import benchenv
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket, TCPStore
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from training_task import TaskConfig, accuracy, build_model, load_data, parse_task, train_step

HERE = Path(__file__).resolve()


@attrs.define
class CommSpan:
    """First start and last end of the gradient all-reduces of the current step."""

    first_start: float | None = None
    last_end: float = 0.0
    taken: float = 0.0
    """What the last :meth:`take` returned."""

    def take(self) -> float:
        """Seconds from the first all-reduce start to the last end; resets for the next step."""
        spent = 0.0 if self.first_start is None else self.last_end - self.first_start
        self.first_start = None
        self.taken = max(spent, 0.0)
        return self.taken


def timed_allreduce_hook(state: CommSpan, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce hook, timed."""
    started = time.perf_counter()
    if state.first_start is None:
        state.first_start = started
    future = default_hooks.allreduce_hook(dist.group.WORLD, bucket)  # type: ignore[arg-type]

    def finished(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        state.last_end = max(state.last_end, time.perf_counter())
        return done.value()

    return future.then(finished)


def rank_main(rank: int, world: int, port: int, out: Path, task: TaskConfig) -> None:
    """Train as rank ``rank`` of ``world`` and write ``out/ddp<rank>.json``."""
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        x_train, y_train, x_test, y_test = load_data(task.seed)
        model = build_model(task)
        ddp = DistributedDataParallel(model)
        span = CommSpan()
        # Through a lambda: DDP rejects the string annotations of ``from __future__``.
        ddp.register_comm_hook(span, lambda state, bucket: timed_allreduce_hook(state, bucket))
        optimizer = torch.optim.Adam(ddp.parameters(), lr=task.lr)
        factor = task.slow_factor if rank == task.slow_rank else 1.0
        per_step = task.batch_size * world
        steps_per_epoch = len(x_train) // per_step
        samples, comm_s = 0, 0.0
        dist.barrier()
        started = time.time()
        for epoch in range(task.epochs):
            order = torch.randperm(
                len(x_train), generator=torch.Generator().manual_seed(task.seed + epoch)
            )
            for step in range(steps_per_epoch):
                first = step * per_step + rank * task.batch_size
                idx = order[first : first + task.batch_size]
                train_step(ddp, optimizer, x_train[idx], y_train[idx], factor, span.take)
                comm_s += span.taken
                samples += len(idx)
        ended = time.time()
        result = {
            "rank": rank,
            "samples": samples,
            "first_batch_unix": started,
            "loop_end_unix": ended,
            "comm_s": comm_s,
            "test_accuracy": accuracy(model, x_test, y_test),
        }
        (out / f"ddp{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ddp(task: TaskConfig, world: int = 4, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Run the DDP baseline with ``world`` rank processes; their reports, by rank.

    Every process started here has exited when this returns or raises (killed on timeout).
    """
    store = TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as tmp:
        out = Path(tmp)
        # setsid: each rank in a session of its own, as flodl's launcher starts its ranks (with
        # autogroup scheduling a session is a scheduling group; one shared by all ranks would
        # get one group's CPU against the machine's other work, flodl's ranks one each).
        command = [
            "setsid",
            sys.executable,
            str(HERE),
            "--world",
            str(world),
            "--port",
            str(store.port),
        ]
        commands = [
            [*command, "--rank", str(r), "--out", str(out), *task.args()] for r in range(world)
        ]
        benchenv.run_ranks(commands, timeout, "DDP")
        return [json.loads((out / f"ddp{r}.json").read_text()) for r in range(world)]


def main(argv: Sequence[str]) -> int:
    task, rest = parse_task(argv)
    parser = argparse.ArgumentParser(description="one DDP rank of the throughput bench")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(rest)
    rank_main(args.rank, args.world, args.port, args.out, task)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # The group is destroyed and the report written; a process that then runs torch's
    # interpreter teardown still aborts now and then with gloo (SIGABRT, Pitfall P4 in
    # torch-gloo-trio-notes.md; seen here in the smoke test), so leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
