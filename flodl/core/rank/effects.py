"""What the rank machine asks its shell to do.

Two kinds. *Reactions* come from any event and are performed at once, in order: send a
message, wake the boundary, prepare or join a group, cancel the round in flight, give up on
the coordinator. *Boundary steps* come only from :meth:`RankMachine.boundary
<flodl.core.rank.machine.RankMachine.boundary>`, which returns reactions followed by exactly one
step: hand out a batch, average, blend, save, finish, raise, or wait for a change. Performing
a step may take time (a collective, a save); the shell then reports how it went to the
machine and asks for the next step.
"""

from __future__ import annotations

import attrs

from flodl.core.common.work import BatchSlice
from flodl.wire.messages import Checkpoint, Message, NewGroupSession, RequestNewGroup, SyncNow

__all__ = [
    "Average",
    "Blend",
    "BoundaryStep",
    "CancelRound",
    "DoomGroup",
    "Finish",
    "GiveUp",
    "HandOut",
    "Ignored",
    "JoinGroup",
    "PrepareGroup",
    "Raise",
    "RankEffect",
    "Reaction",
    "SaveAndStop",
    "SaveCheckpoint",
    "SaveOnLoss",
    "Send",
    "Wait",
    "Wake",
]

# --- reactions ---------------------------------------------------------------------------


@attrs.frozen
class Send:
    """Send ``message`` to the coordinator, after every message sent before it."""

    message: Message


@attrs.frozen
class Wake:
    """Something changed: wake whatever waits for a change. ``boundary``: the change needs a
    batch boundary, so a batch reserved ahead must not be taken without one."""

    boundary: bool = True


@attrs.frozen
class PrepareGroup:
    """Host generation ``request.generation`` and answer NewGroupReady (or a Note why not)."""

    request: RequestNewGroup


@attrs.frozen
class JoinGroup:
    """Join the announced generation (a newer announcement supersedes a join in progress)."""

    session: NewGroupSession


@attrs.frozen
class DoomGroup:
    """Rank ``dead_rank`` died: no round of a generation joined or announced so far will run."""

    dead_rank: int


@attrs.frozen
class CancelRound:
    """Cancel the collective in flight and abandon the background round, if any."""


@attrs.frozen
class GiveUp:
    """The coordinator is lost: record why (the death record), stop joining groups."""

    error: Exception


@attrs.frozen
class Ignored:
    """A message this rank does nothing with (worth a log line, not an error)."""

    message: Message
    why: str


Reaction = Send | Wake | PrepareGroup | JoinGroup | DoomGroup | CancelRound | GiveUp | Ignored

# --- boundary steps ------------------------------------------------------------------------


@attrs.frozen
class HandOut:
    """Train ``batch`` next. ``reserved``: it is the batch reserved ahead (take it back)."""

    batch: BatchSlice
    reserved: bool = False


@attrs.frozen
class Wait:
    """Nothing to do until something changes (a message, a landed round): wait, ask again."""


@attrs.frozen
class Average:
    """Average for ``sync`` once this rank is in its generation. ``background`` (Async policy):
    start the collective on a snapshot and go on training; it is blended in later."""

    sync: SyncNow
    background: bool = False


@attrs.frozen
class Blend:
    """The background round for ``sync`` landed: blend it into the live parameters (EASGD).

    ``exact``: nothing was trained since its snapshot, so the live parameters are the snapshot
    and there is no local progress to keep: the average replaces them as it is, as under Sync
    and Cadence. The run's last round is always such a round on every member (every batch is
    reported before it starts), so an Async run ends with one model on every rank.
    """

    sync: SyncNow
    exact: bool = False


@attrs.frozen
class SaveCheckpoint:
    """Save a versioned bundle for ``request`` and report it (``checkpoint_finished``)."""

    request: Checkpoint


@attrs.frozen
class SaveAndStop:
    """Save this rank's bundle before stopping, because of ``reason`` (``save_finished``)."""

    reason: str


@attrs.frozen
class SaveOnLoss:
    """The coordinator is lost: save this rank's own bundle before the loop is told
    (``loss_save_finished``), so a run whose coordinator died keeps its training."""


@attrs.frozen
class Finish:
    """The run is over for this rank (goodbye sent): the training loop ends."""


@attrs.frozen
class Raise:
    """Raise ``error`` to the training loop (the coordinator is lost, or it asked to save and
    stop)."""

    error: Exception


BoundaryStep = (
    HandOut | Wait | Average | Blend | SaveCheckpoint | SaveAndStop | SaveOnLoss | Finish | Raise
)
RankEffect = Reaction | BoundaryStep
