"""The baselines of the time-to-quality bench: ``solo``, ``solo+busy`` and ``ddp``.

* ``solo``: the fast rank alone, a plain single process (what a user would run instead):
  batches of the workload's size in the order of :func:`quality_task.sample_order`.
* ``solo+busy`` (:func:`run_busy_solo`): the same solo process, with the layout's other ranks
  beside it as *neighbours* that train the workload at their speeds (the slow one slowed) and
  are discarded: the fast rank alone on a machine as busy as the multi-rank runs make it. On a
  machine whose ranks share cores, memory bandwidth and caches, it tells what the machine's
  contention costs apart from what the training algorithm gains.
* ``ddp``: torch ``DistributedDataParallel`` over gloo, lock-step, ``world`` processes with the
  same slow rank as the flodl runs. Each step every rank trains its slice of a global batch
  (the workload's batch size per rank, the epoch's order shared, as a ``DistributedSampler``
  would). The slow rank sleeps ``(factor - 1)`` x its step's compute: the step's wall time less
  the gradient all-reduce, timed by the comm hook of ``bench/ddp_baseline.py`` (a slower device
  does not also get slower communication). The harness hosts the ``TCPStore`` on 127.0.0.1.

In both, process 0 keeps the :class:`~quality_task.BudgetClock` and evaluates between steps
(in DDP the other ranks wait for it at the next all-reduce). Once its budget is spent it
writes ``result.json`` and leaves (``os._exit``: a DDP process's gloo threads may abort its
interpreter's teardown, see docs/running.md); the harness then kills the other ranks, which
are blocked in an all-reduce that will never complete.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from quality_procs import Processes, wait_for_exits
from quality_task import (
    BudgetClock,
    RunSpec,
    build_task,
    parse_spec,
    sample_order,
    train_step,
    write_pid,
    write_result,
)

HERE = Path(__file__).resolve()
STARTUP_ALLOWANCE_S = 120.0
"""Seconds a run may take beyond twice its budget (start-up, evaluations) before it is killed."""


def deadline_s(spec: RunSpec) -> float:
    """How long the harness waits for a run's result before it kills the run."""
    return STARTUP_ALLOWANCE_S + 2.0 * spec.budget_s


# --------------------------------------------------------------------------- rank processes


def solo_main(spec: RunSpec) -> None:
    """Train the workload alone until the budget is spent; write ``result.json``."""
    write_pid(spec, "solo")
    torch.set_num_threads(1)
    task = build_task(spec.workload, spec.seed)
    clock = BudgetClock(spec.budget_s, spec.points)
    clock.evaluate(task.validation_loss, step=0)
    size, steps, epoch = task.batch_size, 0, 0
    while True:
        order = sample_order(task.dataset_size, epoch, spec.seed)
        for first in range(0, len(order) - size + 1, size):
            clock.start()
            loss = train_step(task, order[first : first + size], 1.0)
            steps += 1
            if clock.tick(task, step=steps):
                write_result(
                    spec, clock, steps=steps, samples=steps * size, epochs=epoch, train_loss=loss
                )
                return
        epoch += 1


def neighbour_main(spec: RunSpec, rank: int) -> None:
    """Train as rank ``rank`` would (its speed, its slice of each batch), never evaluate,
    never stop: the harness kills it once the solo process beside it has its result."""
    write_pid(spec, f"neighbour{rank}")
    torch.set_num_threads(1)
    task = build_task(spec.workload, spec.seed)
    factor, size, epoch = spec.factor(rank), task.batch_size, 0
    while True:
        order = sample_order(task.dataset_size, epoch, spec.seed + rank)
        for first in range(0, len(order) - size + 1, size):
            train_step(task, order[first : first + size], factor)
        epoch += 1


