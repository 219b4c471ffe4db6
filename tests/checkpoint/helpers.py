"""Small builders shared by the checkpoint tests."""

from __future__ import annotations

from typing import Any

from flodl.checkpoint import CheckpointMeta


def make_meta(global_step: int = 120, **changes: Any) -> CheckpointMeta:
    """A valid meta (schema 3) with ``changes`` applied."""
    fields: dict[str, Any] = {
        "epoch": 2,
        "global_step": global_step,
        "sync_round": 7,
        "world_size_at_save": 3,
        "save_reason": "GRACEFUL",
        "elche_state": None,
        "guard_state": {"kind": "none"},
        "created_unix": 1_700_000_000.5,
        "flodl_version": "0.1.0",
    }
    fields.update(changes)
    return CheckpointMeta(**fields)
