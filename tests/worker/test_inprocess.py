"""Workers and a real coordinator in one trio run: memory transport, real gloo groups.

Fast checks of the protocol paths (every policy runs to completion, samples are covered
once per epoch, averages leave identical parameters), then scripted coordinators for the
paths a healthy run never takes (silence, a cut connection, save-and-stop, checkpoint).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio

from flodl.backends.gloo import GlooBackend
from flodl.config import CoordinatorConfig
from flodl.coordinator.server import open_coordinator
from flodl.core.common.policy import Policy
from flodl.core.coordinator.machine import Outcome, Status
from flodl.errors import CheckpointError, CoordinatorError, FlodlError, ShutdownRequested
from flodl.transports import open_listener
from flodl.transports.channel import Channel
from flodl.transports.greeting import accept_rank
from flodl.wire.messages import (
    Batch,
    Batches,
    Checkpoint,
    CheckpointResult,
    DeclareDead,
    Exiting,
    Heartbeat,
    Message,
    NewGroupReady,
    NewGroupSession,
    Note,
    Ready,
    RequestNewGroup,
    SaveReason,
    SetGlobalStep,
    ShutdownWithSave,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
)
from flodl.worker import Assignment, WorkerConfig, open_worker
from flodl.worker.persist import SavePoint, save_rank_bundle
from flodl.worker.records import tensors_sha256

KEY = b"worker-inprocess-test-key-0123456789"
DATASET, BATCH, EPOCHS = 48, 4, 2
_names = itertools.count()


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def worker_config(url: str, rank: int, world: int, run_dir: Path, **kw: object) -> WorkerConfig:
    settings: dict[str, object] = {
        "backend": "gloo",
        "heartbeat_timeout": 5.0,
        "heartbeat_interval": 0.2,
        "op_timeout": 5.0,
        "run_dir": run_dir,
        "debug_param_hashes": True,
        **kw,
    }
    return WorkerConfig(
        coordinator=url,
        session_key=KEY,
        rank=rank,
        world_size=world,
        **settings,  # type: ignore[arg-type]
    )


async def train(
    config: WorkerConfig, model: torch.nn.Module, seen: list[tuple[int, int]]
) -> dict[str, object]:
    """A plain training loop over the async API; returns the rank's report."""
    x = torch.linspace(-1, 1, DATASET * 3).reshape(DATASET, 3)
    y = x.sum(dim=1, keepdim=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    async with open_worker(config, model, optimizer) as worker:
        await worker.announce(DATASET, BATCH, EPOCHS)
        while (item := await worker.next_batch()) is not None:
            seen.extend((item.epoch, i) for i in item.indices)
            idx = list(item.indices)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            await worker.batch_done(loss.item())
        worker.report_final(done=1.0)
    report: dict[str, object] = json.loads((config.run_dir / f"rank{config.rank}.json").read_text())
    return report


async def run_two_ranks(
    tmp_path: Path,
    coordinator_config: CoordinatorConfig,
    train_rank: Callable[[WorkerConfig, torch.nn.Module], Awaitable[dict[str, Any]]],
    **worker: object,
) -> tuple[Outcome, list[dict[str, Any]], list[torch.nn.Module]]:
    """A real coordinator and two workers (models seeded 0 and 1: different starts, so
    averaging matters) in this trio run, each trained by ``train_rank(config, model)`` under
    the coordinator's policy (``worker``: more WorkerConfig settings). The outcome, each
    rank's report and model."""
    url = f"memory://worker-inproc-{next(_names)}"
    models = [make_model(seed=r) for r in range(2)]
    reports: list[dict[str, Any]] = [{}, {}]
    policy = coordinator_config.policy
    with trio.fail_after(60):
        async with open_coordinator(url, 2, KEY, coordinator_config, linger=5.0) as coord:
            async with trio.open_nursery() as nursery:
                for rank in range(2):

                    async def run(rank: int = rank) -> None:
                        config = worker_config(
                            coord.url, rank, 2, tmp_path, policy=policy, **worker
                        )
                        reports[rank] = await train_rank(config, models[rank])

                    nursery.start_soon(run)
            outcome = await coord.wait_finished()
    return outcome, reports, models


@pytest.mark.parametrize("policy", [Policy.SYNC, Policy.CADENCE, Policy.ASYNC])
async def test_two_workers_train_every_sample_once_per_epoch(
    policy: Policy, tmp_path: Path
) -> None:
    coordinator_config = CoordinatorConfig(
        policy=policy, heartbeat_interval=0.2, heartbeat_timeout=5.0, anchor=3
    )
    seen: list[list[tuple[int, int]]] = [[], []]

    async def train_rank(config: WorkerConfig, model: torch.nn.Module) -> dict[str, Any]:
        return await train(config, model, seen[config.rank])

    outcome, reports, models = await run_two_ranks(tmp_path, coordinator_config, train_rank)
    assert outcome.status is Status.COMPLETED, outcome
    for epoch in range(EPOCHS):
        trained = sorted(i for part in seen for e, i in part if e == epoch)
        assert trained == list(range(DATASET)), f"epoch {epoch}"
    assert sum(int(r["batches"]) for r in reports) == EPOCHS * DATASET // BATCH
    for report in reports:
        assert report["exit_reason"] == "completed"
        assert report["final_metrics"] == {"done": 1.0}
        assert int(report["syncs"]) >= 1
        assert report["steps"] == int(report["batches"]) + int(report["syncs"])
        # Time at batch boundaries is split: averaging apart from waiting, never negative.
        idle_s, averaging_s = float(report["idle_s"]), float(report["averaging_s"])
        assert averaging_s > 0.0 and idle_s >= 0.0
        assert idle_s + averaging_s + float(report["startup_s"]) <= float(report["wall_s"])
    if policy is not Policy.ASYNC:
        # Every round left both ranks with bitwise-identical parameters, and the run ends
        # on an average, so the final models are identical too.
        hashes = [{h["round"]: h["sha256"] for h in r["param_hashes"]} for r in reports]
        assert hashes[0] == hashes[1] and hashes[0]
        final = [tensors_sha256(list(m.parameters())) for m in models]
        assert final[0] == final[1]
    else:
        assert not torch.equal(next(models[0].parameters()), next(make_model(seed=0).parameters()))


# --- scripted coordinators --------------------------------------------------------------


class Peer:
    """The coordinator side of one scripted connection: send, and wait for what arrived."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.received: list[Message] = []
        self._arrived = trio.Event()
        self.mark = trio.Event()
        """Set by a script to tell the test it reached a point."""

    async def read(self) -> None:
        try:
            async for message in self.channel:
                self.received.append(message)
                self._arrived.set()
                self._arrived = trio.Event()
        except (FlodlError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def expect(self, kind: type[Message]) -> Message:
        """Wait until a message of ``kind`` has arrived; return the first one."""
        return (await self.expect_many(kind, 1))[0]

    async def expect_many(self, kind: type[Message], count: int) -> list[Message]:
        """Wait until ``count`` messages of ``kind`` have arrived; return them all."""
        while True:
            arrived = self._arrived
            found = [m for m in self.received if isinstance(m, kind)]
            if len(found) >= count:
                return found
            await arrived.wait()


@attrs.define
class Scripted:
    """A scripted coordinator's address, its connection once accepted, and what arrived."""

    url: str
    mark: trio.Event
    received: list[Message]
    accepted: trio.Event = attrs.field(factory=trio.Event)
    peer: Peer | None = None

    async def connection(self) -> Peer:
        await self.accepted.wait()
        assert self.peer is not None
        return self.peer


async def idle(peer: Peer) -> None:
    await trio.sleep_forever()


@asynccontextmanager
async def scripted_coordinator(
    script: Callable[[Peer], Awaitable[None]] = idle,
) -> AsyncIterator[Scripted]:
    """Accept one rank on a memory address and run ``script(peer)`` for it."""
    listener = await open_listener(f"memory://worker-scripted-{next(_names)}")
    scripted = Scripted(url=listener.url, mark=trio.Event(), received=[])
    async with listener, trio.open_nursery() as nursery:

        async def serve() -> None:
            stream = await listener.accept()
            _, channel = await accept_rank(stream, KEY, 1, taken=lambda _r: False)
            peer = Peer(channel)
            peer.mark = scripted.mark
            peer.received = scripted.received
            scripted.peer = peer
            scripted.accepted.set()
            async with trio.open_nursery() as inner:
                inner.start_soon(peer.read)
                await script(peer)
                inner.cancel_scope.cancel()

        nursery.start_soon(serve)
        yield scripted
        nursery.cancel_scope.cancel()


async def test_a_silent_coordinator_ends_the_loop_with_a_death_record(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async def stay_silent(peer: Peer) -> None:
        await trio.sleep_forever()

    async with scripted_coordinator(stay_silent) as scripted:
        url, received = scripted.url, scripted.received
        config = worker_config(url, 0, 1, tmp_path, heartbeat_timeout=30.0, heartbeat_interval=1)
        async with open_worker(config, make_model(0), backend=GlooBackend()) as worker:
            await worker.announce(DATASET, BATCH, EPOCHS)
            started = trio.current_time()
            with pytest.raises(CoordinatorError, match="silent for 30 s"):
                await worker.next_batch()
            assert trio.current_time() - started == pytest.approx(30.0, abs=1.0)
    assert isinstance(received[0], Ready)
    beats = [m for m in received if isinstance(m, Heartbeat)]
    assert len(beats) >= 28  # the rank kept beating while it waited
    record = json.loads((tmp_path / "flodl.rank0.death.json").read_text())
    assert record["rank"] == 0 and record["world_size"] == 1
    assert "silent for 30 s" in record["error"] and record["unix_time_secs"] > 0
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["exit_reason"].startswith("coordinator_lost")


async def test_a_cut_connection_ends_the_loop_with_a_death_record(tmp_path: Path) -> None:
    async def hang_up(peer: Peer) -> None:
        await peer.expect(Ready)
        await peer.channel.aclose()

    async with scripted_coordinator(hang_up) as scripted:
        url = scripted.url
        config = worker_config(url, 0, 1, tmp_path)
        with trio.fail_after(10):
            async with open_worker(config, make_model(0), backend=GlooBackend()) as worker:
                await worker.announce(DATASET, BATCH, EPOCHS)
                with pytest.raises(CoordinatorError, match="lost the connection"):
                    await worker.next_batch()
    record = json.loads((tmp_path / "flodl.rank0.death.json").read_text())
    assert "lost the connection" in record["error"]


async def test_a_rank_that_saved_leaves_its_death_record_beside_its_bundle(
    tmp_path: Path,
) -> None:
    pytest.importorskip("safetensors")

    async def save_then_hang_up(peer: Peer) -> None:
        await peer.expect(Ready)
        await peer.channel.send(StartEpoch(epoch=0, partition_offset=0, partition_size=BATCH))
        await peer.channel.send(Checkpoint(version=7, target_rank=0))
        await peer.expect(CheckpointResult)
        await peer.channel.aclose()

    async with scripted_coordinator(save_then_hang_up) as scripted:
        config = worker_config(scripted.url, 0, 1, tmp_path)
        with trio.fail_after(20):
            async with open_worker(config, make_model(0), backend=GlooBackend()) as worker:
                await worker.announce(DATASET, BATCH, EPOCHS)
                item = await worker.next_batch()
                assert item is not None
                await worker.batch_done(0.5)
                with pytest.raises(CoordinatorError, match="lost the connection"):
                    await worker.next_batch()  # saves at this boundary, then loses the peer
    from flodl.checkpoint import load_bundle

    # The boundary after the loss saved the rank's own weights; both bundles have the record.
    bundle = load_bundle(tmp_path / "checkpoints" / "rank0")
    assert bundle.path.name == "flodl-step000000000-lost"
    assert bundle.meta.save_reason == "COORDINATOR_LOST"
    assert [d.rank for d in bundle.deaths] == [0]  # found by loading the bundle
    assert "lost the connection" in bundle.deaths[0].error
    assert "saved this rank's weights (global step 0" in bundle.deaths[0].error
    earlier = load_bundle(tmp_path / "checkpoints" / "rank0" / "flodl-step000000000-v000007")
    assert [d.rank for d in earlier.deaths] == [0]
    assert not (tmp_path / "flodl.rank0.death.json").exists()


async def test_checkpoint_then_shutdown_with_save(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    model = make_model(0)
    async with scripted_coordinator() as scripted:
        config = worker_config(scripted.url, 0, 1, tmp_path)
        received = scripted.received
        with trio.fail_after(20):
            async with open_worker(config, model, backend=GlooBackend()) as worker:
                await worker.announce(DATASET, BATCH, EPOCHS)
                peer = await scripted.connection()
                send = peer.channel.send
                await send(StartEpoch(epoch=0, partition_offset=0, partition_size=2 * BATCH))
                item = await worker.next_batch()
                assert item is not None and item.size == BATCH
                await send(Checkpoint(version=4, target_rank=5))  # someone else's: ignored
                await send(Checkpoint(version=3, target_rank=0))  # arrives mid-step
                await trio.sleep(0.2)
                assert not any(isinstance(m, CheckpointResult) for m in received)
                await worker.batch_done(0.5)
                item = await worker.next_batch()  # saves first, then hands out batch two
                assert item is not None and item.start == BATCH
                await peer.expect(CheckpointResult)
                await send(ShutdownWithSave(reason=SaveReason.REDUCE_STALL))
                await worker.batch_done(0.25)
                with pytest.raises(ShutdownRequested, match="save and stop: REDUCE_STALL") as info:
                    await worker.next_batch()
                assert info.value.reason is SaveReason.REDUCE_STALL
                with pytest.raises(ShutdownRequested):  # and again on every later call
                    await worker.next_batch()
                await peer.expect(Exiting)
    # The worker coalesces its reports: one per batch, each before what followed it.
    reports = [m for m in received if isinstance(m, Batch | Batches)]
    assert sum(len(m.batch_ms) if isinstance(m, Batches) else 1 for m in reports) == 2
    first_result = next(m for m in received if isinstance(m, CheckpointResult))
    assert received.index(reports[0]) < received.index(first_result)
    results = [m for m in received if isinstance(m, CheckpointResult)]
    assert [(r.version, r.error) for r in results] == [(3, None), (0, None)]  # 0: the stop's
    assert results[1] is received[-3] and results[1].path is not None
    assert Path(results[1].path + ".meta.json").is_file()
    assert isinstance(received[-1], Exiting) and isinstance(received[-2], Note)
    from flodl.checkpoint import load_bundle

    bundle = load_bundle(tmp_path / "checkpoints" / "rank0")
    assert bundle.meta.save_reason == "REDUCE_STALL"
    for name, tensor in model.state_dict().items():
        assert torch.equal(bundle.model_state[name], tensor)
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["exit_reason"] == "shutdown_with_save:REDUCE_STALL"
    assert report["checkpoint"] == str(bundle.path)
    assert math.isfinite(report["wall_s"])


async def test_throttle_pauses_at_the_next_boundary_until_set_global_step(
    tmp_path: Path,
) -> None:
    async with scripted_coordinator() as scripted:
        config = worker_config(scripted.url, 0, 1, tmp_path)
        with trio.fail_after(10):
            async with open_worker(config, make_model(0), backend=GlooBackend()) as worker:
                await worker.announce(DATASET, BATCH, EPOCHS)
                peer = await scripted.connection()
                await peer.channel.send(StartEpoch(epoch=0, partition_offset=0, partition_size=12))
                first = await worker.next_batch()
                assert first is not None and first.start == 0
                await peer.channel.send(Throttle())  # arrives mid-step
                await peer.expect(Heartbeat)
                await worker.batch_done(1.0)
                got: list[Assignment | None] = []
                async with trio.open_nursery() as nursery:

                    async def take() -> None:
                        got.append(await worker.next_batch())

                    nursery.start_soon(take)
                    await trio.sleep(0.3)
                    assert got == []  # throttled: parked at the boundary
                    await peer.channel.send(SetGlobalStep(global_step=7))
    assert worker.global_step == 7
    assert got[0] is not None and got[0].start == BATCH


async def test_sync_now_waits_for_the_boundary_and_dead_groups_are_not_averaged(
    tmp_path: Path,
) -> None:
    async def form(peer: Peer, generation: int) -> None:
        await peer.channel.send(RequestNewGroup(generation=generation, world_size=1))
        while True:
            ready = await peer.expect(NewGroupReady)
            assert isinstance(ready, NewGroupReady)
            if ready.generation == generation:
                break
            peer.received.remove(ready)
        await peer.channel.send(
            NewGroupSession(generation=generation, new_rank=0, new_world_size=1, info=ready.info)
        )

    def acks(received: list[Message]) -> list[SyncAck]:
        return [m for m in received if isinstance(m, SyncAck)]

    model = make_model(0)
    async with scripted_coordinator() as scripted:
        config = worker_config(scripted.url, 0, 1, tmp_path)
        with trio.fail_after(20):
            async with open_worker(config, model, backend=GlooBackend(op_timeout=5)) as worker:
                await worker.announce(DATASET, BATCH, EPOCHS)
                peer = await scripted.connection()
                await form(peer, 0)
                await peer.channel.send(StartEpoch(epoch=0, partition_offset=0, partition_size=16))
                assert await worker.next_batch() is not None
                await peer.channel.send(SyncNow(round=1, generation=0))  # mid-step
                await peer.expect(Heartbeat)
                await trio.sleep(0.2)
                assert acks(scripted.received) == []  # not while the step is running
                await worker.batch_done(1.0)
                assert await worker.next_batch() is not None  # averaged at this boundary
                ack = await peer.expect(SyncAck)
                assert isinstance(ack, SyncAck)
                assert (ack.round, ack.step_count) == (1, 2)  # one batch + one average
                assert ack.divergence == 0.0  # world of one: the average is the model

                # A member died: the round on generation 0 is never run, the redo on 1 is.
                await peer.channel.send(DeclareDead(rank=3))
                await peer.channel.send(SyncNow(round=2, generation=0))
                await worker.batch_done(1.0)
                assert await worker.next_batch() is not None
                await form(peer, 1)
                await peer.channel.send(SyncNow(round=3, generation=1))
                await trio.sleep(0.2)  # delivered before the boundary
                await worker.batch_done(1.0)
                assert await worker.next_batch() is not None
                await peer.expect_many(SyncAck, 2)
                assert [a.round for a in acks(scripted.received)] == [1, 3]
                assert acks(scripted.received)[1].step_count == 5  # 3 batches + 2 averages
                assert [h["generation"] for h in worker.param_hashes] == [0, 1]


async def test_a_rank_resumes_from_the_bundle_it_saved(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    saved = make_model(5)
    optimizer = torch.optim.Adam(saved.parameters())
    saved(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    save_rank_bundle(tmp_path, 0, saved, optimizer, SavePoint(2, 40, 4, 1, "GRACEFUL"))

    fresh = make_model(0)
    fresh_optimizer = torch.optim.Adam(fresh.parameters())
    async with scripted_coordinator() as scripted:
        config = worker_config(scripted.url, 0, 1, tmp_path, resume=tmp_path)
        with trio.fail_after(10):
            async with open_worker(config, fresh, fresh_optimizer, backend=GlooBackend()) as worker:
                assert worker.global_step == 40
    assert tensors_sha256(list(fresh.parameters())) == tensors_sha256(list(saved.parameters()))
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1

    with pytest.raises(CheckpointError, match="not a complete checkpoint bundle"):
        config = worker_config(scripted.url, 0, 1, tmp_path, resume=tmp_path / "nothing")
        async with open_worker(config, fresh, backend=GlooBackend()):
            pass
