"""CheckpointMeta: JSON round trip, schema checks, malformed fields, the coordinator's dict."""

from __future__ import annotations

import math
from typing import Any

import pytest

from flodl.checkpoint import SCHEMA_VERSION, CheckpointMeta
from flodl.config import CoordinatorConfig
from flodl.core.coordinator.machine import CoordinatorMachine
from flodl.errors import CheckpointError
from flodl.wire.messages import SaveReason

from .helpers import make_meta


def test_round_trip_through_json() -> None:
    meta = make_meta(elche_state={"anchor": 12, "smoothed_ms": [1.5, None]})
    d = meta.to_json()
    assert d["schema_version"] == 3 == SCHEMA_VERSION
    assert d["save_reason"] == "GRACEFUL"
    assert CheckpointMeta.from_json(d) == meta


def test_every_save_reason_name_is_accepted() -> None:
    for reason in SaveReason:
        d = make_meta().to_json() | {"save_reason": reason.name}
        assert CheckpointMeta.from_json(d).save_reason == reason.name
    assert (
        CheckpointMeta.from_json(make_meta().to_json() | {"save_reason": None}).save_reason is None
    )


def test_newer_schema_is_rejected_naming_both_versions() -> None:
    d = make_meta().to_json() | {"schema_version": 4, "coverage": [1, 2]}
    with pytest.raises(CheckpointError, match=r"schema version 4.*version 3"):
        CheckpointMeta.from_json(d)


def test_older_schema_is_rejected() -> None:
    with pytest.raises(CheckpointError, match=r"schema version 2"):
        CheckpointMeta.from_json(make_meta().to_json() | {"schema_version": 2})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("schema_version", "3", "schema_version must be an integer"),
        ("epoch", -1, "epoch must be an integer >= 0"),
        ("epoch", 1.0, "epoch must be an integer"),
        ("global_step", True, "global_step must be an integer"),
        ("sync_round", None, "sync_round must be an integer"),
        ("world_size_at_save", 0, "world_size_at_save must be an integer >= 1"),
        ("save_reason", "Crash", "save_reason 'Crash' is not one of"),
        ("save_reason", 1, "save_reason 1 is not one of"),
        ("elche_state", [1, 2], "elche_state must be an object or null"),
        ("guard_state", "trend", "guard_state must be an object or null"),
        ("created_unix", "yesterday", "created_unix must be a number"),
        ("created_unix", math.inf, "created_unix must be finite"),
        ("flodl_version", 1, "flodl_version must be a string"),
    ],
)
def test_malformed_field_is_rejected(field: str, value: Any, message: str) -> None:
    d = make_meta().to_json() | {field: value}
    with pytest.raises(CheckpointError, match=message):
        CheckpointMeta.from_json(d)


def test_missing_and_unknown_fields_are_rejected() -> None:
    d = make_meta().to_json()
    del d["sync_round"]
    with pytest.raises(CheckpointError, match=r"misses fields \['sync_round'\]"):
        CheckpointMeta.from_json(d)
    with pytest.raises(CheckpointError, match=r"unknown fields \['surprise'\]"):
        CheckpointMeta.from_json(make_meta().to_json() | {"surprise": 1})
    with pytest.raises(CheckpointError, match="must be a JSON object, got list"):
        CheckpointMeta.from_json([1, 2, 3])


def test_completes_the_coordinators_meta() -> None:
    machine = CoordinatorMachine(3, CoordinatorConfig().machine_settings(), now=0.0)
    meta = CheckpointMeta.from_coordinator(
        machine.checkpoint_meta(), created_unix=1_700_000_123.25, flodl_version="9.9"
    )
    assert (meta.epoch, meta.global_step, meta.sync_round) == (0, 0, 0)
    assert meta.world_size_at_save == 3
    assert meta.save_reason is None
    assert meta.elche_state is not None and meta.elche_state["anchor"] == 10
    assert meta.guard_state is not None and "kind" in meta.guard_state
    assert (meta.created_unix, meta.flodl_version) == (1_700_000_123.25, "9.9")
    default = CheckpointMeta.from_coordinator(machine.checkpoint_meta(), created_unix=0.0)
    assert default.flodl_version == __import__("flodl").__version__
