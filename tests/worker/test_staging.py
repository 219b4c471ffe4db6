"""The staged next batch: taken without a boundary only while nothing needs one."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import trio

from flodl.backends.gloo import GlooBackend
from flodl.wire.messages import Checkpoint, CheckpointResult, Ready, StartEpoch
from flodl.worker import open_worker
from flodl.worker.staging import StagedBatch
from tests.worker.test_inprocess import BATCH, DATASET, EPOCHS, Peer, make_model, worker_config
from tests.worker.test_inprocess import scripted_coordinator as scripted


def test_a_reserved_batch_is_taken_once_unless_invalidated_first() -> None:
    staged: StagedBatch[str] = StagedBatch()
    assert staged.take() is None and not staged.reserved
    staged.offer("b1")
    assert staged.reserved
    with pytest.raises(RuntimeError):
        staged.offer("b2")  # one at a time
    assert staged.take() == "b1" and staged.take() is None
    assert staged.claim_taken() == "b1" and staged.claim_taken() is None
    staged.offer("b2")
    staged.invalidate()  # say a SyncNow arrived: the boundary must come first
    assert staged.take() is None and staged.reserved
    assert staged.reclaim() == "b2" and not staged.reserved  # the boundary hands it out


def test_takes_from_many_threads_hand_each_batch_out_once() -> None:
    staged: StagedBatch[int] = StagedBatch()
    got: list[int] = []
    lock = threading.Lock()

    def taker() -> None:
        for _ in range(2000):
            if (batch := staged.take()) is not None:
                with lock:
                    got.append(batch)

    threads = [threading.Thread(target=taker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for n in range(500):
        while staged.reserved:  # the takers empty it
            if staged.reclaim() is not None:
                got.append(-1)  # reclaimed instead: still handed out once
        staged.offer(n)
    for thread in threads:
        thread.join()
    if (last := staged.reclaim()) is not None:
        got.append(last)
    taken = [b for b in got if b >= 0]
    assert len(taken) == len(set(taken))
    assert len(got) == 500


async def test_a_message_that_needs_a_boundary_stops_the_next_batch_being_taken(
    tmp_path: Path,
) -> None:
    pytest.importorskip("safetensors")

    async def script(peer: Peer) -> None:
        await peer.expect(Ready)
        await peer.channel.send(StartEpoch(epoch=0, partition_offset=0, partition_size=4 * BATCH))
        await peer.mark.wait()
        await peer.channel.send(Checkpoint(version=1, target_rank=0))
        await peer.expect(CheckpointResult)
        await trio.sleep_forever()

    async with scripted(script) as coordinator:
        config = worker_config(coordinator.url, 0, 1, tmp_path)
        with trio.fail_after(20):
            async with open_worker(config, make_model(0), backend=GlooBackend()) as worker:
                await worker.announce(DATASET, BATCH, EPOCHS)
                first = await worker.next_batch()  # through the boundary; the next is staged
                assert first is not None and first.start == 0
                await worker.batch_done(0.5)
                second = worker.take_staged()  # no boundary needed: taken directly
                assert second is not None and second.start == BATCH
                worker.absorb_taken()
                await worker.batch_done(0.4)
                coordinator.mark.set()
                peer = await coordinator.connection()
                while not worker.machine.queued:  # the Checkpoint has arrived and waits
                    await trio.sleep(0.01)
                assert worker.take_staged() is None  # it needs a boundary first
                third = await worker.next_batch()  # saves, then hands the reserved batch out
                assert third is not None and third.start == 2 * BATCH
                await peer.expect(CheckpointResult)
    assert worker.machine.batches == 2
