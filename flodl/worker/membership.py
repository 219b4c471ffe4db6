"""Which process-group generation a rank belongs to, and joining each one announced.

The coordinator announces generations (``NewGroupSession``) and may doom the current one
(``DeclareDead``: a member died, its collectives will never finish). A rank joins the newest
announced generation in a task of its own (:meth:`GroupMembership.join_announced`); an older
join still in progress is cancelled when a newer one is announced. Averaging rounds name the
generation they belong to, and :meth:`GroupMembership.standing_for` says whether this rank
can take part in one, never will, or must wait.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from flodl.errors import BackendError
from flodl.wire.messages import (
    JoinResult,
    Message,
    NewGroupReady,
    NewGroupSession,
    Note,
    RequestNewGroup,
)

if TYPE_CHECKING:
    from flodl.backends import Backend

log = logging.getLogger("flodl.worker")


class Standing(enum.Enum):
    """Where a rank stands for a round of one generation."""

    MEMBER = "member"  # joined it: the round can run
    NEVER = "never"  # doomed, or a newer one was joined: skip the round
    NOT_YET = "not_yet"  # announced or still to come: wait for a change


class GroupMembership:
    """The generations this rank joined, was announced and saw doomed (-1: none yet)."""

    def __init__(
        self,
        backend: Backend,
        rank: int,
        on_change: Callable[[], None],
        report: Callable[[Message], None],
    ) -> None:
        """``on_change`` runs after every join attempt (joined, failed or superseded);
        ``report`` sends the coordinator each join's end (``JoinResult``; none when superseded)."""
        self._backend = backend
        self._rank = rank
        self._on_change = on_change
        self._report = report
        self.joined = -1
        self.group_rank = -1
        """This rank's rank inside the joined generation."""
        self.announced = -1
        self.doomed = -1
        self._join_scope: trio.CancelScope | None = None
        self._sessions_send, self._sessions = trio.open_memory_channel[NewGroupSession](math.inf)
        self.host = "127.0.0.1"
        """This rank's address for its peers: where it hosts a group's store, where gloo
        listens (set once the connection to the coordinator shows which address that is)."""

    def announce(self, session: NewGroupSession) -> None:
        """Queue ``session`` for joining; a join of an older generation in progress stops."""
        self.announced = max(self.announced, session.generation)
        if self._join_scope is not None:
            self._join_scope.cancel()
        self._sessions_send.send_nowait(session)

    def prepare(self, request: RequestNewGroup) -> Message:
        """Host generation ``request.generation``: NewGroupReady with its rendezvous info, or
        a Note saying why this rank cannot (the coordinator then asks another)."""
        try:
            info = self._backend.prepare_group(request.generation, self.host)
        except BackendError as err:
            log.warning("rank %d: cannot host group %d: %s", self._rank, request.generation, err)
            return Note(rank=self._rank, detail=str(err)[:200])
        return NewGroupReady(rank=self._rank, generation=request.generation, info=info)

    def doom(self) -> None:
        """A member died: no round of any generation joined or announced so far will run."""
        self.doomed = max(self.doomed, self.joined, self.announced)

    def stop_joining(self) -> None:
        """Cancel the join in progress, if any (the coordinator is lost)."""
        if self._join_scope is not None:
            self._join_scope.cancel()

    def standing_for(self, generation: int) -> Standing:
        if generation <= self.doomed or self.joined > generation:
            return Standing.NEVER
        if self.joined == generation:
            return Standing.MEMBER
        return Standing.NOT_YET

    async def join_announced(self) -> None:
        """Join each announced generation in turn, skipping superseded ones; runs until
        cancelled. A failed join is logged; the coordinator re-forms the group again."""
        async for session in self._sessions:
            if session.generation < self.announced:
                continue  # superseded before we got to it
            with trio.CancelScope() as scope:
                self._join_scope = scope
                try:
                    await self._backend.join_group(
                        session.info,
                        session.new_rank,
                        session.new_world_size,
                        session.generation,
                        self.host,
                    )
                    self.joined = session.generation
                    self.group_rank = session.new_rank
                    self._report(JoinResult(self._rank, session.generation, joined=True))
                except BackendError as err:
                    log.warning(
                        "rank %d: could not join group %d: %s", self._rank, session.generation, err
                    )
                    self._report(JoinResult(self._rank, session.generation, joined=False))
                finally:
                    self._join_scope = None
            if scope.cancelled_caught:
                log.info("rank %d: join of group %d superseded", self._rank, session.generation)
            self._on_change()
