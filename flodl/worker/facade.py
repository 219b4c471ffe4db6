"""The synchronous facade for ordinary torch loops: trio runs in a background thread.

::

    import flodl.worker

    with flodl.worker.join(model, optimizer) as rank:          # env from `flodl run`
        for batch in rank.batches(dataset_size=len(X), batch_size=32, epochs=10):
            loss = step(X[batch.indices], y[batch.indices])     # plain torch
            batch.done(loss)
        rank.report_final(test_accuracy=evaluate(model))

The training loop stays plain Python on the calling thread. Each hand-out of a batch is a call
into the trio thread, which first does whatever the coordinator asked in the meantime
(averaging included), so the loop and an average never touch the parameters at the same time.
Neither ``batch.done(loss)`` nor, usually, the hand-out of the next batch waits for the trio
thread: on a busy machine every wait for another thread to be scheduled costs up to
milliseconds. The trio thread reserves the next batch ahead (:mod:`flodl.worker.staging`) and
the loop takes it directly unless something needs a batch boundary first (a SyncNow, a
throttle, the end of a chunk...), in which case the hand-out goes through the trio thread.
Heartbeats and control messages are served by the trio thread whatever the loop does.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, SupportsFloat, TypeVar

import attrs
import trio

from flodl.backends.devices import bind_thread, step_marker
from flodl.errors import ConfigError, CoordinatorError, FlodlError
from flodl.wire.messages import EpochAggregated
from flodl.worker.config import WorkerConfig
from flodl.worker.runtime import Worker, open_worker
from flodl.worker.signals import StopOnSignals
from flodl.worker.streams import keep_output

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

__all__ = ["Rank", "TrainingBatch", "join"]


@attrs.define(eq=False)
class TrainingBatch:
    """One batch handed to the training loop: train on ``indices``, then call :meth:`done`."""

    epoch: int
    positions: range
    """Positions in the epoch's shared sample order."""
    indices: list[int]
    """Dataset indices of this batch's samples."""
    _rank: Rank
    averaged: bool = False
    """An average landed on this rank since the previous batch was handed out (for the
    first batch: the run's first round, which gives every rank the same start): the
    parameters are now the shared model (under ``async``: blended into it), the moment to
    evaluate it. Set before the batch is handed out, so it is exact, not a batch late."""

    def done(self, loss: SupportsFloat, *, data_ms: float = 0.0) -> None:
        """Report this batch finished with ``loss`` (a float or a one-element tensor)."""
        self._rank.step_done(loss, data_ms=data_ms)


