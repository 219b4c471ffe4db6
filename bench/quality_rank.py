"""One flodl rank of the time-to-quality bench (started by ``flodl run``, never by hand).

Every rank builds the workload of :mod:`quality_task` (the same data and initial parameters),
joins the run with ``flodl.worker.join(model, optimizer)`` and trains the batches
``rank.batches(...)`` hands it; rank ``--slow-rank`` sleeps ``(factor - 1)`` x each step's
compute after the step. Rank 0 (a fast rank) keeps the run's :class:`~quality_task.BudgetClock`:
it evaluates its current model on the validation set before its first batch (t = 0) and every
``budget / points`` seconds of training after a batch is done (off the clock: averaging
happens only inside ``rank.batches()``, so it evaluates its own parameters as they are between
two batches), and once the budget is spent it takes the last point, writes ``result.json``
and ends the run (:func:`end_run`: ``rank.stop``). Every rank trains what it was handed until
``rank.batches()`` ends (the rest of the window, then a last round), and exits 0.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch
from quality_task import BudgetClock, build_task, parse_spec, train_step, write_pid, write_result

import flodl.worker
from flodl.errors import FlodlError, ShutdownRequested

EPOCHS = 10_000
"""More epochs than any budget trains: the run ends by :func:`end_run`, never by running out."""


def end_run(rank: flodl.worker.Rank) -> None:
    """End the whole run once rank 0's budget is spent: nothing more is handed out, the rest of
    the window is trained and averaged, and every rank's ``rank.batches()`` ends."""
    rank.stop("training budget spent")


def main(argv: Sequence[str]) -> int:
    spec, _ = parse_spec(argv)
    write_pid(spec, f"rank{os.environ.get('RANK', '')}")
    torch.set_num_threads(1)
    task = build_task(spec.workload, spec.seed)
    clock = BudgetClock(spec.budget_s, spec.points)
    steps = samples = 0
    try:
        with flodl.worker.join(task.model, task.optimizer) as rank:
            factor = spec.factor(rank.rank)
            keeper = rank.rank == 0
            if keeper:
                clock.evaluate(task.validation_loss, step=0)  # the initial (joined) model
            ended = False
            for batch in rank.batches(task.dataset_size, task.batch_size, EPOCHS):
                clock.start()
                loss = train_step(task, torch.tensor(batch.indices), factor)
                batch.done(loss)
                if ended:
                    continue
                steps += 1
                samples += len(batch.indices)
                if keeper and clock.tick(task, step=steps, global_step=rank.global_step):
                    ended = True
                    write_result(
                        spec,
                        clock,
                        steps=steps,
                        samples=samples,
                        global_step=rank.global_step,
                        train_loss=loss,
                    )
                    end_run(rank)
    except ShutdownRequested as stop:  # a save-and-stop (SIGTERM to flodl run): saved
        print(f"flodl: {stop}", file=sys.stderr, flush=True)
        return 0
    except FlodlError as err:
        print(f"flodl: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
