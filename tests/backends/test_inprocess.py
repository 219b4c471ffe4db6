"""Backends driven from one trio run: several real gloo groups over loopback in one process.

Fast checks of the API paths (join, average, background EASGD, cancel, re-form, close); the
multi-process tests show the same across real processes.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import pytest
import torch
import trio

from flodl.backends.gloo import GlooBackend
from flodl.backends.nccl import NcclBackend, nccl_usable
from flodl.errors import BackendError, CollectiveAborted


@pytest.fixture
async def pair() -> AsyncIterator[list[GlooBackend]]:
    backends = [GlooBackend(op_timeout=1.0, join_timeout=10.0, verify_every=1) for _ in range(2)]
    try:
        yield backends
    finally:
        for backend in backends:
            await backend.close()


async def form(backends: Sequence[GlooBackend | NcclBackend], generation: int) -> None:
    info = backends[0].prepare_group(generation, "127.0.0.1")
    async with trio.open_nursery() as nursery:
        for rank, backend in enumerate(backends):
            nursery.start_soon(backend.join_group, info, rank, len(backends), generation)


@asynccontextmanager
async def gloo_group(size: int) -> AsyncIterator[list[GlooBackend]]:
    """``size`` gloo backends formed into generation 0 in this trio run; closed on exit."""
    backends = [GlooBackend(op_timeout=5.0, join_timeout=10.0) for _ in range(size)]
    try:
        await form(backends, 0)
        yield backends
    finally:
        for backend in backends:
            await backend.close()


def model(value: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.full((4,), value), torch.full((2, 3), value)], [torch.full((2,), value * 10)]


async def average_all(
    backends: Sequence[GlooBackend],
    models: list[tuple[list[torch.Tensor], list[torch.Tensor]]],
    batches: list[int],
) -> None:
    async with trio.open_nursery() as nursery:
        for backend, (params, buffers), n in zip(backends, models, batches, strict=True):
            nursery.start_soon(backend.average, params, buffers, n)


async def test_world_of_one_keeps_its_values_and_reports_mass() -> None:
    backend = GlooBackend(op_timeout=2.0, verify_every=1)
    try:
        await form([backend], 0)
        params, buffers = model(3.0)
        result = await backend.average(params, buffers, batches=5)
        assert (result.total_mass, result.movers, result.skipped) == (5.0, 1, False)
        assert result.divergence == 0.0 and torch.equal(params[0], torch.full((4,), 3.0))
        skipped = await backend.average(params, buffers, batches=0)
        assert skipped.skipped and skipped.total_mass == 0.0
    finally:
        await backend.close()


async def test_two_groups_average_by_mass(pair: list[GlooBackend]) -> None:
    await form(pair, 0)
    models = [model(1.0), model(3.0)]
    await average_all(pair, models, [1, 3])
    for params, buffers in models:
        assert all(torch.equal(p, torch.full_like(p, 2.5)) for p in params)  # (1 + 9) / 4
        assert torch.equal(buffers[0], torch.full((2,), 20.0))  # movers: plain mean


async def test_background_round_blends_with_easgd(pair: list[GlooBackend]) -> None:
    await form(pair, 0)
    models = [model(1.0), model(3.0)]
    async with trio.open_nursery() as nursery:
        pendings = [
            await backend.start_background_average(nursery, params, buffers, 1)
            for backend, (params, buffers) in zip(pair, models, strict=True)
        ]
        for params, _ in models:  # keep training while the collective runs
            for p in params:
                p.add_(0.5)
        for pending in pendings:
            await pending.wait()
    results = [
        pending.blend_into(params, buffers, alpha=0.5)
        for pending, (params, buffers) in zip(pendings, models, strict=True)
    ]
    # average of the snapshots is 2.0; live values 1.5 and 3.5 are pulled halfway
    assert all(torch.equal(p, torch.full_like(p, 1.75)) for p in models[0][0])
    assert all(torch.equal(p, torch.full_like(p, 2.75)) for p in models[1][0])
    assert all(torch.equal(b[0], torch.full((2,), 20.0)) for _, b in models)  # overwritten
    assert results[0].total_mass == 2.0
    with pytest.raises(BackendError, match="already blended"):
        pendings[0].blend_into(*models[0])


async def test_cancelled_round_leaves_live_params_untouched_then_regroups(
    pair: list[GlooBackend],
) -> None:
    await form(pair, 0)
    params, buffers = model(1.0)
    with trio.move_on_after(0.2) as scope:  # peer never enters: only the cancel gets us out
        await pair[0].average(params, buffers, 4)
    assert scope.cancelled_caught
    assert all(torch.equal(p, torch.full_like(p, 1.0)) for p in params)
    assert pair[0].broken and not pair[1].broken
    with pytest.raises(CollectiveAborted, match="broken"):
        await pair[0].average(params, buffers, 4)
    await form(pair, 1)
    assert pair[0].generation == 1 and not pair[0].broken
    models = [(params, buffers), model(3.0)]
    await average_all(pair, models, [1, 1])
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for m in models for p in m[0])


async def test_abandoned_background_round_fails_cleanly(pair: list[GlooBackend]) -> None:
    await form(pair, 0)
    params, buffers = model(1.0)
    async with trio.open_nursery() as nursery:
        pending = await pair[0].start_background_average(nursery, params, buffers, 2)
        await trio.sleep(0.1)
        assert not pending.landed
        pending.abandon()
        await pending.wait()
    with pytest.raises(CollectiveAborted):
        pending.blend_into(params, buffers)
    assert pair[0].broken
    assert all(torch.equal(p, torch.full_like(p, 1.0)) for p in params)


async def test_group_formation_is_validated(pair: list[GlooBackend]) -> None:
    params, buffers = model(1.0)
    with pytest.raises(BackendError, match="not joined"):
        await pair[0].average(params, buffers, 1)
    info = pair[0].prepare_group(0, "127.0.0.1")
    with pytest.raises(BackendError, match="not in range"):
        await pair[0].join_group(info, 2, 2, 0)
    with pytest.raises(BackendError, match=r"not valid CBOR|must be a map"):
        await pair[0].join_group(b"junk", 0, 2, 0)
    await form(pair, 3)
    with pytest.raises(BackendError, match="not newer"):
        await pair[0].join_group(info, 0, 2, 3)


NO_NCCL = "needs a torch build with NCCL and a CUDA device (CPU-only here)"


@pytest.mark.gpu
@pytest.mark.skipif(not nccl_usable(), reason=NO_NCCL)
async def test_nccl_world_of_one_averages_on_the_gpu() -> None:
    backend = NcclBackend(op_timeout=30.0, verify_every=1)
    try:
        await form([backend], 0)
        params = [torch.full((5,), 2.0, device=backend.device)]
        buffers = [torch.full((2,), 4.0, device=backend.device)]
        result = await backend.average(params, buffers, batches=3)
        assert result.total_mass == 3.0 and result.divergence == 0.0
        assert torch.equal(params[0].cpu(), torch.full((5,), 2.0))
    finally:
        await backend.close()


@pytest.mark.gpu
@pytest.mark.skipif(
    not nccl_usable() or torch.cuda.device_count() < 2, reason=NO_NCCL + " (two devices)"
)
async def test_nccl_two_devices_average_and_survive_a_cancel() -> None:
    backends = [NcclBackend(device=i, op_timeout=30.0, verify_every=1) for i in range(2)]
    try:
        await form(backends, 0)
        models = [
            ([torch.full((8,), float(v), device=b.device)], [torch.zeros(1, device=b.device)])
            for v, b in ((1, backends[0]), (3, backends[1]))
        ]
        async with trio.open_nursery() as nursery:
            for b, (p, bufs), n in zip(backends, models, [1, 3], strict=True):
                nursery.start_soon(b.average, p, bufs, n)
        for p, _ in models:
            assert torch.equal(p[0].cpu(), torch.full((8,), 2.5))
        with trio.move_on_after(0.5):  # peer absent: abort the communicator
            await backends[0].average(*models[0], 1)
        assert backends[0].broken
        assert torch.equal(models[0][0][0].cpu(), torch.full((8,), 2.5))
        await form(backends, 1)
        async with trio.open_nursery() as nursery:
            for b, (p, bufs), n in zip(backends, models, [1, 1], strict=True):
                nursery.start_soon(b.average, p, bufs, n)
        assert torch.equal(models[1][0][0].cpu(), torch.full((8,), 2.5))
    finally:
        for b in backends:
            await b.close()


async def test_gloo_group_outlives_the_generators_store(pair: list[GlooBackend]) -> None:
    """Design check: once formed, a gloo group needs no store (the backend keeps it anyway)."""
    await form(pair, 0)
    pair[0]._hosted.clear()  # drop the master store server of generation 0
    gc.collect()
    models = [model(1.0), model(3.0)]
    for _ in range(2):
        await average_all(pair, models, [1, 1])
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for m in models for p in m[0])
