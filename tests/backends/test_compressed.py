"""Compressed rounds (``Backend.average_moves``) over real gloo groups in one process: 16-bit
moves from a shared reference leave every rank bitwise identical, close to the full-precision
average, and a zero-mass round keeps every rank's own tensors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import torch
import trio

from flodl.backends import AverageResult
from flodl.backends.gloo import GlooBackend
from tests.backends.test_inprocess import gloo_group

MASSES = [1, 3, 0]


@pytest.fixture
async def ranks() -> AsyncIterator[list[GlooBackend]]:
    async with gloo_group(3) as backends:
        yield backends


def reference() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(64, 8, generator=generator), torch.randn(8, generator=generator)]


def moved(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The reference moved a little, differently on each rank; one float buffer each."""
    generator = torch.Generator().manual_seed(rank + 1)
    params = [r + 0.01 * torch.randn(r.shape, generator=generator) for r in reference()]
    return params, [torch.full((3,), float(rank))]


async def average_all(
    backends: list[GlooBackend],
    models: list[tuple[list[torch.Tensor], list[torch.Tensor]]],
    masses: list[int],
    dtype: torch.dtype,
) -> list[AverageResult]:
    results: list[AverageResult | None] = [None] * len(backends)
    async with trio.open_nursery() as nursery:
        for i, backend in enumerate(backends):

            async def one(i: int = i, backend: GlooBackend = backend) -> None:
                params, buffers = models[i]
                results[i] = await backend.average_moves(
                    params, buffers, reference(), masses[i], dtype
                )

            nursery.start_soon(one)
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
async def test_sixteen_bit_moves_leave_every_rank_identical_near_the_full_average(
    ranks: list[GlooBackend], dtype: torch.dtype
) -> None:
    models = [moved(rank) for rank in range(3)]
    before = [[p.clone() for p in params] for params, _ in models]
    results = await average_all(ranks, models, MASSES, dtype)
    assert {(r.total_mass, r.movers, r.skipped) for r in results} == {(4.0, 2, False)}
    first = models[0][0]
    for params, buffers in models:
        assert all(torch.equal(p, q) for p, q in zip(params, first, strict=True))
        assert torch.equal(buffers[0], torch.full((3,), 0.5))  # the movers' mean: (0 + 1) / 2
    # Close to the mass-weighted average of the parameters in full precision: the moves (about
    # 0.01) are 16-bit, so off by at most a few of their ulps; the reference is exact.
    tolerance = 0.1 * torch.finfo(dtype).eps
    for i, p in enumerate(first):
        exact = (1 * before[0][i] + 3 * before[1][i]) / 4
        torch.testing.assert_close(p, exact, rtol=0, atol=tolerance)
        assert not torch.equal(p, before[0][i])
    # The divergence is ||pre - post|| / ||post|| as a full-precision round reports it.
    assert results[0].divergence > 0 and results[2].divergence > results[0].divergence


async def test_a_round_nobody_moved_in_keeps_every_ranks_tensors(
    ranks: list[GlooBackend],
) -> None:
    models = [moved(rank) for rank in range(3)]
    before = [[p.clone() for p in params] for params, _ in models]
    results = await average_all(ranks, models, [0, 0, 0], torch.bfloat16)
    assert all(r.skipped and r.total_mass == 0.0 for r in results)
    for (params, _), kept in zip(models, before, strict=True):
        assert all(torch.equal(p, k) for p, k in zip(params, kept, strict=True))
