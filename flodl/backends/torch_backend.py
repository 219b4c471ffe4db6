"""Shared machinery of the torch.distributed backends: the round and its guarantees.

Group lifecycle (forming, breaking, retiring generations; the stores) lives in
:mod:`flodl.backends.generations`; what an average is, in :mod:`flodl.averaging`. Collectives
work on a scratch flat buffer (kept between rounds, dropped after a failed or abandoned one,
which may still be written by its ops), reduced in buckets that overlap packing and checking
with the wire (:mod:`flodl.backends.pipeline`), and only after a round succeeded (and, on
verified rounds, its checksums agreed) is the result written into the live tensors.

Cancellation: if the caller's cancel scope fires during a round, the worker thread is
abandoned, the generation is marked broken (NCCL: its communicator is aborted) and
``trio.Cancelled`` propagates; the live tensors are untouched. A collective that fails (a peer
died, the per-op timeout expired) or that this backend abandons itself (a new generation was
joined) raises :class:`~flodl.errors.CollectiveAborted`. A broken generation refuses further
rounds until a new one is joined.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import trio
from torch._C._distributed_c10d import Store, TCPStore

from flodl.averaging.kernels import NormSample
from flodl.averaging.mass import (
    Applied,
    FlatLayout,
    Reduced,
    apply_average,
    landed_params,
    local_norms,
    mass_of,
    pack,
)
from flodl.backends.base import DEFAULT_ALPHA, AverageResult
from flodl.backends.compressed import LandedMoves, average_moves
from flodl.backends.devices import StepBoundary, on_device
from flodl.backends.generations import Comm as Comm  # the communicator subclasses build
from flodl.backends.generations import Generation, Generations, Ticket
from flodl.backends.pipeline import (
    BucketPlan,
    Landed,
    Scratch,
    ScratchPool,
    install,
    members,
    reduce_in_buckets,
    views_storage_of,
)
from flodl.backends.sharing import share_newest
from flodl.errors import BackendError, CollectiveAborted

DEFAULT_VERIFY_EVERY = 10
"""Verify the first round of a generation, then every 10th (see TorchDistBackend)."""


class _GroupVerifyFailed(BackendError):
    """Internal: the checksum collective found ranks holding different averages."""


class TorchDistBackend:
    """Base of the gloo and nccl backends (subclasses build the communicator)."""

    name = "torch"
    default_bucket_elements: int | None = None
    """Bucket size when the constructor gets none (None: the whole buffer in one op)."""
    default_swap_parameters: bool = False
    """Whether rounds make the parameters views of the averaged buffer by default."""
    default_norm_sample: NormSample | None = None
    """How the divergence norms are sampled when the constructor gets no ``norm_sample``
    (None: exact, every element read)."""
    scratch_keep: int = 2
    """Idle scratch buffers kept between rounds (each the model's size, float32 or wider)."""
    device: torch.device | None = None
    """Where this backend averages (None: wherever the model lies, on one device)."""
    settle_before_next: bool = False
    """Whether joining a group waits for the older groups' aborts and releases to end
    (:class:`~flodl.backends.generations.Generations`)."""

    def __init__(
        self,
        *,
        op_timeout: float = 60.0,
        join_timeout: float = 60.0,
        verify: bool = True,
        verify_every: int = DEFAULT_VERIFY_EVERY,
        bucket_elements: int | None = None,
        swap_parameters: bool | None = None,
        norm_sample: NormSample | bool | None = True,
    ) -> None:
        """``op_timeout``: seconds after which a collective gives up by itself (the per-op
        timeout); ``join_timeout``: seconds to wait for all members when forming a group.

        ``verify``: prove with one extra 4-element MAX all-reduce that every rank holds
        bitwise the same reduced sums (so the same average), before anything is written;
        on a mismatch the round raises :class:`BackendError` and the group is broken.
        ``verify_every``: verify the first round of each group generation and then every
        ``verify_every``-th one (1: every round). The checksum pass overlaps the collective
        and is cheap; the verify collective is not, because it is one more point where every
        rank waits for the slowest: ~1 ms on an idle machine but up to 20-30 ms (a 20-40%
        longer round, bench/averaging_overhead.py) on a loaded one. The default, 10, keeps
        that under a few percent of a round while a systematic mismatch is still caught at
        the first round of a group. ``bucket_elements``: how many elements each all-reduce of
        a round carries, so packing and checking overlap the wire (default
        :attr:`default_bucket_elements`). ``verify_every`` and ``bucket_elements`` must be
        equal on every rank. ``swap_parameters``: after a round, make the parameters views of
        the buffer that holds the average instead of copying it into them (one pass over the
        model less; default :attr:`default_swap_parameters`). The Parameter objects, shapes
        and strides stay; only tensors someone took of ``p.data`` before the round go stale.
        ``norm_sample``: which elements ``||a||`` and ``||a - p||`` (the divergence the guard
        judges) are read from: a :class:`NormSample`, False or None for all of them (exact), True
        for :attr:`default_norm_sample`. ``||p||`` is always exact.
        """
        if op_timeout <= 0 or join_timeout <= 0:
            raise BackendError("op_timeout and join_timeout must be > 0")
        if verify_every < 1:
            raise BackendError(f"verify_every must be >= 1, got {verify_every}")
        if bucket_elements is not None and bucket_elements < 2:
            raise BackendError(f"bucket_elements must be >= 2, got {bucket_elements}")
        self.op_timeout = op_timeout
        self.join_timeout = join_timeout
        self.verify = verify
        self.verify_every = verify_every
        self.bucket_elements = (
            self.default_bucket_elements if bucket_elements is None else bucket_elements
        )
        self._plan: BucketPlan | None = None
        self._pool = ScratchPool(self.scratch_keep)
        self._installed: Scratch | None = None
        """The scratch buffer the live parameters are views of, after a swapping round."""
        self.swap_parameters = (
            self.default_swap_parameters if swap_parameters is None else swap_parameters
        )
        self.norm_sample: NormSample | None = (
            self.default_norm_sample if norm_sample is True else norm_sample or None
        )
        self.steps = StepBoundary()
        """The training loop marks each batch's end here (``flodl.worker.join`` does); rounds
        read the parameters only after it (a loop stepping under its own CUDA stream)."""
        self._groups = Generations(
            self.name, op_timeout, settle_before_next=self.settle_before_next
        )
        self._lock = trio.Lock()

    # --- subclass hooks -------------------------------------------------------------------

    def _make_comm(self, store: Store, rank: int, world_size: int, host: str) -> Comm:
        """The group's communicator; ``host``: this rank's address for its peers ("" for the
        library's default)."""
        raise NotImplementedError

    # --- state ----------------------------------------------------------------------------

    @property
    def _current(self) -> Generation | None:
        return self._groups.current

    @property
    def generation(self) -> int | None:
        current = self._current
        return None if current is None else current.number

    @property
    def broken(self) -> bool:
        current = self._current
        return current is None or current.broken

    @property
    def _hosted(self) -> dict[int, TCPStore]:
        """The stores this process hosts for its group's members, by generation."""
        return self._groups.hosted

    # --- group formation ------------------------------------------------------------------

    def prepare_group(self, generation: int, host: str) -> bytes:
        """Host the store for ``generation`` here; the bytes go to every member.

        The store stays alive in this process until the generation is retired (the process
        group built on it also holds it).
        """
        return self._groups.prepare(generation, host)

    async def join_group(
        self, info: bytes, rank: int, world_size: int, generation: int, host: str = ""
    ) -> None:
        """Build and join group ``generation``; the previous one is retired (its ops abandoned).

        Blocks until every member has joined (gloo; NCCL connects eagerly where supported) or
        ``join_timeout`` passes (:class:`BackendError`). On cancellation the half-built group
        is dropped in its thread and ``trio.Cancelled`` propagates; the current one is kept.
        """

        def make_comm(store: Store) -> Comm:
            return self._make_comm(store, rank, world_size, host)

        await self._groups.join(info, rank, world_size, generation, self.join_timeout, make_comm)

    # --- rounds ---------------------------------------------------------------------------

    def _plan_for(self, layout: FlatLayout) -> BucketPlan:
        plan = self._plan
        if plan is None or plan.layout != layout:
            plan = self._plan = BucketPlan.of(layout, self.bucket_elements)
        return plan

    def _verify(self, comm: Comm, checksum: int, device: torch.device) -> None:
        """Worker thread: one tiny MAX all-reduce proving every rank has the same checksum.

        The 64-bit checksum travels as two 32-bit halves and their negations, so max == min
        for each half (no int64 overflow on negation).
        """
        high, low = checksum >> 32, checksum & 0xFFFFFFFF
        words = torch.tensor([high, low, -high, -low], dtype=torch.int64, device=device)
        comm.allreduce(words, dist.ReduceOp.MAX)
        top_high, top_low, neg_bottom_high, neg_bottom_low = words.tolist()
        if top_high != -neg_bottom_high or top_low != -neg_bottom_low:
            raise _GroupVerifyFailed("ranks hold different sums after the all-reduce")

    async def _reduce(
        self,
        gen: Generation,
        plan: BucketPlan,
        scratch: Scratch,
        live: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None,
        batches: int,
        gamma: float,
    ) -> Landed:
        """Reduce in buckets (packing ``live`` first unless None), then verify if asked.

        Raises as :meth:`Generations.run`, and :class:`BackendError` (the group broken) when
        the verify collective finds ranks holding different sums; on any raise the scratch
        may still be written by ops in flight and must not be used again.
        """
        verify = self.verify and gen.rounds % self.verify_every == 0
        gen.rounds += 1  # every rank runs the same rounds on a generation: same choice

        def work(comm: Comm, ticket: Ticket) -> Landed:
            sources = None if live is None else members(*live, plan.layout)
            landed = reduce_in_buckets(
                comm,
                plan,
                scratch,
                sources,
                batches,
                gamma,
                lambda: ticket.abandoned,
                verify,
                self.norm_sample,
            )
            if verify:
                if ticket.abandoned:
                    raise CollectiveAborted("abandoned before the verify collective")
                self._verify(comm, landed.checksum, scratch.flat.device)
            return landed

        try:
            steps = self.steps if live is not None else None
            return await self._groups.run(gen, on_device(scratch.flat.device, work, steps))
        except _GroupVerifyFailed as err:
            self._groups.break_(gen)
            raise BackendError(f"{self.name} generation {gen.number}: {err}") from None

    async def average(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        batches: int,
        gamma: float = 1.0,
    ) -> AverageResult:
        """Average with every member now (Sync/Cadence): live tensors overwritten on success.

        Blocks this task until done. Cancelled: ``trio.Cancelled`` propagates, the group is
        broken, live tensors untouched. Failed: :class:`CollectiveAborted`, same guarantees.
        Once the collective (and the verify collective) succeeded the result is applied
        whole, even if a cancel arrives.
        """
        mass_of(batches, gamma)  # validates before anything starts
        layout = FlatLayout.of(params, buffers)
        async with self._lock:
            gen = self._groups.live()
            plan = self._plan_for(layout)
            scratch = self._pool.take(plan)
            landed = await self._reduce(gen, plan, scratch, (params, buffers), batches, gamma)
        viewed = False
        if not landed.skipped:
            installing = on_device(layout.device, install)
            flat, swap = scratch.flat, self.swap_parameters
            viewed = await trio.to_thread.run_sync(installing, flat, layout, params, buffers, swap)
        self._keep_installed(scratch if viewed else None, params)
        if not viewed:
            self._pool.give_back(scratch)
        assert landed.applied is not None
        return _result(landed.applied, landed.reduced, landed.skipped)

    async def average_moves(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        reference: Sequence[torch.Tensor],
        batches: int,
        dtype: torch.dtype,
    ) -> AverageResult:
        """Average with every member through the moves from ``reference`` (the same bytes on
        every member), reduced in ``dtype`` (:func:`~flodl.backends.compressed.average_moves`):
        live tensors overwritten on success. Cancelled: the group is broken and
        ``trio.Cancelled`` propagates; failed: :class:`CollectiveAborted`. Either way the live
        tensors are untouched."""
        async with self._lock:
            gen = self._groups.live()

            def work(comm: Comm, ticket: Ticket) -> LandedMoves:
                abandoned = lambda: ticket.abandoned  # noqa: E731
                return average_moves(comm, params, buffers, reference, batches, dtype, abandoned)

            device = params[0].device if params else None
            landed = await self._groups.run(gen, on_device(device, work, self.steps))
        if not landed.result.skipped:  # not abandonable: once landed, installed whole
            await trio.to_thread.run_sync(on_device(device, landed.install), params, buffers)
        return landed.result

    async def share_newest(self, tensors: Sequence[torch.Tensor], version: int) -> int:
        """Make ``tensors`` equal on every member to those of the member holding the highest
        ``version`` (:func:`~flodl.backends.sharing.share_newest`); return that version.

        Every member calls it at the same point (the first round of a generation), with
        tensors of the same shapes. Cancelled: the group is broken and ``trio.Cancelled``
        propagates; failed: :class:`CollectiveAborted`. Either way ``tensors`` may be partly
        written.
        """
        async with self._lock:
            gen = self._groups.live()

            def work(comm: Comm, ticket: Ticket) -> int:
                return share_newest(
                    comm, tensors, version, gen.rank, gen.world_size, lambda: ticket.abandoned
                )

            device = tensors[0].device if tensors else None
            return await self._groups.run(gen, on_device(device, work, self.steps))

    def _keep_installed(self, scratch: Scratch | None, params: Sequence[torch.Tensor]) -> None:
        """``scratch`` now holds live parameters (None: it does not); the buffer that held
        them before goes back to the pool once no parameter lies in it any more."""
        previous = self._installed
        if scratch is not None:
            self._installed = scratch
        if previous is not None and previous is not scratch:
            if not views_storage_of(params, previous.flat):
                self._pool.give_back(previous)
                if self._installed is previous:
                    self._installed = None

    async def start_background_average(
        self,
        nursery: trio.Nursery,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        batches: int,
        gamma: float = 1.0,
    ) -> BackgroundAverage:
        """Snapshot the tensors now (returns once taken), then reduce in ``nursery``.

        The caller may change the live tensors as soon as this returns. Call
        :meth:`BackgroundAverage.blend_into` once it has landed.
        """
        layout = FlatLayout.of(params, buffers)
        gen = self._groups.live()
        plan = self._plan_for(layout)
        scratch = self._pool.take(plan)
        packing, flat = on_device(layout.device, pack, self.steps), scratch.flat
        await trio.to_thread.run_sync(packing, params, buffers, layout, batches, gamma, flat)
        pending = BackgroundAverage(layout, self._pool)
        nursery.start_soon(self._background_round, gen, plan, scratch, pending)
        return pending

    async def _background_round(
        self,
        gen: Generation,
        plan: BucketPlan,
        scratch: Scratch,
        pending: BackgroundAverage,
    ) -> None:
        try:
            with pending._scope:
                async with self._lock:
                    if gen is not self._current or gen.broken:
                        raise CollectiveAborted(f"group generation {gen.number} is gone")
                    landed = await self._reduce(gen, plan, scratch, None, 0, 1.0)
                pending._land(scratch, landed.reduced, None)
                return
            pending._land(None, None, CollectiveAborted("background average was abandoned"))
            self._groups.break_(gen)
        except BackendError as err:
            pending._land(None, None, err)
        except trio.Cancelled:
            pending._land(None, None, CollectiveAborted("background average was cancelled"))
            raise

    async def close(self) -> None:
        """Abandon any running op, tear down every group, release the stores.

        Waits (in a worker thread, at most about ``op_timeout`` per pending op) for abandoned
        ops to end, so a process that awaited this exits cleanly. Idempotent.
        """
        self._pool.clear()
        self._installed = None  # the parameters keep their buffer alive
        await self._groups.close()


def _result(applied: Applied, reduced: Reduced, skipped: bool) -> AverageResult:
    return AverageResult(
        divergence=applied.divergence,
        pre_norm=applied.pre_norm,
        post_norm=applied.post_norm,
        skipped=skipped,
        total_mass=reduced.total_mass,
        movers=round(reduced.movers),
    )


class BackgroundAverage:
    """A round reducing a snapshot in the background (Async policy, EASGD blend on landing)."""

    def __init__(self, layout: FlatLayout, pool: ScratchPool) -> None:
        self._layout = layout
        self._pool = pool
        self._scope = trio.CancelScope()
        self._landed = trio.Event()
        self._scratch: Scratch | None = None
        self._reduced: Reduced | None = None
        self._error: BackendError | None = None
        self._used = False

    def _land(
        self, scratch: Scratch | None, reduced: Reduced | None, error: BackendError | None
    ) -> None:
        self._scratch, self._reduced, self._error = scratch, reduced, error
        self._landed.set()

    @property
    def landed(self) -> bool:
        return self._landed.is_set()

    @property
    def error(self) -> BackendError | None:
        """Why the round failed, once landed; None on success."""
        return self._error

    async def wait(self) -> None:
        """Block until landed (success or failure). Cancellation leaves the round running."""
        await self._landed.wait()

    def blend_into(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        alpha: float = DEFAULT_ALPHA,
        outer: Callable[[Sequence[torch.Tensor]], None] | None = None,
    ) -> AverageResult:
        """EASGD: ``p <- (1 - alpha) * p + alpha * avg``; float buffers overwritten.

        With ``outer``, the average's parameters (shaped as ``params``) go through
        ``outer(avg)`` first, which may rewrite them in place (the outer optimizer's step), and
        ``avg`` is what it leaves. Runs on the calling thread (one pass over the tensors). A
        zero-mass round leaves the tensors as they are (``outer`` is not called). Raises
        :class:`CollectiveAborted` (or the round's :class:`BackendError`) if it failed,
        :class:`BackendError` if not landed or used twice.
        """
        if not self.landed:
            raise BackendError("background average has not landed yet")
        if self._error is not None:
            raise self._error
        if self._used:
            raise BackendError("background average was already blended in")
        if FlatLayout.of(params, buffers) != self._layout:
            raise BackendError("tensors differ in shape or dtype from the snapshot")
        self._used = True
        scratch, reduced = self._scratch, self._reduced
        assert scratch is not None and reduced is not None
        self._scratch = None
        skipped = reduced.total_mass <= 0
        if skipped:
            applied = local_norms(params)
        else:
            if outer is not None:
                outer(landed_params(scratch.flat, self._layout, params))
            applied = apply_average(scratch.flat, self._layout, params, buffers, alpha)
        self._pool.give_back(scratch)
        return _result(applied, reduced, skipped)

    def abandon(self) -> None:
        """Give up on the round; it lands as failed and the group is marked broken."""
        self._scope.cancel()
