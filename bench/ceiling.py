"""The ceiling of the throughput bench: the same ranks training with no communication at all.

:class:`Ceiling` starts ``world`` copies of this file at once on this machine. Each trains
its own copy of the :mod:`training_task` model on the digits training set (its own seeded
epoch order), ``task.batch_size`` samples a step, the slow rank made slower exactly as on the
other sides (:func:`training_task.train_step`), and never talks to another rank: no averaging,
no coordinator, no collective. What they train together per second is what ``world``
processes of these speeds can train on this machine, the figure a data-parallel run is set
against (``goodput_vs_ceiling``).

Every rank is a process in a session of its own, as ``flodl run`` starts its ranks: with the
kernel's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) a session is a
scheduling group, so ranks in one session would share one group's CPU against the machine's
other work, where flodl's ranks get one each.

Start-up is kept out of the window the same way as on the flodl and DDP sides: every process
imports torch, loads the data and builds its model, then says ``ready`` and waits. Training
happens in *segments*: the parent hands every rank one shared deadline and they train until
it, each finishing the step in flight, then report and wait again (blocked on a read, using
no CPU). A segment's window is the flodl side's: first batch on any rank to the end of the
last rank's loop. The bench runs one segment before the flodl run and one after it, so a
change of the machine's load during the row weighs on both sides alike.
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
from types import TracebackType
from typing import Any

import torch
from training_task import TaskConfig, accuracy, build_model, load_data, parse_task, train_step

HERE = Path(__file__).resolve()
READY = "ready"
STOP = "stop"


def rank_main(rank: int, task: TaskConfig) -> None:
    """Get ready; then for each deadline read on stdin train until it and print a report of
    the segment (one JSON line); on ``stop`` print the test accuracy and return."""
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_data(task.seed)
    model = build_model(task)
    optimizer = torch.optim.Adam(model.parameters(), lr=task.lr)
    factor = task.slow_factor if rank == task.slow_rank else 1.0
    epoch, position = 0, 0
    order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(task.seed))
    print(READY, flush=True)
    for line in sys.stdin:
        if line.strip() == STOP:
            break
        deadline = float(line)
        samples = batches = 0
        first_batch_unix = time.time()
        while True:
            if position >= len(order):
                epoch, position = epoch + 1, 0
                seed = task.seed + 1000 * rank + epoch
                order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(seed))
            idx = order[position : position + task.batch_size]
            position += len(idx)
            train_step(model, optimizer, x_train[idx], y_train[idx], factor)
            samples += len(idx)
            batches += 1
            if time.time() >= deadline:
                break
        segment = {
            "rank": rank,
            "samples": samples,
            "batches": batches,
            "first_batch_unix": first_batch_unix,
            "loop_end_unix": time.time(),
        }
        print(json.dumps(segment), flush=True)
    print(json.dumps({"rank": rank, "test_accuracy": accuracy(model, x_test, y_test)}), flush=True)


class Ceiling:
    """``world`` independent ranks of ``task``, started and ready; train with :meth:`segment`.

    A context manager: every process started here has exited when the block is left (those
    still running after ``timeout`` seconds are killed). :attr:`test_accuracy` holds each
    rank's test accuracy once the block ended without an error.
    """

    def __init__(self, task: TaskConfig, world: int, timeout: float = 300.0) -> None:
        self.task = task
        self.world = world
        self.timeout = timeout
        self.test_accuracy: list[float] = []
        self._processes: list[subprocess.Popen[str]] = []

    def __enter__(self) -> Ceiling:
        command = [sys.executable, str(HERE), *self.task.args()]
        for rank in range(self.world):
            self._processes.append(
                subprocess.Popen(
                    [*command, f"--rank={rank}"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        try:
            for rank in range(self.world):
                self._expect(rank, READY)
        except BaseException:
            self._kill()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc is None:
                self._send(STOP)
                self.test_accuracy = [
                    float(self._report(rank)["test_accuracy"]) for rank in range(self.world)
                ]
                deadline = time.monotonic() + self.timeout
                for rank, process in enumerate(self._processes):
                    code = process.wait(timeout=max(deadline - time.monotonic(), 1.0))
                    if code != 0:
                        raise RuntimeError(f"ceiling rank {rank} exited with {code}")
        finally:
            self._kill()

    def segment(self, duration_s: float) -> list[dict[str, Any]]:
        """Every rank trains from now for ``duration_s`` (one shared deadline); their reports,
        by rank: samples, batches, first_batch_unix, loop_end_unix."""
        self._send(repr(time.time() + duration_s))
        return [self._report(rank) for rank in range(self.world)]

    def _send(self, line: str) -> None:
        for process in self._processes:
            assert process.stdin is not None
            process.stdin.write(line + "\n")
            process.stdin.flush()

    def _line(self, rank: int) -> str:
        process = self._processes[rank]
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line:
            process.kill()
            _, err = process.communicate()
            raise RuntimeError(f"ceiling rank {rank} ended (exit {process.returncode}):\n{err}")
        return line.strip()

    def _expect(self, rank: int, what: str) -> None:
        line = self._line(rank)
        if line != what:
            raise RuntimeError(f"ceiling rank {rank}: expected {what!r}, got {line!r}")

    def _report(self, rank: int) -> dict[str, Any]:
        report: dict[str, Any] = json.loads(self._line(rank))
        return report

    def _kill(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                process.kill()
            process.communicate()


def main(argv: Sequence[str]) -> int:
    task, rest = parse_task(argv)
    parser = argparse.ArgumentParser(description="one rank of the no-communication ceiling")
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args(rest)
    rank_main(args.rank, task)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
