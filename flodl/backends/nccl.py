"""NCCL backend: CUDA tensors, one ``ProcessGroupNCCL`` per generation.

A collective stuck on a dead peer is ended by aborting the communicator (``ncclCommAbort``),
which makes the stuck kernel return; because an aborted op may "succeed" with garbage, the
worker checks the abort flag after the op and discards the result.

``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 3 in torch (tear the process down on a
watchdog error); an elastic run must survive a peer's death, so unless the user set it, this
backend sets it to 2 (abort the communicator only) before building its first group.
Only usable where ``dist.is_nccl_available() and torch.cuda.is_available()``.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from flodl.backends.generations import Comm
from flodl.backends.pipeline import PendingOp
from flodl.backends.torch_backend import DEFAULT_VERIFY_EVERY, TorchDistBackend
from flodl.errors import BackendError

ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


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
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        # Connect now, so joining means every member is there (as with gloo).
        self._pg.eager_connect_single_device(device)

    def allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        if self._aborted.is_set():
            raise RuntimeError("NCCL communicator was aborted")
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(op)
        opts.timeout = self._timeout
        # The op must see what the calling thread's stream wrote into ``tensor``.
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self._stream):
            work = self._pg.allreduce([tensor], opts)
            work.wait()
        self._stream.synchronize()
        if self._aborted.is_set():
            raise RuntimeError("NCCL communicator was aborted during the op")

    def start_allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> PendingOp:
        """Runs the op to its end before returning (NCCL rounds use one bucket)."""
        self.allreduce(tensor, op)
        return _Done()

    def abandon(self) -> None:
        """Abort the communicator: a kernel stuck on a dead peer returns."""
        if not self._aborted.is_set():
            self._aborted.set()
            self._pg.abort()

    def release(self, broken: bool) -> None:
        if broken:
            self.abandon()
        else:
            self._pg.shutdown()


class NcclBackend(TorchDistBackend):
    """Parameter averaging over NCCL (CUDA tensors on ``device``)."""

    name = "nccl"

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
        self.device = torch.device(device)
        os.environ.setdefault(ERROR_HANDLING_ENV, "2")

    def _make_comm(self, store: Store, rank: int, world_size: int, host: str) -> Comm:
        torch.cuda.set_device(self.device)
        return NcclComm(store, rank, world_size, self.op_timeout, self.device)
