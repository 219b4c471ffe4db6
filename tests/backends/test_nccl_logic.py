"""The NCCL backend's decisions that need no GPU: how an op is waited for, and the error
handling mode it owns. (The GPU side runs in ``.ci/device-check``.)"""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import torch

from flodl.averaging.mass import FlatLayout
from flodl.backends.nccl import (
    ERROR_HANDLING_ENV,
    ERROR_HANDLING_MODE,
    finish_work,
    own_error_handling,
)
from flodl.backends.pipeline import BucketPlan, ScratchPool

TIMEOUT = timedelta(seconds=7)


class FakeWork:
    """A work handle as torch's NCCL backend returns one, scripted."""

    def __init__(
        self, completes: bool = True, raises: str | None = None, error: object = None
    ) -> None:
        self.completes, self.raises, self.error = completes, raises, error
        self.waited_with: list[timedelta] = []

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self.waited_with.append(timeout)
        if self.raises is not None:
            raise RuntimeError(self.raises)
        return self.completes

    def exception(self) -> object:
        return self.error


def test_an_op_is_waited_for_with_the_op_timeout() -> None:
    work = FakeWork()
    finish_work(work, TIMEOUT)
    # A bare wait() only makes the CUDA stream wait; with a timeout it blocks the host.
    assert work.waited_with == [TIMEOUT]


def test_an_op_that_timed_out_is_never_an_average() -> None:
    with pytest.raises(RuntimeError, match="did not complete within 7 s"):
        finish_work(FakeWork(completes=False), TIMEOUT)


def test_an_op_whose_wait_raises_fails_the_round() -> None:
    with pytest.raises(RuntimeError, match=r"NCCL op failed: .*Watchdog caught collective"):
        finish_work(FakeWork(raises="Watchdog caught collective operation timeout"), TIMEOUT)


def test_an_op_that_completed_with_an_error_fails_the_round() -> None:
    with pytest.raises(RuntimeError, match="NCCL op failed: remote process exited"):
        finish_work(FakeWork(error=RuntimeError("remote process exited")), TIMEOUT)


@pytest.mark.parametrize("inherited", ["1", "3", "0"])
def test_flodl_owns_the_error_handling_mode_and_says_so_once(
    inherited: str, caplog: pytest.LogCaptureFixture
) -> None:
    env = {ERROR_HANDLING_ENV: inherited}  # torchrun sets 1; torch's default is 3
    with caplog.at_level(logging.WARNING, logger="flodl.backends.nccl"):
        assert own_error_handling(env) == inherited
        assert own_error_handling(env) is None  # the second backend: nothing to override
    assert env[ERROR_HANDLING_ENV] == ERROR_HANDLING_MODE == "2"
    (record,) = caplog.records
    assert f"{ERROR_HANDLING_ENV}={inherited}" in record.getMessage()


def test_an_unset_mode_is_set_quietly(caplog: pytest.LogCaptureFixture) -> None:
    env: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="flodl.backends.nccl"):
        assert own_error_handling(env) is None
    assert env == {ERROR_HANDLING_ENV: "2"}
    assert caplog.records == []


def test_nccl_keeps_one_scratch_buffer_per_gpu() -> None:
    # GPU memory bounds the model: one buffer the model's size, not two (gloo keeps two).
    from flodl.backends.gloo import GlooBackend
    from flodl.backends.nccl import NcclBackend

    assert (NcclBackend.scratch_keep, GlooBackend.scratch_keep) == (1, 2)
    assert NcclBackend.settle_before_next and not GlooBackend.settle_before_next
    layout = FlatLayout.of([torch.zeros(4)], [])
    plan = BucketPlan.of(layout, None)
    pool = ScratchPool(NcclBackend.scratch_keep)
    first, second = pool.take(plan), pool.take(plan)
    pool.give_back(first)
    pool.give_back(second)  # not kept: a round takes the one the previous gave back
    assert pool.take(plan) is first
    assert pool.take(plan) is not second
