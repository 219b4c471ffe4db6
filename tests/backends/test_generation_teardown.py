"""Tearing groups down never blocks the event loop: an abort that hangs (``ncclCommAbort``
with dead peers) runs in a thread of its own while the heartbeats go on, what it raises is
logged, and a join cancelled while its communicator was being built tears that one down.

The communicators here are stand-ins for NCCL's (whose abort is what may block); the stores
and the generations' bookkeeping are the real ones."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.distributed as dist
import trio

from flodl.backends.generations import Generations
from flodl.backends.pipeline import PendingOp

HANG_S = 5.0
"""How long the stand-in abort blocks unless released (the old code blocked for all of it)."""


class HangingComm:
    """A communicator whose abort blocks until released (or raises, if told to)."""

    def __init__(self, raises: bool = False) -> None:
        self.raises = raises
        self.abort_started = threading.Event()
        self.release_abort = threading.Event()
        self.abort_ended = threading.Event()
        self.released_broken: list[bool] = []
        self.released = threading.Event()

    def allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        raise AssertionError("no op runs here")

    def start_allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> PendingOp:
        raise AssertionError("no op runs here")

    def abandon(self) -> None:
        self.abort_started.set()
        self.release_abort.wait(HANG_S)
        self.abort_ended.set()
        if self.raises:
            raise RuntimeError("ncclCommAbort failed: unhandled system error")

    def release(self, broken: bool) -> None:
        self.released_broken.append(broken)
        self.released.set()


async def joined(groups: Generations, comm: HangingComm, generation: int = 0) -> None:
    info = groups.prepare(generation, "127.0.0.1")
    await groups.join(info, 0, 1, generation, 10.0, lambda store: comm)


async def test_a_hanging_abort_leaves_the_event_loop_running() -> None:
    groups = Generations("nccl", op_timeout=HANG_S)
    comm = HangingComm()
    await joined(groups, comm)
    assert groups.current is not None
    groups.break_(groups.current)  # returns at once: the abort runs in its own thread
    assert not comm.abort_ended.is_set()
    assert await trio.to_thread.run_sync(comm.abort_started.wait, 10.0)
    for _beat in range(5):  # a heartbeat task's turns, while the abort hangs
        await trio.sleep(0.01)
    assert not comm.abort_ended.is_set()
    comm.release_abort.set()
    await groups.close()  # waits for the abort thread
    assert comm.abort_ended.is_set()


async def test_an_abort_that_raises_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    groups = Generations("nccl", op_timeout=HANG_S)
    comm = HangingComm(raises=True)
    comm.release_abort.set()
    await joined(groups, comm)
    assert groups.current is not None
    with caplog.at_level(logging.WARNING, logger="flodl.backends"):
        groups.break_(groups.current)
        await groups.close()
    assert comm.abort_ended.is_set()
    assert any("ncclCommAbort failed" in r.getMessage() for r in caplog.records)


async def test_a_join_that_settles_waits_for_the_old_group_s_abort() -> None:
    groups = Generations("nccl", op_timeout=HANG_S, settle_before_next=True)
    old, new = HangingComm(), HangingComm()
    await joined(groups, old)
    assert groups.current is not None
    groups.break_(groups.current)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(joined, groups, new, 1)
        await trio.to_thread.run_sync(old.abort_started.wait, 10.0)
        await trio.sleep(0.05)
        # The new generation is formed, but its join has not returned: the old abort runs.
        assert groups.current is not None and groups.current.number == 1
        assert not old.abort_ended.is_set()
        old.release_abort.set()
    assert old.abort_ended.is_set()  # before the new group's first collective
    new.release_abort.set()
    await groups.close()


async def test_a_cancelled_join_tears_down_the_communicator_it_was_building() -> None:
    groups = Generations("nccl", op_timeout=HANG_S)
    info = groups.prepare(0, "127.0.0.1")
    building, finish = threading.Event(), threading.Event()
    comm = HangingComm()

    def make_comm(store: object) -> HangingComm:
        building.set()
        finish.wait(10.0)
        return comm

    with trio.move_on_after(10) as timeout:
        async with trio.open_nursery() as nursery:

            async def join() -> None:
                await groups.join(info, 0, 1, 0, 10.0, make_comm)

            nursery.start_soon(join)
            await trio.to_thread.run_sync(building.wait, 10.0)
            nursery.cancel_scope.cancel()  # the join is cancelled mid-build
    assert not timeout.cancelled_caught
    assert groups.current is None
    finish.set()  # the builder now hands over a communicator nobody will use
    assert await trio.to_thread.run_sync(comm.released.wait, 10.0)
    assert comm.released_broken == [True]
    await groups.close()
