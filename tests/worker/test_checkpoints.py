"""A script's checkpoint requests and the bundles a rank keeps: in one process, real gloo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trio

from flodl.backends.gloo import GlooBackend
from flodl.checkpoint import find_latest, load_bundle
from flodl.wire.messages import (
    Checkpoint,
    CheckpointResult,
    Intent,
    IntentKind,
    Ready,
    Shutdown,
    StartEpoch,
)
from flodl.worker import join, open_worker
from tests.worker.test_facade import coordinator_thread, facade_config
from tests.worker.test_inprocess import (
    BATCH,
    DATASET,
    EPOCHS,
    Peer,
    make_model,
    scripted_coordinator,
    worker_config,
)


def bundle_stems(directory: Path) -> list[str]:
    return sorted(p.name.removesuffix(".meta.json") for p in directory.glob("*.meta.json"))


async def test_request_checkpoint_sends_an_intent_and_only_the_newest_bundles_stay(
    tmp_path: Path,
) -> None:
    pytest.importorskip("safetensors")

    async def ask_three_saves(peer: Peer) -> None:
        await peer.expect(Ready)
        await peer.channel.send(StartEpoch(epoch=0, partition_offset=0, partition_size=BATCH))
        await peer.expect(Intent)
        for version in (1, 2, 3):
            await peer.channel.send(Checkpoint(version=version, target_rank=0))
            await peer.expect_many(CheckpointResult, version)
        await peer.channel.send(Shutdown())

    directory = tmp_path / "checkpoints" / "rank0"
    directory.mkdir(parents=True)
    (directory / "mine.meta.json").write_text("{}")  # not flodl's: never removed
    async with scripted_coordinator(ask_three_saves) as scripted:
        config = worker_config(scripted.url, 0, 1, tmp_path, keep_checkpoints=2)
        with trio.fail_after(20):
            async with open_worker(config, make_model(0), backend=GlooBackend()) as worker:
                await worker.announce(DATASET, BATCH, EPOCHS)
                await worker.request_checkpoint()
                while await worker.next_batch() is not None:
                    await worker.batch_done(0.5)
    intents = [m for m in scripted.received if isinstance(m, Intent)]
    assert intents == [Intent(rank=0, kind=IntentKind.CHECKPOINT_NOW)]
    results = [m for m in scripted.received if isinstance(m, CheckpointResult)]
    assert [(r.version, r.error) for r in results] == [(1, None), (2, None), (3, None)]
    assert bundle_stems(directory) == [
        "flodl-step000000000-v000002",
        "flodl-step000000000-v000003",
        "mine",
    ]
    latest = find_latest(directory)
    assert latest is not None and latest.name == "flodl-step000000000-v000003"
    assert load_bundle(latest).meta.save_reason == "CHECKPOINT"
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert len(report["checkpoint_ms"]) == 3
    assert all(ms > 0 for ms in report["checkpoint_ms"])


def test_the_facade_asks_for_a_checkpoint_and_the_run_ends_with_the_final_model_saved(
    tmp_path: Path,
) -> None:
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    x = torch.randn(DATASET, 3)
    y = x.sum(dim=1, keepdim=True)
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with coordinator_thread(1) as (url, _served):
        config = facade_config(url, tmp_path)
        with join(model, optimizer, config) as rank:
            for i, batch in enumerate(rank.batches(DATASET, BATCH, EPOCHS)):
                if i == 0:
                    rank.request_checkpoint()
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x[batch.indices]), y[batch.indices])
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                batch.done(loss)
    directory = tmp_path / "checkpoints" / "rank0"
    stems = bundle_stems(directory)
    assert len(stems) == 2  # the one asked for, then the final one
    final = load_bundle(directory)
    assert final.meta.save_reason == "CHECKPOINT"
    assert final.meta.global_step == EPOCHS * DATASET // BATCH
    assert final.path.name == stems[-1]
    for name, tensor in model.state_dict().items():
        assert torch.equal(final.model_state[name], tensor)
