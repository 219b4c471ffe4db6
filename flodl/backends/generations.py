"""The generations of one backend's group: forming, running ops on, breaking and retiring them.

Each generation's process group is built directly on a prefixed store (no global default
group), so survivors can build generation ``g + 1`` while generation ``g`` is broken and an
abandoned operation on it is still blocked in a thread. Every blocking torch call runs in a
worker thread holding a ticket of its generation; breaking the generation abandons every
ticket (their threads are left to end by themselves) and aborts the communicator where the
library can.

Dropping the last reference to a group with a pending op blocks until the op ends (gloo), so
retired groups wait in a graveyard and are released only in worker threads, once their ops
have ended; :meth:`Generations.close` waits for every release.

Aborting a communicator can block (``ncclCommAbort`` with dead peers, NVIDIA/nccl#863), so it
never runs on the trio thread: each abort gets a thread of its own, its errors are logged, and
the event loop (the heartbeats) goes on meanwhile. Where the library cannot run a new group's
collectives beside an old group being torn down (NCCL), ``settle_before_next`` makes a join
wait, bounded, for the aborts and releases of the older generations before it returns.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Protocol, TypeVar

import attrs
import torch
import torch.distributed as dist
import trio
from torch._C._distributed_c10d import Store, TCPStore

from flodl.backends.group import GroupInfo, connect_store, host_store
from flodl.backends.pipeline import PendingOp
from flodl.errors import BackendError, CollectiveAborted

T = TypeVar("T")
log = logging.getLogger("flodl.backends")


class Comm(Protocol):
    """One generation's communicator. All but ``abandon`` run in worker threads."""

    def allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        """Reduce ``tensor`` in place with every member; raise RuntimeError on failure."""
        ...

    def start_allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> PendingOp:
        """Start reducing ``tensor`` in place; ops complete in the order they were started."""
        ...

    def abandon(self) -> None:
        """Make any op stuck in another thread end soon. Runs in a thread of its own (it may
        block); what it raises is logged."""
        ...

    def release(self, broken: bool) -> None:
        """Tear the communicator down (blocking; only once no op is pending)."""
        ...


@attrs.define(eq=False)
class Ticket:
    """One op handed to a worker thread; the thread clears ``comm`` and sets ``done`` at its end."""

    comm: Comm | None
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    done: threading.Event = attrs.field(factory=threading.Event)
    abandoned: bool = False


@attrs.define(eq=False)
class Generation:
    """One formed group: its communicator (None once retired) and the ops running on it."""

    number: int
    rank: int
    world_size: int
    comm: Comm | None
    broken: bool = False
    tickets: set[Ticket] = attrs.field(factory=set)
    rounds: int = 0  # rounds started on this generation (the verify cadence counts them)


@attrs.define(eq=False)
class _Corpse:
    """A retired communicator waiting to be released once its ops have ended."""

    comm: Comm
    broken: bool
    pending: list[threading.Event]

    def idle(self) -> bool:
        return all(ev.is_set() for ev in self.pending)


def _release_corpses(corpses: list[_Corpse], wait_s: float, *, collect: bool) -> None:
    """Worker thread: wait (bounded) for pending ops, then tear the communicators down.

    Dropping the last reference frees a group at once; ``collect`` also runs the cycle
    collector, for a group some cycle still holds. Only :meth:`Generations.close` asks for
    it: a full collection holds the GIL for ~0.15 s in a process with torch loaded, and a
    burial during recovery that collects stalls the survivors' first round on the new group
    (every survivor at once, on shared cores: 0.9 s at 8 ranks here, 2 s at 16)."""
    while corpses:
        corpse = corpses.pop()
        for ev in corpse.pending:
            ev.wait(wait_s)
        _quietly(corpse.comm.release, corpse.broken)
        del corpse
    if collect:
        gc.collect()


def _quietly(teardown: Callable[..., None], *args: object) -> None:
    """Run a teardown step; a broken group may complain, and it is gone either way: logged."""
    try:
        teardown(*args)
    except Exception as err:
        log.warning("tearing down a group: %s: %s", type(err).__name__, err)


