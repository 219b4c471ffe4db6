"""One exception hierarchy for flodl.

Every error flodl raises on purpose derives from :class:`FlodlError`, so a training script can
catch flodl's failures in one place. Each message says what was wrong and where.
"""

from __future__ import annotations


class FlodlError(Exception):
    """Root of every error flodl raises on purpose."""


class ConfigError(FlodlError, ValueError):
    """A setting is missing, out of range or inconsistent with another."""


class OutOfTurn(ConfigError):
    """A call the rank's state does not allow (``done()`` with no batch handed out, an event
    the rank machine cannot take now)."""


# --- wire -----------------------------------------------------------------------------------


class WireError(FlodlError):
    """Bytes from a peer could not be turned into a trusted message."""


class ProtocolError(WireError):
    """A frame or its payload breaks the protocol (bad magic, garbage CBOR, bad fields)."""


class FrameTooLarge(ProtocolError):
    """A frame header announced a payload above the configured limit (rejected before reading)."""


class TruncatedFrame(ProtocolError):
    """The stream ended in the middle of a frame."""


class UnknownMessage(ProtocolError):
    """A frame carried a message tag this version does not know."""


class MessageValidationError(ProtocolError):
    """A payload decoded, but its fields are missing, extra or of the wrong type or range."""


class UnexpectedMessage(ProtocolError):
    """A well-formed message arrived in a state where the protocol does not allow it."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version."""


class AgentRefused(ProtocolError):
    """The coordinator will not take a node agent's claim (a node that has an agent, ranks past
    the world size, a rank the agent does not speak for); the message says why."""


class AuthenticationError(WireError):
    """A frame's MAC does not verify under the session key (forged, corrupted or wrong key)."""


class SequenceError(AuthenticationError):
    """An authentic frame arrived out of order: replayed, reordered or after a dropped one."""


class HandshakeError(FlodlError):
    """The opening exchange between a rank and the coordinator failed."""


class WrongKey(HandshakeError, AuthenticationError):
    """The peer does not hold the session key."""


class HandshakeVersionMismatch(HandshakeError, VersionMismatch):
    """The peer's handshake names another protocol version."""


class WorldSizeMismatch(HandshakeError):
    """The rank and the coordinator disagree on the world size."""


class RankOutOfRange(HandshakeError):
    """The rank id is not in ``range(world_size)``."""


class DuplicateRank(HandshakeError):
    """Another live connection already holds this rank id."""


class ReplayedHello(HandshakeError, AuthenticationError):
    """A hello this coordinator already accepted, sent again (a recording): refused unanswered,
    so a replay cannot hold a rank id that its owner needs."""


class SignatureMismatch(HandshakeError):
    """The rank's model or dataset signature differs from the coordinator's."""


class HandshakeTimeout(HandshakeError):
    """The peer did not complete the handshake before its deadline."""


class RejectedByCoordinator(HandshakeError):
    """The coordinator refused this rank and said why (the reason is in the message)."""


# --- transport ------------------------------------------------------------------------------


class TransportError(FlodlError):
    """A connection could not be opened, or broke while in use."""


class UnsupportedURL(TransportError, ValueError):
    """A transport URL has an unknown scheme or a malformed address."""


class AddressInUse(TransportError):
    """The listening address is held by a live process."""


class ChannelClosed(TransportError):
    """The peer closed the channel cleanly, at a frame boundary."""


class BrokenChannel(TransportError):
    """The channel broke: reset, cut, or used after a fatal error."""


# --- coordination, training, saving ---------------------------------------------------------


class CoordinatorError(FlodlError):
    """The coordinator cannot go on (the message says why)."""


class RunAborted(FlodlError):
    """The coordinator ended this rank's run without a save (the run could not start, or it
    refused or disconnected this rank); the message says why. The training loop raises it
    from its next batch: the run did not complete for this rank."""


class RankDeclaredDead(FlodlError):
    """This rank was declared dead by the coordinator."""


class BackendError(FlodlError):
    """A parameter-averaging backend failed (group formation or a collective)."""


class CollectiveAborted(BackendError):
    """A collective was abandoned (a peer died, or the coordinator asked to abandon it)."""


class CheckpointError(FlodlError):
    """A checkpoint could not be written or read (bad schema, newer version, missing file)."""


class ShutdownRequested(FlodlError, SystemExit):
    """The coordinator ended the run with a save; ``reason`` says why.

    It is also a ``SystemExit``, so a script that does not catch it ends as ``sys.exit`` would,
    without a traceback (the rank has said why on stderr): status 0 after a stop the run was
    asked for (``stopped_as_asked``: Ctrl-C, SIGTERM, a rank's save-and-stop), whose bundles
    are saved and resumable; status 1 after a save the run was driven to (a stalled round, too
    few ranks left), so that a scheduler sees a run that did not do its work. ``except
    Exception`` and ``except FlodlError`` still catch it.
    """

    def __init__(
        self, message: str, reason: object | None = None, *, stopped_as_asked: bool = False
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.stopped_as_asked = stopped_as_asked
        self.code = self.exit_status

    @property
    def exit_status(self) -> int:
        """What the rank's process exits with when this ends it: 0 or 1 (class docstring)."""
        return 0 if self.stopped_as_asked else 1
