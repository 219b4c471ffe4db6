"""The next batch, picked ahead so a training thread can take it without waiting (thread-safe).

With the synchronous facade the training loop runs on its own thread, and a hand-out that is a
round trip into the trio thread waits for that thread to be scheduled: up to milliseconds on a
busy machine. So the trio thread reserves the batch that comes next
(:meth:`StagedBatch.offer`) whenever nothing is waiting for a batch boundary, and the training
thread takes it directly (:meth:`StagedBatch.take`). Anything that needs a boundary (a queued
SyncNow, a throttle, the end of the run...) first makes the reservation untakeable
(:meth:`StagedBatch.invalidate`); the boundary then hands the reserved batch out itself
(:meth:`StagedBatch.reclaim`). A take and an invalidation are ordered by one lock, so a message
that arrives after a take waits for the next boundary, exactly as one arriving during a step.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class StagedBatch(Generic[T]):
    """At most one reserved batch; the trio thread offers and reclaims, the training thread
    takes. Every method is safe to call from either thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batch: T | None = None
        self._takeable = False
        self._taken: T | None = None

    @property
    def reserved(self) -> bool:
        """A batch is reserved (takeable or not) and has not been handed out yet."""
        with self._lock:
            return self._batch is not None

    def offer(self, batch: T) -> None:
        """Reserve ``batch`` and let the training thread take it (trio thread)."""
        with self._lock:
            if self._batch is not None:
                raise RuntimeError("a batch is already reserved")
            self._batch, self._takeable = batch, True

    def invalidate(self) -> None:
        """Something needs a boundary first: the reserved batch can no longer be taken."""
        with self._lock:
            self._takeable = False

    def take(self) -> T | None:
        """The reserved batch if it may be taken now, else None (training thread)."""
        with self._lock:
            batch = self._batch if self._takeable else None
            if batch is not None:
                self._batch, self._takeable, self._taken = None, False, batch
            return batch

    def claim_taken(self) -> T | None:
        """The batch the training thread took since the last call, once (trio thread)."""
        with self._lock:
            taken, self._taken = self._taken, None
            return taken

    def reclaim(self) -> T | None:
        """Hand the reserved batch to the boundary instead (trio thread); None if none."""
        with self._lock:
            batch, self._batch, self._takeable = self._batch, None, False
            return batch