def ddp_main(spec: RunSpec, rank: int, world: int, port: int) -> None:
    """Train as rank ``rank`` of a DDP group of ``world``; rank 0 writes ``result.json``."""
    import torch.distributed as dist
    from ddp_baseline import CommSpan, timed_allreduce_hook
    from torch._C._distributed_c10d import TCPStore
    from torch.nn.parallel import DistributedDataParallel

    write_pid(spec, f"ddp{rank}")
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    task = build_task(spec.workload, spec.seed)
    ddp = DistributedDataParallel(task.model)
    span = CommSpan()
    # Through a lambda: DDP rejects the string annotations of ``from __future__``.
    ddp.register_comm_hook(span, lambda state, bucket: timed_allreduce_hook(state, bucket))
    factor = spec.factor(rank)
    clock = BudgetClock(spec.budget_s, spec.points)
    if rank == 0:
        clock.evaluate(task.validation_loss, step=0)
    dist.barrier()
    size = task.batch_size
    per_step = size * world
    steps = epoch = 0
    comm_s = 0.0
    while True:
        order = sample_order(task.dataset_size, epoch, spec.seed)
        for step in range(len(order) // per_step):
            first = step * per_step + rank * size
            clock.start()
            loss = train_step(task, order[first : first + size], factor, ddp, span.take)
            comm_s += span.taken
            steps += 1
            if rank == 0 and clock.tick(task, step=steps):
                write_result(
                    spec,
                    clock,
                    steps=steps,
                    samples=steps * per_step,
                    epochs=epoch,
                    train_loss=loss,
                    allreduce_s=round(comm_s, 3),
                )
                sys.stdout.flush()
                os._exit(0)
        epoch += 1


# --------------------------------------------------------------------------- the harness


def wait_for_result(processes: Processes, spec: RunSpec, what: str) -> dict[str, Any]:
    """Wait until process 0 has written its result and exited; its result.

    RuntimeError (with the logs) when a process fails before that, or the deadline passes.
    """
    keeper = processes.children[0]
    deadline = time.monotonic() + deadline_s(spec)
    while keeper.poll() is None:
        failed = [(i, c.returncode) for i, c in enumerate(processes.children) if c.poll()]
        if failed and not spec.result_path.exists():
            raise RuntimeError(f"{what}: processes failed {failed}\n{processes.tail()}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(
                f"{what}: no result after {deadline_s(spec):.0f} s\n{processes.tail()}"
            )
        running = [c.pid for c in processes.children if c.poll() is None]
        wait_for_exits(running, remaining, every=False)  # wakes at the next exit
    if not spec.result_path.exists():
        raise RuntimeError(f"{what}: exited {keeper.returncode} with no result\n{processes.tail()}")
    result: dict[str, Any] = json.loads(spec.result_path.read_text())
    return result


def run_solo(spec: RunSpec, folder: Path) -> dict[str, Any]:
    """One solo run; its result, command line and pids."""
    return run_busy_solo(spec, 1, folder)


def run_busy_solo(spec: RunSpec, world: int, folder: Path) -> dict[str, Any]:
    """One solo run beside ``world - 1`` neighbours (ranks 1.., ``spec``'s slow rank slowed);
    its result, the command lines and pids. ``world`` 1 is the plain solo run."""
    solo = [sys.executable, str(HERE), "solo", *spec.args()]
    neighbours = [
        [sys.executable, str(HERE), "neighbour", f"--rank={rank}", *spec.args()]
        for rank in range(1, world)
    ]
    with Processes() as processes:
        processes.start(solo, folder / "solo.log")  # children[0]: the one with the result
        for rank, command in enumerate(neighbours, start=1):
            processes.start(command, folder / f"neighbour{rank}.log")
        result = wait_for_result(processes, spec, "solo")
    return {"result": result, "commands": [solo, *neighbours], "pids": processes.pids}


def run_ddp(spec: RunSpec, world: int, folder: Path) -> dict[str, Any]:
    """One DDP run of ``world`` ranks; rank 0's result, the command lines and pids."""
    from torch._C._distributed_c10d import TCPStore

    store = TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    base = [sys.executable, str(HERE), "ddp", f"--world={world}", f"--port={store.port}"]
    commands = [[*base, f"--rank={r}", *spec.args()] for r in range(world)]
    with Processes() as processes:
        for rank, command in enumerate(commands):
            processes.start(command, folder / f"ddp{rank}.log")
        result = wait_for_result(processes, spec, "ddp")
    del store
    return {"result": result, "commands": commands, "pids": processes.pids}


def main(argv: Sequence[str]) -> int:
    spec, rest = parse_spec(argv)
    parser = argparse.ArgumentParser(
        description="a solo, neighbour or DDP process of the quality bench"
    )
    parser.add_argument("mode", choices=("solo", "neighbour", "ddp"))
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(rest)
    if args.mode == "solo":
        solo_main(spec)
    elif args.mode == "neighbour":
        neighbour_main(spec, args.rank)
    else:
        ddp_main(spec, args.rank, args.world, args.port)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
