"""Checkpoints: bundles of model and optimizer state plus the coordinator's meta, without pickle.

Importing this package is light (no torch); torch and safetensors load on first save or load.
See docs/checkpoints.md.
"""

from flodl.checkpoint.bundle import Bundle, default_stem, find_latest, load_bundle, save_bundle
from flodl.checkpoint.death import DeathRecord, read_death_records, write_death_record
from flodl.checkpoint.meta import SCHEMA_VERSION, CheckpointMeta
from flodl.checkpoint.resume import elche_for_world

__all__ = [
    "SCHEMA_VERSION",
    "Bundle",
    "CheckpointMeta",
    "DeathRecord",
    "default_stem",
    "elche_for_world",
    "find_latest",
    "load_bundle",
    "read_death_records",
    "save_bundle",
    "write_death_record",
]
