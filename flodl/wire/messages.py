"""The control-message catalogue: frozen attrs classes, each with a stable integer tag.

Tags never change once released; new messages get new tags. Tags 1-63 travel from the
coordinator to a rank, 64-127 from a rank to the coordinator (see :data:`TO_RANK` and
:data:`TO_COORDINATOR`), 128-159 from a node agent to the coordinator and 160-191 back
(:data:`FROM_AGENT`, :data:`TO_AGENT`), so a frame going the wrong way, or reaching the wrong
kind of peer, is rejected as unknown.

On the wire a message is its tag (in the frame header) and a CBOR map of its fields
(:func:`to_payload` / :func:`from_payload`, built by :mod:`flodl.wire.payload` from this
catalogue). Constructing a message validates every field, so a decoded message is as
trustworthy as one built locally.
"""

from __future__ import annotations

import enum
from typing import ClassVar

import attrs

from flodl.errors import MessageValidationError
from flodl.wire.agent_messages import FROM_AGENT as FROM_AGENT
from flodl.wire.agent_messages import TO_AGENT as TO_AGENT
from flodl.wire.agent_messages import AgentJoin as AgentJoin  # one catalogue: every message
from flodl.wire.agent_messages import AgentRefusal as AgentRefusal
from flodl.wire.agent_messages import AgentStop as AgentStop
from flodl.wire.agent_messages import AssignRanks as AssignRanks
from flodl.wire.agent_messages import KillRank as KillRank
from flodl.wire.agent_messages import RankClosed as RankClosed
from flodl.wire.agent_messages import RankEnd as RankEnd
from flodl.wire.agent_messages import RankExited as RankExited
from flodl.wire.agent_messages import RankOpen as RankOpen
from flodl.wire.agent_messages import RanksDown as RanksDown
from flodl.wire.agent_messages import RanksUp as RanksUp
from flodl.wire.agent_messages import RunOver as RunOver
from flodl.wire.fields import (
    blob,
    boolean,
    duration_list,
    duration_ms,
    f64,
    f64_list,
    int_enum,
    opt_f64,
    opt_text,
    scalar_map,
    text,
    u64,
)
from flodl.wire.message_base import Message as Message
from flodl.wire.payload import Payloads


class SaveReason(enum.IntEnum):
    """Why the coordinator asked the ranks to save and stop (floDl values, plus Checkpoint)."""

    GRACEFUL = 0
    MAX_FAILURE = 1
    SINGLE_SURVIVOR = 2
    ALL_RANKS_LOST = 3
    REDUCE_STALL = 4
    CHECKPOINT = 5


class IntentKind(enum.IntEnum):
    """What a rank asks the coordinator to arrange at the next averaging round."""

    EVAL_NOW = 0
    CHECKPOINT_NOW = 1
    SAVE_AND_STOP = 2
    """End the run with ShutdownWithSave(GRACEFUL): the rank's process got SIGTERM or SIGINT
    (``flodl worker``)."""
    STOP = 3
    """End the training at the next round: nothing more is handed out, a last round averages
    what was trained, and the run completes with one model (``rank.stop(reason)``)."""


# --- coordinator -> rank (tags 1..63) -------------------------------------------------------


@attrs.frozen
class SyncNow(Message):
    """Average parameters now. ``round`` numbers averaging rounds; ``generation`` is the group."""

    TAG: ClassVar[int] = 1
    round: int = u64()
    generation: int = u64()


@attrs.frozen
class SetGlobalStep(Message):
    """Re-base the rank's global step (learning-rate schedules read it)."""

    TAG: ClassVar[int] = 2
    global_step: int = u64()


@attrs.frozen
class StartEpoch(Message):
    """Train on ``[partition_offset, partition_offset + partition_size)`` of the epoch's order."""

    TAG: ClassVar[int] = 3
    epoch: int = u64()
    partition_offset: int = u64()
    partition_size: int = u64()


