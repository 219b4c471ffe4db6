"""CheckpointMeta: what a bundle says about the run it was saved from (spec §6, schema 3)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from flodl.errors import CheckpointError
from flodl.wire.messages import SaveReason

__all__ = ["SCHEMA_VERSION", "CheckpointMeta"]

SCHEMA_VERSION = 3
"""The meta schema this flodl writes and the newest it reads."""

MANIFEST_KEY = "files"
"""Key of the bundle's file manifest inside ``<stem>.meta.json`` (not part of the meta itself)."""

LOSS_REASON = "COORDINATOR_LOST"
"""``save_reason`` of a bundle a rank saved on its own because its coordinator was lost."""

_SAVE_REASONS = frozenset(SaveReason.__members__) | {LOSS_REASON}

_COUNTERS = ("epoch", "global_step", "sync_round")


@attrs.frozen
class CheckpointMeta:
    """Where a run stood when it saved, and the coordinator state needed to resume it.

    ``save_reason`` is a :class:`~flodl.wire.messages.SaveReason` name, :data:`LOSS_REASON`, or
    None for a save that was not asked for by a shutdown; ``elche_state`` and ``guard_state``
    are the dicts of :meth:`ElChe.state` and the guard's ``state()``; ``created_unix`` is the
    wall-clock time of the save in seconds since the epoch.
    """

    epoch: int
    global_step: int
    sync_round: int
    world_size_at_save: int
    save_reason: str | None
    elche_state: dict[str, Any] | None
    guard_state: dict[str, Any] | None
    created_unix: float
    flodl_version: str
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def from_coordinator(
        cls, d: Mapping[str, Any], *, created_unix: float, flodl_version: str | None = None
    ) -> CheckpointMeta:
        """Complete ``CoordinatorMachine.checkpoint_meta()`` with the save time and version.

        Raises:
            CheckpointError: the coordinator's dict is malformed or of another schema.
        """
        if flodl_version is None:
            from flodl import __version__ as flodl_version
        return cls.from_json({**d, "created_unix": created_unix, "flodl_version": flodl_version})

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict that :meth:`from_json` turns back into an equal meta."""
        return {
            "schema_version": self.schema_version,
            "epoch": self.epoch,
            "global_step": self.global_step,
            "sync_round": self.sync_round,
            "world_size_at_save": self.world_size_at_save,
            "save_reason": self.save_reason,
            "elche_state": self.elche_state,
            "guard_state": self.guard_state,
            "created_unix": self.created_unix,
            "flodl_version": self.flodl_version,
        }

    @classmethod
    def from_json(cls, d: object) -> CheckpointMeta:
        """Check and rebuild a meta written by :meth:`to_json`.

        A bundle's file manifest (key ``"files"``) is ignored here; any other unknown key is an
        error, as is a missing one.

        Raises:
            CheckpointError: ``d`` is from a newer (or unsupported older) schema, misses a field,
                has an unknown one, or a field of the wrong type or range. The message names it.
        """
        if not isinstance(d, Mapping):
            raise CheckpointError(f"checkpoint meta must be a JSON object, got {_kind(d)}")
        version = d.get("schema_version")
        if type(version) is not int:
            raise CheckpointError(
                f"checkpoint meta schema_version must be an integer, got {version!r}"
            )
        if version > SCHEMA_VERSION:
            raise CheckpointError(
                f"checkpoint meta has schema version {version}, newer than version "
                f"{SCHEMA_VERSION} that this flodl reads; upgrade flodl to load it"
            )
        if version < SCHEMA_VERSION:
            raise CheckpointError(
                f"checkpoint meta has schema version {version}; this flodl reads only "
                f"version {SCHEMA_VERSION}"
            )
        known = {field.name for field in attrs.fields(cls)}
        unknown = sorted(set(d) - known - {MANIFEST_KEY})
        if unknown:
            raise CheckpointError(f"checkpoint meta has unknown fields {unknown}")
        missing = sorted(known - set(d))
        if missing:
            raise CheckpointError(f"checkpoint meta misses fields {missing}")

        for name in _COUNTERS:
            _expect_int(d, name, minimum=0)
        _expect_int(d, "world_size_at_save", minimum=1)
        reason = d["save_reason"]
        if reason is not None and reason not in _SAVE_REASONS:
            raise CheckpointError(
                f"checkpoint meta save_reason {reason!r} is not one of {sorted(_SAVE_REASONS)}"
            )
        for name in ("elche_state", "guard_state"):
            value = d[name]
            if value is not None and not (
                isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
            ):
                raise CheckpointError(
                    f"checkpoint meta {name} must be an object or null, got {_kind(value)}"
                )
        created = d["created_unix"]
        if isinstance(created, bool) or not isinstance(created, int | float):
            raise CheckpointError(f"checkpoint meta created_unix must be a number, got {created!r}")
        if not math.isfinite(created) or created < 0:
            raise CheckpointError(
                f"checkpoint meta created_unix must be finite and >= 0, got {created!r}"
            )
        if not isinstance(d["flodl_version"], str):
            raise CheckpointError(
                f"checkpoint meta flodl_version must be a string, got {d['flodl_version']!r}"
            )
        return cls(
            epoch=d["epoch"],
            global_step=d["global_step"],
            sync_round=d["sync_round"],
            world_size_at_save=d["world_size_at_save"],
            save_reason=reason,
            elche_state=None if d["elche_state"] is None else dict(d["elche_state"]),
            guard_state=None if d["guard_state"] is None else dict(d["guard_state"]),
            created_unix=float(created),
            flodl_version=d["flodl_version"],
            schema_version=version,
        )


def _expect_int(d: Mapping[str, Any], name: str, *, minimum: int) -> None:
    value = d[name]
    if type(value) is not int or value < minimum:
        raise CheckpointError(
            f"checkpoint meta {name} must be an integer >= {minimum}, got {value!r}"
        )


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__
