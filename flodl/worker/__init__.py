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

Importing this package does not import torch: its names load on first use (``join`` and the
rest import the backend, and torch with it), so ``flodl worker`` checks its flags and hands over
to the script, which imports torch once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_HOMES = {
    "Assignment": "flodl.worker.runtime",
    "Rank": "flodl.worker.facade",
    "TrainingBatch": "flodl.worker.facade",
    "Worker": "flodl.worker.runtime",
    "WorkerConfig": "flodl.worker.config",
    "join": "flodl.worker.facade",
    "open_worker": "flodl.worker.runtime",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'flodl.worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # found once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