@attrs.frozen
class ExtendPartition(Message):
    """Also train on ``[offset, offset + size)`` of the epoch's order (a dead rank's remainder)."""

    TAG: ClassVar[int] = 4
    epoch: int = u64()
    offset: int = u64()
    size: int = u64()


@attrs.frozen
class DeclareDead(Message):
    """Rank ``rank`` is dead: abandon any collective that includes it."""

    TAG: ClassVar[int] = 5
    rank: int = u64()


@attrs.frozen
class RequestNewGroup(Message):
    """You generate what the backend needs for group ``generation`` and reply NewGroupReady."""

    TAG: ClassVar[int] = 6
    generation: int = u64()
    world_size: int = u64()


@attrs.frozen
class NewGroupSession(Message):
    """Join group ``generation`` as ``new_rank`` of ``new_world_size``; ``info`` is backend data."""

    TAG: ClassVar[int] = 7
    generation: int = u64()
    new_rank: int = u64()
    new_world_size: int = u64()
    info: bytes = blob()


@attrs.frozen
class Throttle(Message):
    """Pause after the current batch until SyncNow, SetGlobalStep or Shutdown arrives."""

    TAG: ClassVar[int] = 8


@attrs.frozen
class Checkpoint(Message):
    """Rank ``target_rank`` writes checkpoint ``version`` and answers CheckpointResult."""

    TAG: ClassVar[int] = 9
    version: int = u64()
    target_rank: int = u64()


@attrs.frozen
class SaveConsensusModel(Message):
    """Rank ``target_rank`` saves the freshly averaged (consensus) parameters."""

    TAG: ClassVar[int] = 10
    target_rank: int = u64()


@attrs.frozen
class Shutdown(Message):
    """Stop training and exit cleanly; no save is asked for."""

    TAG: ClassVar[int] = 11


@attrs.frozen
class ShutdownWithSave(Message):
    """Save a checkpoint, then exit; ``reason`` says why the run cannot go on."""

    TAG: ClassVar[int] = 12
    reason: SaveReason = int_enum(SaveReason)


@attrs.frozen
class CoordHeartbeat(Message):
    """The coordinator is alive (sent every heartbeat interval)."""

    TAG: ClassVar[int] = 13


@attrs.frozen
class EpochAggregated(Message):
    """Epoch ``epoch`` finished on every live rank: aggregated metrics."""

    TAG: ClassVar[int] = 14
    epoch: int = u64()
    avg_loss: float = f64()
    samples: int = u64()
    epoch_ms: float = duration_ms()
    rank_throughput: tuple[float, ...] = f64_list()
    scalars: tuple[tuple[str, float], ...] = scalar_map()


@attrs.frozen
class Abort(Message):
    """The coordinator lets this rank go without a save: ``reason`` says why (the run could
    not start, or this rank was refused or disconnected). The rank's run did not complete."""

    TAG: ClassVar[int] = 15
    reason: str = text()


@attrs.frozen
class RunSettings(Message):
    """The run's settings, the coordinator's first message to each rank it admits: a worker
    takes them where it was told nothing, and refuses to run where it was told otherwise.
    ``backend`` None and ``keep_checkpoints`` 0: the rank's own choice. ``outer*``: the
    outer optimizer every rank applies to each round's average, ``average_dtype`` what rounds
    reduce in (never the rank's choice)."""

    TAG: ClassVar[int] = 16
    policy: str = text()
    seed: int = u64()
    heartbeat_interval: float = f64()
    heartbeat_timeout: float = f64()
    backend: str | None = opt_text()
    keep_checkpoints: int = u64(default=0)
    outer: str = text(default="none")
    outer_lr: float = f64(default=0.7)
    outer_momentum: float = f64(default=0.9)
    average_dtype: str = text(default="fp32")


# --- rank -> coordinator (tags 64..127) -----------------------------------------------------