class Rank:
    """A rank joined to its run (a context manager; see :func:`join`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        config: WorkerConfig | None = None,
    ) -> None:
        self.config = config if config is not None else WorkerConfig.from_env()
        self._model = model
        self._optimizer = optimizer
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._signals: StopOnSignals | None = None
        self._thread_error: BaseException | None = None
        self._worker: Worker | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._close: trio.Event | None = None
        self._exit_error: BaseException | None = None
        self._outstanding = False
        """A batch was handed out and its done() has not been called yet."""
        self._mark_step: Callable[[], None] | None = None
        """Marks a batch's end for the backend (a model on a GPU only)."""

    # --- context manager ------------------------------------------------------------------

    def __enter__(self) -> Rank:
        """Connect and handshake; raises what the connection raised (e.g. CoordinatorError)."""
        keep_output(self.config.run_dir / f"rank{self.config.rank}.log")
        thread = threading.Thread(
            target=self._thread_main, name=f"flodl-rank{self.config.rank}", daemon=True
        )
        self._thread = thread
        thread.start()
        self._started.wait()
        if self._worker is None:
            thread.join()
            error = self._thread_error
            if isinstance(error, BaseException):
                raise error
            raise CoordinatorError("the rank's trio thread ended before connecting")
        assert self._token is not None
        # The training loop's thread on the rank's GPU (nccl: cuda:LOCAL_RANK), so what the
        # script creates without a device index lands where the backend averages.
        bind_thread(getattr(self._worker.backend, "device", None))
        self._mark_step = step_marker(self._worker.backend, self._model)
        self._signals = StopOnSignals(self._worker, self._token)
        self._signals.install()  # under `flodl worker` only (flodl/worker/signals.py)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Leave the run: the backend and the connection are closed before this returns,
        whatever ended the block (an error, Ctrl-C or a normal end)."""
        self._exit_error = exc
        if self._signals is not None:
            self._signals.restore()
        token, close = self._token, self._close
        if token is not None and close is not None:
            try:
                trio.from_thread.run_sync(close.set, trio_token=token)
            except trio.RunFinishedError:
                pass
        if self._thread is not None:
            self._thread.join()

    def _thread_main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as err:
            self._thread_error = err
        finally:
            self._started.set()

    async def _serve(self) -> None:
        close = trio.Event()
        async with open_worker(self.config, self._model, self._optimizer) as worker:
            self._close = close
            self._token = trio.lowlevel.current_trio_token()
            self._worker = worker
            self._started.set()
            await close.wait()
            worker.note_exit(self._exit_error)

    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        if self._token is None:
            raise FlodlError("use the rank inside its `with` block")
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except (trio.RunFinishedError, trio.Cancelled):
            raise self._stopped() from self._thread_error

    def _stopped(self) -> CoordinatorError:
        """The trio thread ended under a call: an error that says why (its own error, once
        the thread has finished; it is ending, so the wait is short)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        error = self._thread_error
        why = "" if error is None else f": {type(error).__name__}: {error}"
        return CoordinatorError(f"the rank's trio thread has stopped{why}")

    @property
    def worker(self) -> Worker:
        if self._worker is None:
            raise FlodlError("use the rank inside its `with` block")
        return self._worker

    # --- the training loop's API ----------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def global_step(self) -> int:
        """The run's global step as last set by the coordinator (for LR schedules)."""
        return self.worker.global_step

    @property
    def steps_since_average(self) -> int:
        return self.worker.steps_since_average

    @property
    def last_epoch(self) -> EpochAggregated | None:
        """The latest epoch summary the coordinator broadcast (all ranks aggregated)."""
        return self.worker.last_epoch

    def batches(self, dataset_size: int, batch_size: int, epochs: int) -> Iterator[TrainingBatch]:
        """The batches this rank trains, as the coordinator hands them out.

        Sends ``Ready`` on first use. Ends when the run is shut down, and only then; raises
        ShutdownRequested after a ShutdownWithSave (the bundle is saved first),
        CoordinatorError if the coordinator is lost (a death record is written) and
        RunAborted when the coordinator lets this rank go and says why (``Abort``).
        """
        worker = self.worker
        self._call(worker.announce, dataset_size, batch_size, epochs)
        token = self._token
        assert token is not None
        averages_seen = 0
        while True:
            self._outstanding = False  # one not reported is reported by next_batch (NaN loss)
            assignment = worker.take_staged()  # no boundary needed: no wait for the trio thread
            if assignment is not None:
                try:
                    token.run_sync_soon(worker.absorb_taken)
                except trio.RunFinishedError:
                    raise CoordinatorError("the rank's trio thread has stopped") from None
            else:
                assignment = self._call(worker.next_batch)
                if assignment is None:
                    return
            self._outstanding = True
            averages, seen = worker.averages, averages_seen
            averages_seen = averages
            yield TrainingBatch(
                epoch=assignment.epoch,
                positions=range(assignment.start, assignment.stop),
                indices=list(assignment.indices),
                rank=self,
                averaged=averages != seen,
            )

    def step_done(self, loss: SupportsFloat, *, data_ms: float = 0.0) -> None:
        """Report the current batch finished (same as ``batch.done(loss)``); returns at once.

        Raises ConfigError when no batch is outstanding (done twice, or before the first).
        """
        detach = getattr(loss, "detach", None)  # a tensor that still requires grad
        value = float(detach() if callable(detach) else loss)
        worker, token = self.worker, self._token
        if not self._outstanding:
            raise ConfigError("done() without a batch handed out by batches() (or done twice)")
        self._outstanding = False
        assert token is not None
        if self._mark_step is not None:
            self._mark_step()
        try:
            token.run_sync_soon(worker.batch_done_soon, value, float(data_ms))
        except trio.RunFinishedError:
            raise CoordinatorError("the rank's trio thread has stopped") from None

    def request_checkpoint(self) -> None:
        """Ask for a bundle of this rank: the coordinator has it saved after the next settled
        averaging round (``Intent(CHECKPOINT_NOW)``). Returns once the request is sent;
        CoordinatorError once the coordinator is lost."""
        self._call(self.worker.request_checkpoint)

    def stop(self, reason: str) -> None:
        """End the run for every rank at the next averaging round (a time budget spent, a
        target loss reached): nothing more is handed out, the batches already handed out are
        trained, a last round averages them, every rank saves its final bundle (the same
        model on every rank) and :meth:`batches` ends as after the last epoch, so the script
        goes on to its evaluation and exits 0. Returns once the request is sent; ``reason``
        is shown in the run's summary and event log. A second stop does nothing;
        CoordinatorError once the coordinator is lost."""
        self._call(self.worker.stop, reason)

    def report_final(self, **metrics: float) -> None:
        """Record final metrics (e.g. ``test_accuracy=0.97``) for the run summary."""
        worker = self.worker
        try:
            trio.from_thread.run_sync(
                lambda: worker.report_final(**metrics), trio_token=self._token
            )
        except trio.RunFinishedError:
            raise CoordinatorError("the rank's trio thread has stopped") from None


def join(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: WorkerConfig | None = None,
) -> Rank:
    """Join the run the launcher started this process for (config from the environment).

    Use as ``with join(model, optimizer) as rank: ...``; see the module docstring.
    """
    return Rank(model, optimizer, config)
