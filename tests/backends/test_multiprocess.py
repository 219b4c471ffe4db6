"""Averaging across real rank processes (gloo over loopback), re-formation after SIGKILL.

Each test forks its ranks, ``rank_script``, from a warm-start helper (torch imported once per
test, not per rank) and always kills and reaps them.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from tests.backends.harness import RankProcess, close_all, form_group, spawn_ranks

pytestmark = pytest.mark.slow


async def average(ranks: list[RankProcess], batches: list[int], gamma: float = 1.0) -> list[Any]:
    for rank, n in zip(ranks, batches, strict=True):
        await rank.send(cmd="average", batches=n, gamma=gamma)
    return [await rank.receive() for rank in ranks]


async def fill(ranks: list[RankProcess], params: list[float], buffers: list[float]) -> None:
    for index, (rank, p, b) in enumerate(zip(ranks, params, buffers, strict=True)):
        await rank.call(cmd="fill", param=p, buffer=b, counter=100 + index)


def assert_identical(replies: list[Any], param: float, buffer: float) -> None:
    assert all(r["status"] == "ok" for r in replies), replies
    assert len({r["hex"] for r in replies}) == 1, "ranks differ bitwise"
    for index, reply in enumerate(replies):
        assert reply["params"] == [[param] * 3, [param] * 4]
        assert reply["buffers"] == [[buffer] * 2, [100 + index]]  # int counter stays local


async def test_three_ranks_follow_the_mass_rule() -> None:
    # Buckets of 2 elements: each round is six all-reduces (the other tests use one).
    async with spawn_ranks(3, bucket_elements=2) as ranks:
        await form_group(ranks, 0)
        # gamma 1: values 1, 2, 3 with 1, 1, 2 batches -> (1 + 2 + 6) / 4
        await fill(ranks, [1.0, 2.0, 3.0], [10.0, 20.0, 30.0])
        replies = await average(ranks, [1, 1, 2])
        assert_identical(replies, 2.25, 20.0)
        assert replies[0]["result"]["total_mass"] == 4.0
        assert replies[0]["result"]["movers"] == 3
        assert replies[0]["result"]["divergence"] == pytest.approx(1.25 / 2.25)

        # gamma 0: every mover counts once -> (1 + 2 + 6) / 3
        await fill(ranks, [1.0, 2.0, 6.0], [0.0, 0.0, 0.0])
        assert_identical(await average(ranks, [1, 5, 9], gamma=0.0), 3.0, 0.0)

        # gamma -1: per-step weights 1, 1/2, 1/4 -> 2.75 / 1.75 (float32 rounding)
        await fill(ranks, [1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
        replies = await average(ranks, [1, 2, 4], gamma=-1.0)
        assert len({r["hex"] for r in replies}) == 1
        assert replies[0]["params"][0][0] == pytest.approx(2.75 / 1.75, rel=1e-6)

        # buffers by mover: rank 0 ran nothing, so neither its params nor its buffers count
        await fill(ranks, [1.0, 2.0, 3.0], [10.0, 20.0, 30.0])
        assert_identical(await average(ranks, [0, 1, 3]), 2.75, 25.0)

        # zero total mass: everyone keeps its local state
        await fill(ranks, [1.0, 2.0, 3.0], [10.0, 20.0, 30.0])
        replies = await average(ranks, [0, 0, 0])
        assert [r["result"]["skipped"] for r in replies] == [True, True, True]
        assert [r["params"][0][0] for r in replies] == [1.0, 2.0, 3.0]
        assert [r["buffers"][0][0] for r in replies] == [10.0, 20.0, 30.0]
        assert await close_all(ranks) == [0, 0, 0]


async def test_survivors_regroup_after_a_sigkill() -> None:
    async with spawn_ranks(3) as ranks:
        await form_group(ranks, 0)
        await fill(ranks, [1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
        assert_identical(await average(ranks, [1, 1, 1]), 2.0, 0.0)

        await fill(ranks, [1.0, 3.0, 9.0], [0.0, 0.0, 0.0])
        killed_at = time.monotonic()
        ranks[2].process.send_signal(signal.SIGKILL)
        survivors = ranks[:2]
        # The interrupted round: ring neighbours see the death, or the coordinator's
        # DeclareDead (here: a 2 s cancel) gets them out. Live params stay untouched.
        for rank in survivors:
            await rank.send(cmd="average", batches=1, cancel_after=2.0)
        failed = [await rank.receive() for rank in survivors]
        assert [r["status"] in ("aborted", "cancelled") for r in failed] == [True, True]
        assert [r["params"][0][0] for r in failed] == [1.0, 3.0]
        assert all(r["broken"] for r in failed)

        await form_group(survivors, 1)  # survivor 0 is the generator
        replies = await average(survivors, [1, 3])
        elapsed = time.monotonic() - killed_at
        assert_identical(replies, 2.5, 0.0)  # (1 * 1 + 3 * 3) / 4
        print(
            f"\nkill -> averaged on generation 1: {elapsed * 1e3:.0f} ms "
            f"(interrupted round ended after {max(r['ms'] for r in failed):.0f} ms)"
        )
        assert await ranks[2].process.wait() == -signal.SIGKILL
        assert await close_all(survivors) == [0, 0]


async def test_abandoned_round_leaves_params_untouched_and_rank_regroups() -> None:
    async with spawn_ranks(2, op_timeout=3.0) as ranks:
        await form_group(ranks, 0)
        await fill(ranks, [1.0, 3.0], [5.0, 7.0])
        # rank 1 never enters: only the cancel scope gets rank 0 out
        reply = await ranks[0].call(cmd="average", batches=2, cancel_after=0.3)
        assert reply["status"] == "cancelled" and reply["broken"] is True
        assert reply["params"] == [[1.0] * 3, [1.0] * 4] and reply["buffers"][0] == [5.0, 5.0]
        assert reply["ms"] < 1500  # back at the cancel, not at the 3 s op timeout
        again = await ranks[0].call(cmd="average", batches=2)
        assert again["status"] == "aborted" and "broken" in again["result"]["error"]

        await form_group(ranks, 1)
        assert_identical(await average(ranks, [1, 1]), 2.0, 6.0)
        assert await close_all(ranks) == [0, 0]
