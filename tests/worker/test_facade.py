"""The synchronous facade (``flodl.worker.join``) in a plain training loop on this thread.

The coordinator runs in a trio run of its own on another thread (as it would in another
process), over TCP on 127.0.0.1; the facade starts its own trio thread, as in a real rank.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import trio

from flodl.config import CoordinatorConfig
from flodl.coordinator.server import Coordinator, open_coordinator
from flodl.core.coordinator.machine import Status
from flodl.errors import ConfigError
from flodl.worker import WorkerConfig, join

KEY = b"worker-facade-test-key-0123456789abcdef"
DATASET, BATCH, EPOCHS = 64, 8, 2


@contextmanager
def coordinator_thread(world_size: int) -> Iterator[tuple[str, list[Coordinator]]]:
    """A coordinator on tcp://127.0.0.1 in a thread of its own; yields its URL."""
    urls: queue.Queue[str] = queue.Queue()
    served: list[Coordinator] = []
    config = CoordinatorConfig(heartbeat_interval=0.2, heartbeat_timeout=5.0, anchor=2)

    async def serve() -> None:
        with trio.fail_after(60):
            async with open_coordinator("tcp://127.0.0.1:0", world_size, KEY, config) as coord:
                served.append(coord)
                urls.put(coord.url)
                await coord.wait_finished()

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    try:
        yield urls.get(timeout=10), served
    finally:
        thread.join(timeout=30)
        assert not thread.is_alive(), "the coordinator did not finish"


def facade_config(url: str, run_dir: Path) -> WorkerConfig:
    """Rank 0 of a world of one, on gloo, for the coordinator at ``url``."""
    return WorkerConfig(
        coordinator=url,
        session_key=KEY,
        rank=0,
        world_size=1,
        backend="gloo",
        heartbeat_interval=0.2,
        heartbeat_timeout=5.0,
        run_dir=run_dir,
    )


def test_a_plain_loop_trains_every_sample_and_done_does_not_wait(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(DATASET, 4)
    y = x.sum(dim=1, keepdim=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen: list[tuple[int, int]] = []
    with coordinator_thread(1) as (url, served):
        config = facade_config(url, tmp_path)
        with join(model, optimizer, config) as rank:
            for batch in rank.batches(DATASET, BATCH, EPOCHS):
                seen.extend((batch.epoch, i) for i in batch.indices)
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x[batch.indices]), y[batch.indices])
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                batch.done(loss)
                with pytest.raises(ConfigError, match="done twice"):
                    batch.done(loss)  # refused at once, on this thread
            rank.report_final(done=1.0)
    coordinator = served[0]
    assert coordinator.machine.outcome.status is Status.COMPLETED
    for epoch in range(EPOCHS):
        assert sorted(i for e, i in seen if e == epoch) == list(range(DATASET))
    # Every batch was reported exactly once, in order, with its loss.
    assert coordinator.machine.stats[0].batches == EPOCHS * DATASET // BATCH
    results = coordinator.machine.epoch_results
    assert [r["samples"] for r in results] == [DATASET] * EPOCHS
    assert all(r["avg_loss"] > 0 for r in results)


def test_batch_averaged_marks_the_first_batch_after_each_average(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    marks: list[bool] = []
    with coordinator_thread(1) as (url, _served):
        config = facade_config(url, tmp_path)
        with join(model, optimizer, config) as rank:
            for batch in rank.batches(DATASET, BATCH, EPOCHS):
                marks.append(batch.averaged)
                batch.done(0.0)
            syncs = rank.worker.averages
    assert marks[0], "the run's first round comes before the first batch"
    # Every round but the last (which ends the run after the last batch) precedes a batch,
    # and one batch only: the mark is exact, not a batch late.
    assert sum(marks) == syncs - 1
    assert syncs > 2 and len(marks) == EPOCHS * DATASET // BATCH