class _Building:
    """A communicator being built in a thread whose join may be cancelled: whichever of the
    builder (:meth:`keep`) and the cancelled join (:meth:`drop`) comes second tears it down."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._comm: Comm | None = None
        self._dropped = False

    def keep(self, comm: Comm) -> Comm:
        """Builder thread: hand over ``comm``; released here (broken) if the join was dropped."""
        with self._lock:
            if not self._dropped:
                self._comm = comm
                return comm
        _quietly(comm.release, True)
        return comm

    def drop(self) -> Comm | None:
        """The join was cancelled: the communicator already built (the caller tears it down),
        or None (the builder will, once it has one)."""
        with self._lock:
            self._dropped = True
            comm, self._comm = self._comm, None
            return comm


class Generations:
    """The current generation of a backend's group, the stores it hosts, the retired ones.

    ``name`` (the backend's) prefixes error messages; ``op_timeout`` bounds how long a
    release waits for each op left pending on a retired generation. ``settle_before_next``:
    a join returns only once the older generations' aborts and releases have ended (at most
    about ``op_timeout``).
    """

    def __init__(self, name: str, op_timeout: float, *, settle_before_next: bool = False) -> None:
        self.name = name
        self.op_timeout = op_timeout
        self.settle_before_next = settle_before_next
        self.current: Generation | None = None
        self.hosted: dict[int, TCPStore] = {}
        """The stores this process hosts, by generation; each is held until it retires."""
        self.closed = False
        self._graveyard: list[_Corpse] = []
        self._burials: list[threading.Event] = []
        """Aborts and releases running in their own threads; :meth:`close` waits for them."""
        # Abandoned threads hold a token until their op ends: keep them off trio's default.
        self._limiter = trio.CapacityLimiter(64)

    def _check_open(self) -> None:
        if self.closed:
            raise BackendError(f"{self.name} backend is closed")

    def live(self) -> Generation:
        """The current generation, if ops may run on it; else :class:`BackendError` (closed,
        never joined) or :class:`CollectiveAborted` (broken: join a new one first)."""
        self._check_open()
        gen = self.current
        if gen is None:
            raise BackendError(f"{self.name} backend has not joined a group yet")
        if gen.broken or gen.comm is None:
            raise CollectiveAborted(
                f"group generation {gen.number} is broken; join a new generation first"
            )
        return gen

    def break_(self, gen: Generation) -> None:
        """Mark ``gen`` broken, abort its communicator, cancel every op still running on it."""
        if gen.broken:
            return
        gen.broken = True
        for ticket in gen.tickets:
            ticket.abandoned = True
            ticket.scope.cancel()
        if gen.comm is not None:
            self._in_thread(_quietly, gen.comm.abandon)

    def _in_thread(self, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn(*args)`` in a thread of its own, not awaited; :meth:`close` (and a join
        with ``settle_before_next``) waits for it."""
        done = threading.Event()

        def run() -> None:
            try:
                fn(*args)
            finally:
                done.set()

        trio.lowlevel.start_thread_soon(run, lambda _outcome: None)
        self._burials = [ended for ended in self._burials if not ended.is_set()]
        self._burials.append(done)

    def _retire(self, gen: Generation) -> None:
        """Move ``gen`` to the graveyard; ops still running on it are abandoned first."""
        pending = [t.done for t in gen.tickets if not t.done.is_set()]
        if pending:
            self.break_(gen)
        if gen.comm is not None:
            self._graveyard.append(_Corpse(comm=gen.comm, broken=gen.broken, pending=pending))
            gen.comm = None
        gen.broken = True
        self.hosted.pop(gen.number, None)

    # --- forming --------------------------------------------------------------------------

    def prepare(self, generation: int, host: str) -> bytes:
        """Host the store for ``generation`` on ``host``; the info bytes its members need."""
        self._check_open()
        store, info = host_store(generation, host)
        self.hosted[generation] = store
        return info.encode()

    async def join(
        self,
        info: bytes,
        rank: int,
        world_size: int,
        generation: int,
        join_timeout: float,
        make_comm: Callable[[Store], Comm],
    ) -> None:
        """Connect to the store ``info`` names, build the communicator with ``make_comm`` (in
        a worker thread) and make it current; the previous generation is retired.

        A failure to form raises :class:`BackendError` and keeps the current generation. On
        cancellation the half-built group is dropped in its thread, ``trio.Cancelled``
        propagates and the current generation is kept.
        """
        self._check_open()
        if not 0 <= rank < world_size:
            raise BackendError(f"rank {rank} is not in range(world_size={world_size})")
        if self.current is not None and generation <= self.current.number:
            raise BackendError(
                f"generation {generation} is not newer than the current {self.current.number}"
            )
        parsed = GroupInfo.decode(info)
        timeout = timedelta(seconds=join_timeout)

        building = _Building()

        def build() -> Comm:
            return building.keep(make_comm(connect_store(parsed, timeout)))

        try:
            comm = await trio.to_thread.run_sync(
                build, abandon_on_cancel=True, limiter=self._limiter
            )
        except RuntimeError as err:
            raise BackendError(
                f"{self.name}: could not form group generation {generation} "
                f"as rank {rank}/{world_size}: {err}"
            ) from err
        except trio.Cancelled:
            built = building.drop()
            if built is not None:  # formed just as the join was cancelled: tear it down
                self._in_thread(_quietly, built.release, True)
            raise
        old = self.current
        self.current = Generation(generation, rank, world_size, comm)
        if old is not None:
            self._retire(old)
        self._bury_idle()
        if self.settle_before_next:
            await self._settle()

    async def _settle(self) -> None:
        """Wait (in a thread, at most about ``op_timeout`` each) for the aborts and releases
        started so far. Cancelled: they go on in their threads."""
        pending, wait_s = list(self._burials), self.op_timeout

        def wait() -> None:
            for done in pending:
                done.wait(wait_s)

        await trio.to_thread.run_sync(wait, abandon_on_cancel=True)
        self._burials = [done for done in self._burials if not done.is_set()]

    def _bury_idle(self) -> None:
        """Release retired groups whose ops have all ended, in a thread of their own.

        Not awaited: tearing down a gloo group that held a dead peer takes ~200 ms here, and
        the new group must not wait for it (it is on the recovery path); only a backend that
        asked to ``settle_before_next`` waits. :meth:`close` waits for every burial, so no
        group outlives the process (Pitfall P4).
        """
        idle = [c for c in self._graveyard if c.idle()]
        if not idle:
            return
        self._graveyard = [c for c in self._graveyard if not c.idle()]
        self._in_thread(partial(_release_corpses, idle, self.op_timeout, collect=False))

    # --- running ops ----------------------------------------------------------------------

    async def run(self, gen: Generation, fn: Callable[[Comm, Ticket], T]) -> T:
        """Run ``fn(comm, ticket)`` in an abandonable worker thread tied to ``gen``.

        ``fn`` should stop early once ``ticket.abandoned`` is set. Cancelled: ``gen`` is
        broken, the thread abandoned and ``trio.Cancelled`` propagates. The op failed
        (RuntimeError), or ``gen`` was broken under it: ``gen`` is broken and
        :class:`CollectiveAborted` raised. Anything else ``fn`` raises propagates as it is
        and leaves ``gen`` as it was.
        """
        ticket = Ticket(comm=gen.comm)
        gen.tickets.add(ticket)

        def run() -> T:
            try:
                comm = ticket.comm
                if comm is None or ticket.abandoned:
                    raise CollectiveAborted("abandoned before it started")
                return fn(comm, ticket)
            finally:
                ticket.comm = None
                ticket.done.set()

        try:
            with ticket.scope:
                return await trio.to_thread.run_sync(
                    run, abandon_on_cancel=True, limiter=self._limiter
                )
            # Only break_() cancels ticket.scope: the group was abandoned under us.
            raise CollectiveAborted(f"group generation {gen.number} was abandoned")
        except trio.Cancelled:
            self.break_(gen)
            raise
        except (RuntimeError, CollectiveAborted) as err:
            self.break_(gen)
            if isinstance(err, CollectiveAborted):
                raise
            raise CollectiveAborted(
                f"{self.name} collective failed on generation {gen.number}: {err}"
            ) from err
        finally:
            if ticket.done.is_set():
                gen.tickets.discard(ticket)

    # --- closing --------------------------------------------------------------------------

    async def close(self) -> None:
        """Refuse new work, retire the current generation, release every group and store.

        Waits in a worker thread (at most about ``op_timeout`` per pending op) for abandoned
        ops and burials to end. Cancelled: ``trio.Cancelled`` propagates and the releases
        finish in their abandoned thread; the generations are closed either way. Idempotent.
        """
        self.closed = True
        if self.current is not None:
            self._retire(self.current)
        self.hosted.clear()
        corpses, self._graveyard = self._graveyard, []
        burials, self._burials = self._burials, []
        wait_s = self.op_timeout + 5.0

        def finish() -> None:
            for done in burials:
                done.wait(wait_s)
            _release_corpses(corpses, wait_s, collect=True)

        await trio.to_thread.run_sync(finish, abandon_on_cancel=True)
