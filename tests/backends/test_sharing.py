"""``Backend.share_newest`` over real gloo groups in one process: the newest state wins, bit for
bit (signed zeros, NaNs and every dtype included), and equal versions send nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import torch
import trio

from flodl.averaging.outer import NO_STATE
from flodl.backends.gloo import GlooBackend
from tests.backends.test_inprocess import gloo_group


@pytest.fixture
async def trio_of_ranks() -> AsyncIterator[list[GlooBackend]]:
    async with gloo_group(3) as backends:
        yield backends


def state(value: float) -> list[torch.Tensor]:
    return [
        torch.tensor([value, -0.0, float("nan"), float("-inf")]),
        torch.full((2, 3), value, dtype=torch.float64),
    ]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


async def share(
    backends: list[GlooBackend], states: list[list[torch.Tensor]], versions: list[int]
) -> list[int]:
    got = [0] * len(backends)
    async with trio.open_nursery() as nursery:
        for i, backend in enumerate(backends):

            async def one(i: int = i, backend: GlooBackend = backend) -> None:
                got[i] = await backend.share_newest(states[i], versions[i])

            nursery.start_soon(one)
    return got


async def test_the_newest_version_reaches_every_rank_bit_for_bit(
    trio_of_ranks: list[GlooBackend],
) -> None:
    states = [state(1.5), state(2.5), state(-3.25)]
    states[1][0][1] = 0.0  # rank 1 (the source) holds +0.0 where the others hold -0.0
    source = [t.clone() for t in states[1]]
    assert await share(trio_of_ranks, states, [3, 7, NO_STATE]) == [7, 7, 7]
    for tensors in states:
        assert all(same_bits(t, s) for t, s in zip(tensors, source, strict=True))


async def test_ranks_at_the_newest_version_are_not_written(
    trio_of_ranks: list[GlooBackend],
) -> None:
    # Ranks at one version hold the same bytes (one outer step each from equal states), so
    # only the older rank is written.
    states = [state(1.0), state(2.0), state(2.0)]
    assert await share(trio_of_ranks, states, [2, 4, 4]) == [4, 4, 4]
    assert all(torch.equal(t[1], torch.full((2, 3), 2.0, dtype=torch.float64)) for t in states)
    states = [state(1.0), state(2.0), state(3.0)]
    assert await share(trio_of_ranks, states, [4, 4, 4]) == [4, 4, 4]
    assert [float(t[1][0, 0]) for t in states] == [1.0, 2.0, 3.0]  # nothing was sent
