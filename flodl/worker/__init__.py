"""The rank runtime used from a training script: a sync facade and an async API.

Sync (plain torch loop; trio runs in a background thread)::

    import flodl.worker

    with flodl.worker.join(model, optimizer) as rank:
        for batch in rank.batches(dataset_size=len(X), batch_size=32, epochs=10):
            ...
            batch.done(loss)
        rank.report_final(test_accuracy=acc)

Async::

    async with open_worker(WorkerConfig.from_env(), model, optimizer) as worker:
        await worker.announce(dataset_size, batch_size, epochs)
        while (item := await worker.next_batch()) is not None:
            ...
            await worker.batch_done(loss)

Importing this package imports torch; ``import flodl`` and the ``flodl`` command (but for
``flodl worker``) do not.
"""

from flodl.worker.config import WorkerConfig
from flodl.worker.facade import Rank, TrainingBatch, join
from flodl.worker.runtime import Assignment, Worker, open_worker

__all__ = [
    "Assignment",
    "Rank",
    "TrainingBatch",
    "Worker",
    "WorkerConfig",
    "join",
    "open_worker",
]
