"""Gloo backend: CPU tensors over TCP, one ``ProcessGroupGloo`` per generation.

Gloo cannot interrupt a running op (``abort()`` does nothing for it), so an abandoned op is
ended by its per-op timeout (``AllreduceOptions.timeout``) while its thread is left behind.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from flodl.backends.kernels import warm_up
from flodl.backends.pipeline import PendingOp
from flodl.backends.torch_backend import Comm, TorchDistBackend


class GlooComm:
    """A gloo group built directly on a store (no global default group)."""

    def __init__(self, store: Store, rank: int, world_size: int, op_timeout: float) -> None:
        self._timeout = timedelta(seconds=op_timeout)
        self._pg: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
            store, rank, world_size, self._timeout
        )

    def allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        self.start_allreduce(tensor, op).wait()

    def start_allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> PendingOp:
        """Queue the op on gloo's own threads (they run queued ops in order) and return."""
        pg: Any = self._pg  # the stubs omit Backend.allreduce
        if pg is None:
            raise RuntimeError("gloo group already released")
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(op)
        opts.timeout = self._timeout
        work: PendingOp = pg.allreduce([tensor], opts)
        return work

    def abandon(self) -> None:
        """Nothing to do: the stuck op ends at its per-op timeout."""

    def release(self, broken: bool) -> None:
        self._pg = None


class GlooBackend(TorchDistBackend):
    """Parameter averaging over gloo (CPU tensors)."""

    name = "gloo"
    default_bucket_elements = 1 << 20
    """4 MiB of float32 per op: small enough that packing the first bucket and finishing the
    last one (the parts that cannot overlap the wire) are short, large enough that gloo's
    per-op cost stays small (measured: bench/averaging_overhead.py)."""
    default_swap_parameters = True
    """On CPU the copy into the parameters is a whole pass over the model after the collective,
    the one part of a round nothing overlaps; views of the averaged buffer cost nothing."""

    def _make_comm(self, store: Store, rank: int, world_size: int) -> Comm:
        comm = GlooComm(store, rank, world_size, self.op_timeout)
        # The loop that ends each round loads here, in the joining thread, before training
        # starts (~0.5 s, once per process): loading it in the background would compete with
        # the first second of training and raise the fast ranks' idle share (figures in
        # docs/benchmarks.md, "Heterogeneous throughput").
        warm_up()
        return comm
