"""One flodl rank of the throughput bench (started by ``flodl run`` / ``launch``).

Trains :mod:`training_task` with ``flodl.worker.join`` and reports into the run summary
(``final_metrics``): test accuracy, samples trained, and unix timestamps of the first batch
handed out and of the end of the loop (the bench's training window), plus the seconds this
rank waited for its first batch (start-up: other ranks still importing torch / connecting).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch
from training_task import accuracy, build_model, load_data, parse_task, train_step

import flodl.worker
from flodl.errors import FlodlError, ShutdownRequested


def main(argv: Sequence[str]) -> int:
    task, _ = parse_task(argv)
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_data(task.seed)
    model = build_model(task)
    optimizer = torch.optim.Adam(model.parameters(), lr=task.lr)
    samples = 0
    first_batch_unix = 0.0
    try:
        with flodl.worker.join(model, optimizer) as rank:
            factor = task.slow_factor if rank.rank == task.slow_rank else 1.0
            joined = time.time()
            batches = rank.batches(len(x_train), task.batch_size, task.epochs)
            for batch in batches:
                if not first_batch_unix:
                    first_batch_unix = time.time()
                loss = train_step(
                    model, optimizer, x_train[batch.indices], y_train[batch.indices], factor
                )
                samples += len(batch.indices)
                batch.done(loss)
            loop_end_unix = time.time()
            rank.report_final(
                test_accuracy=accuracy(model, x_test, y_test),
                samples=samples,
                first_batch_unix=first_batch_unix,
                loop_end_unix=loop_end_unix,
                startup_wait_s=first_batch_unix - joined,
            )
    except ShutdownRequested as stop:
        print(f"flodl: {stop}", file=sys.stderr, flush=True)
        return 1  # the bench expects a completed run
    except FlodlError as err:
        print(f"flodl: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
