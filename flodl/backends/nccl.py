"""NCCL backend: CUDA tensors, one ``ProcessGroupNCCL`` per generation.

A collective stuck on a dead peer is ended by aborting the communicator (``ncclCommAbort``),
which makes the stuck kernel return; because an aborted op may "succeed" with garbage, the
worker checks the abort flag after the op and discards the result. Each op is waited for
with a timeout (:func:`finish_work`): a bare ``work.wait()`` only makes the current CUDA
stream wait and returns normally after torch's watchdog ended a stalled kernel, which would
install partial sums as the average.

``TORCH_NCCL_ASYNC_ERROR_HANDLING`` in modes 1 and 3 (torch's default is 3, torchrun sets 1)
makes torch's watchdog tear the process down about a minute after any NCCL error or timeout,
even once flodl has aborted the group; an elastic run must outlive a peer's death. So this
backend sets it to 2 (abort the communicator only) whatever the environment says, before its
first group, and logs the override once (:func:`own_error_handling`).

Retired groups are aborted, not shut down: ``shutdown()`` waits for pending work, which a dead
peer never finishes. Only usable where ``dist.is_nccl_available() and torch.cuda.is_available()``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import MutableMapping
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from flodl.backends.generations import Comm
from flodl.backends.pipeline import PendingOp
from flodl.backends.torch_backend import DEFAULT_VERIFY_EVERY, TorchDistBackend
from flodl.errors import BackendError

ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
ERROR_HANDLING_MODE = "2"
"""CleanUpOnly: on an error or timeout the watchdog aborts the communicator and leaves the
process alone (flodl re-forms the group with the survivors)."""

log = logging.getLogger("flodl.backends.nccl")


def own_error_handling(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Set :data:`ERROR_HANDLING_ENV` to :data:`ERROR_HANDLING_MODE` in ``environ`` (default
    ``os.environ``); return the value it replaced (None: unset or already that), logged once
    as a warning. Must run before the first ``ProcessGroupNCCL`` is built (torch reads it
    there)."""
    env = os.environ if environ is None else environ
    previous = env.get(ERROR_HANDLING_ENV)
    env[ERROR_HANDLING_ENV] = ERROR_HANDLING_MODE
    if previous is None or previous == ERROR_HANDLING_MODE:
        return None
    log.warning(
        "%s=%s would let torch's watchdog kill this process after an NCCL error, which an "
        "elastic run must survive; flodl sets it to %s (abort the communicator only)",
        ERROR_HANDLING_ENV,
        previous,
        ERROR_HANDLING_MODE,
    )
    return previous


class Work(Protocol):
    """What :func:`finish_work` needs of a ``torch.distributed`` work handle."""

    def wait(self, timeout: timedelta = ...) -> bool: ...

    def exception(self) -> object: ...


def finish_work(work: Work, timeout: timedelta) -> None:
    """Block this thread until ``work`` has ended, at most ``timeout``; RuntimeError unless it
    succeeded (it timed out, torch raised, or it holds an error). On a timeout torch aborts
    the communicator, so the op is over either way when this returns or raises."""
    try:
        completed = work.wait(timeout)
    except RuntimeError as err:
        raise RuntimeError(f"NCCL op failed: {err}") from err
    if not completed:
        raise RuntimeError(f"NCCL op did not complete within {timeout.total_seconds():g} s")
    error = work.exception()
    if error is not None:
        raise RuntimeError(f"NCCL op failed: {error}")


def nccl_usable() -> bool:
    """True when this torch build has NCCL and a CUDA device is visible."""
    return bool(dist.is_nccl_available() and torch.cuda.is_available())


class _Done:
    def wait(self) -> None:
        """Already ended."""


class NcclComm:
    """An NCCL group on one device, built directly on a store."""

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        op_timeout: float,
        device: torch.device,
    ) -> None:
        from torch.distributed import ProcessGroupNCCL  # ImportError on CPU builds

        self._timeout = timedelta(seconds=op_timeout)
        self._device = device
        options = ProcessGroupNCCL.Options()
        options._timeout = self._timeout
        self._pg: Any = ProcessGroupNCCL(store, rank, world_size, options)  # stubs lack allreduce
        self._aborted = threading.Event()
        self._abort_lock = threading.Lock()
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        # Connect now, so joining means every member is there (as with gloo).
        self._pg.eager_connect_single_device(device)

    def allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        if self._aborted.is_set():
            raise RuntimeError("NCCL communicator was aborted")
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(op)
        opts.timeout = self._timeout
        # This thread's device first: leaving ``torch.cuda.stream`` restores the thread's
        # current device, which would otherwise be device 0 (a context there for every rank).
        torch.cuda.set_device(self._device)
        # The op must see what the calling thread's stream wrote into ``tensor``.
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self._stream):
            work = self._pg.allreduce([tensor], opts)
        finish_work(work, self._timeout)
        self._stream.synchronize()
        if self._aborted.is_set():
            raise RuntimeError("NCCL communicator was aborted during the op")

    def start_allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> PendingOp:
        """Runs the op to its end before returning (NCCL rounds use one bucket)."""
        self.allreduce(tensor, op)
        return _Done()

    def abandon(self) -> None:
        """Abort the communicator: a kernel stuck on a dead peer returns. May block while
        NCCL tears down (NVIDIA/nccl#863), so it is called off the trio thread."""
        with self._abort_lock:
            if self._aborted.is_set():
                return
            self._aborted.set()
        torch.cuda.set_device(self._device)  # this thread's, as every op here (module doc)
        self._pg.abort()

    def release(self, broken: bool) -> None:
        """Abort, broken or not: ``shutdown()`` would wait for work a dead peer never ends."""
        self.abandon()


class NcclBackend(TorchDistBackend):
    """Parameter averaging over NCCL (CUDA tensors on ``device``)."""

    name = "nccl"
    scratch_keep = 1
    """One scratch buffer per GPU: device memory is what a model's size is bounded by, and a
    round takes the buffer the previous one gave back."""
    settle_before_next = True
    """An old communicator is aborted before the new one runs a collective: NCCL does not
    promise that an abort beside another communicator's kernels on the device returns."""

    def __init__(
        self,
        *,
        device: torch.device | str | int | None = None,
        op_timeout: float = 60.0,
        join_timeout: float = 60.0,
        verify: bool = True,
        verify_every: int = DEFAULT_VERIFY_EVERY,
        bucket_elements: int | None = None,
        swap_parameters: bool | None = None,
    ) -> None:
        """As :class:`~flodl.backends.torch_backend.TorchDistBackend`; ``swap_parameters``
        is off by default here: CUDA graphs and compiled kernels may hold parameter
        addresses, and on a GPU the copy is cheap against the collective."""
        if not nccl_usable():
            raise BackendError("nccl backend needs a torch build with NCCL and a CUDA device")
        super().__init__(
            op_timeout=op_timeout,
            join_timeout=join_timeout,
            verify=verify,
            verify_every=verify_every,
            bucket_elements=bucket_elements,
            swap_parameters=swap_parameters,
        )
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device: torch.device | None = torch.device(device)
        own_error_handling()

    def _make_comm(self, store: Store, rank: int, world_size: int, host: str) -> Comm:
        assert self.device is not None
        torch.cuda.set_device(self.device)
        return NcclComm(store, rank, world_size, self.op_timeout, self.device)