@attrs.frozen
class Batch(Message):
    """One training step finished on ``rank``."""

    TAG: ClassVar[int] = 64
    rank: int = u64()
    batch_ms: float = duration_ms()
    data_ms: float = duration_ms()
    step_count: int = u64()
    batch_loss: float = f64()
    param_norm: float | None = opt_f64()
    sync_divergence: float | None = opt_f64()


@attrs.frozen
class SyncAck(Message):
    """``rank`` finished averaging round ``round``; divergence and norms of its parameters."""

    TAG: ClassVar[int] = 65
    rank: int = u64()
    round: int = u64()
    step_count: int = u64()
    divergence: float | None = opt_f64()
    post_norm: float | None = opt_f64()
    pre_norm: float | None = opt_f64()


@attrs.frozen
class Heartbeat(Message):
    """``rank`` is alive; ``step_count`` is its step counter since the last average."""

    TAG: ClassVar[int] = 66
    rank: int = u64()
    step_count: int = u64()


@attrs.frozen
class Exiting(Message):
    """``rank`` is leaving on purpose; do not wait for its heartbeat to lapse."""

    TAG: ClassVar[int] = 67
    rank: int = u64()


@attrs.frozen
class NewGroupReady(Message):
    """The generator for ``generation`` is ready; ``info`` is what the backend needs."""

    TAG: ClassVar[int] = 68
    rank: int = u64()
    generation: int = u64()
    info: bytes = blob()


@attrs.frozen
class LrUpdate(Message):
    """``rank``'s optimiser now uses learning rate ``lr``."""

    TAG: ClassVar[int] = 69
    rank: int = u64()
    lr: float = f64()


@attrs.frozen
class Intent(Message):
    """``rank`` asks for an evaluation or a checkpoint at the next averaging round, for the run
    to save and stop, or for the training to stop after a last round."""

    TAG: ClassVar[int] = 70
    rank: int = u64()
    kind: IntentKind = int_enum(IntentKind)
    reason: str | None = opt_text()
    """Why (``STOP``: the script's reason, shown in the run's summary and event log)."""


STOP_SAVE_VERSION = 0
"""The ``CheckpointResult`` version of the bundle a rank wrote for ``ShutdownWithSave``
(numbered checkpoints start at 1)."""


@attrs.frozen
class CheckpointResult(Message):
    """``rank`` wrote (or failed to write) checkpoint ``version``, or (version
    :data:`STOP_SAVE_VERSION`) the bundle ``ShutdownWithSave`` asked for."""

    TAG: ClassVar[int] = 71
    rank: int = u64()
    version: int = u64()
    elapsed_ms: float = duration_ms()
    error: str | None = opt_text()
    path: str | None = opt_text()
    """Where the bundle was written (its stem's path), when it was."""


@attrs.frozen
class Metrics(Message):
    """``rank``'s share of epoch ``epoch``: loss, work done and named scalars."""

    TAG: ClassVar[int] = 72
    rank: int = u64()
    epoch: int = u64()
    avg_loss: float = f64()
    batches_processed: int = u64()
    samples_processed: int = u64()
    epoch_ms: float = duration_ms()
    scalars: tuple[tuple[str, float], ...] = scalar_map()


@attrs.frozen
class Note(Message):
    """A short free-text note from ``rank`` (e.g. why it is about to exit) for the timeline."""

    TAG: ClassVar[int] = 73
    rank: int = u64()
    detail: str = text()


@attrs.frozen
class Ready(Message):
    """``rank`` is set up and describes its job: samples per epoch, batch size, epochs.

    Sent once, right after the handshake; every rank of a run must describe the same job.
    """

    TAG: ClassVar[int] = 74
    rank: int = u64()
    dataset_size: int = u64()
    batch_size: int = u64()
    epochs: int = u64()


