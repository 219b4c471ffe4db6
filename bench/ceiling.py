"""The ceiling of the throughput bench: the same ranks training with no communication at all.

:func:`run_ceiling` starts ``world`` copies of this file at once on this machine. Each trains
its own copy of the :mod:`training_task` model on the digits training set (its own seeded
epoch order), ``task.batch_size`` samples a step, the slow rank made slower exactly as on the
other sides (:func:`training_task.train_step`), and never talks to another rank: no averaging,
no coordinator, no collective. What they train together per second is what ``world``
processes of these speeds can train on this machine, the figure a data-parallel run is set
against (``goodput_vs_ceiling``).

Start-up is kept out of the window the same way as on the flodl and DDP sides: every process
imports torch, loads the data and builds its model, then says ``ready`` and waits; once all
are ready the parent hands them one shared deadline and they train until it, each finishing
the step in flight. The window is the flodl side's: first batch on any rank to the end of the
last rank's loop.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from training_task import TaskConfig, accuracy, build_model, load_data, parse_task, train_step

HERE = Path(__file__).resolve()
READY = "ready"


def rank_main(rank: int, task: TaskConfig) -> dict[str, Any]:
    """Get ready, wait for the deadline on stdin, train until it; this rank's report."""
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_data(task.seed)
    model = build_model(task)
    optimizer = torch.optim.Adam(model.parameters(), lr=task.lr)
    factor = task.slow_factor if rank == task.slow_rank else 1.0
    print(READY, flush=True)
    deadline = float(sys.stdin.readline())
    samples = batches = 0
    first_batch_unix = time.time()
    epoch = 0
    while time.time() < deadline:
        order = torch.randperm(
            len(x_train),
            generator=torch.Generator().manual_seed(task.seed + 1000 * rank + epoch),
        )
        for first in range(0, len(order), task.batch_size):
            idx = order[first : first + task.batch_size]
            train_step(model, optimizer, x_train[idx], y_train[idx], factor)
            samples += len(idx)
            batches += 1
            if time.time() >= deadline:
                break
        epoch += 1
    loop_end_unix = time.time()
    return {
        "rank": rank,
        "samples": samples,
        "batches": batches,
        "first_batch_unix": first_batch_unix,
        "loop_end_unix": loop_end_unix,
        "test_accuracy": accuracy(model, x_test, y_test),
    }


def run_ceiling(
    task: TaskConfig, world: int, duration_s: float, timeout: float = 300.0
) -> list[dict[str, Any]]:
    """Run ``world`` independent ranks together for ``duration_s`` of training; their reports.

    Every process started here has exited when this returns or raises (killed on timeout).
    """
    command = [sys.executable, str(HERE), *task.args()]
    processes = [
        subprocess.Popen(
            [*command, f"--rank={rank}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        for rank, process in enumerate(processes):
            assert process.stdout is not None
            line = process.stdout.readline().strip()
            if line != READY:
                process.kill()
                _, err = process.communicate()
                raise RuntimeError(f"ceiling rank {rank} did not get ready ({line!r}):\n{err}")
        deadline = time.time() + duration_s
        for process in processes:
            assert process.stdin is not None
            process.stdin.write(f"{deadline!r}\n")
            process.stdin.flush()
        end = time.monotonic() + duration_s + timeout
        outputs = [p.communicate(timeout=max(end - time.monotonic(), 1.0)) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [(rank, p.returncode) for rank, p in enumerate(processes) if p.returncode != 0]
    if failed:
        raise RuntimeError(
            f"ceiling ranks failed {failed}:\n" + "\n".join(err for _, err in outputs)
        )
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def main(argv: Sequence[str]) -> int:
    task, rest = parse_task(argv)
    parser = argparse.ArgumentParser(description="one rank of the no-communication ceiling")
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args(rest)
    print(json.dumps(rank_main(args.rank, task)), flush=True)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