@attrs.frozen
class Batches(Message):
    """Several training steps ``rank`` finished, oldest first, in one frame: the i-th entry of
    each list is what the i-th of ``len(batch_ms)`` ``Batch`` reports would say, and the
    coordinator takes them exactly as those reports arriving together.

    ``step_count`` is the rank's step count after the last of them (the i-th had
    ``step_count - n + 1 + i``). A rank that coalesces its reports sends one when it has
    something else to send (the reports go first, so order is kept) and in place of a
    heartbeat, so every report reaches the coordinator within two heartbeat intervals.
    Validation: 1 to 65536 entries, the three lists of equal length, ``step_count >= n``;
    times finite and >= 0, losses any float (NaN: not measured).
    """

    TAG: ClassVar[int] = 75
    rank: int = u64()
    step_count: int = u64()
    batch_ms: tuple[float, ...] = duration_list()
    data_ms: tuple[float, ...] = duration_list()
    batch_loss: tuple[float, ...] = f64_list()

    def __attrs_post_init__(self) -> None:
        n = len(self.batch_ms)
        if n == 0:
            raise MessageValidationError("field 'batch_ms': expected at least one batch, got none")
        if len(self.data_ms) != n or len(self.batch_loss) != n:
            raise MessageValidationError(
                f"fields 'batch_ms', 'data_ms', 'batch_loss': expected lists of equal length, "
                f"got {n}, {len(self.data_ms)} and {len(self.batch_loss)}"
            )
        if self.step_count < n:
            raise MessageValidationError(
                f"field 'step_count': expected at least the {n} batches reported, "
                f"got {self.step_count}"
            )

    def report(self, index: int) -> Batch:
        """The ``Batch`` report of entry ``index`` (0: the oldest)."""
        return Batch(
            self.rank,
            self.batch_ms[index],
            self.data_ms[index],
            self.step_count - len(self.batch_ms) + 1 + index,
            self.batch_loss[index],
        )

    def reports(self) -> list[Batch]:
        """The ``Batch`` report of each entry, oldest first."""
        return [self.report(index) for index in range(len(self.batch_ms))]


@attrs.frozen
class JoinResult(Message):
    """``rank``'s join of group ``generation`` ended: it joined, or (``joined`` False) it
    could not. A round's reduce-stall clock starts once every member's join ended."""

    TAG: ClassVar[int] = 76
    rank: int = u64()
    generation: int = u64()
    joined: bool = boolean()


TO_RANK: tuple[type[Message], ...] = (
    SyncNow,
    SetGlobalStep,
    StartEpoch,
    ExtendPartition,
    DeclareDead,
    RequestNewGroup,
    NewGroupSession,
    Throttle,
    Checkpoint,
    SaveConsensusModel,
    Shutdown,
    ShutdownWithSave,
    CoordHeartbeat,
    EpochAggregated,
    Abort,
    RunSettings,
)
"""Messages the coordinator sends to ranks."""

TO_COORDINATOR: tuple[type[Message], ...] = (
    Batch,
    SyncAck,
    Heartbeat,
    Exiting,
    NewGroupReady,
    LrUpdate,
    Intent,
    CheckpointResult,
    Metrics,
    Note,
    Ready,
    Batches,
    JoinResult,
)
"""Messages ranks send to the coordinator."""

ALL_MESSAGES: tuple[type[Message], ...] = TO_RANK + TO_COORDINATOR + FROM_AGENT + TO_AGENT

_PAYLOADS = Payloads(ALL_MESSAGES)

BY_TAG: dict[int, type[Message]] = _PAYLOADS.by_tag
"""Every message class by its wire tag."""

to_payload = _PAYLOADS.to_payload
from_payload = _PAYLOADS.from_payload

TO_RANK_TAGS: frozenset[int] = frozenset(cls.TAG for cls in TO_RANK)
TO_COORDINATOR_TAGS: frozenset[int] = frozenset(cls.TAG for cls in TO_COORDINATOR)
FROM_AGENT_TAGS: frozenset[int] = frozenset(cls.TAG for cls in FROM_AGENT)
TO_AGENT_TAGS: frozenset[int] = frozenset(cls.TAG for cls in TO_AGENT)
