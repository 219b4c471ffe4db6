"""Files a rank leaves in its run directory: the exit report and the death record.

* ``rank<N>.json``: written at exit, read by the launcher into ``summary.json``:
  ``{rank, steps, batches, syncs, idle_s, wall_s, final_metrics, exit_reason, ...}``.
* a death record, written when the rank gives up on its coordinator, by
  :func:`flodl.checkpoint.write_death_record` (``{rank, world_size, error, unix_time_secs}``):
  next to the rank's latest bundle (``<stem>.rank<N>.death.json``, where loading that bundle
  finds it), or ``<run_dir>/flodl.rank<N>.death.json`` when the rank saved none.

Both are written atomically (temporary file, then rename), so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flodl.checkpoint.files import write_atomically
from flodl.errors import CheckpointError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("flodl.worker")


def report_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank{rank}.json"


DEATH_STEM = "flodl"
"""Stem of a death record written where no bundle is (``<run_dir>/flodl.rank<N>.death.json``)."""


def _jsonable(value: Any) -> Any:
    """Non-finite floats become None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` as JSON; readers see the old file or the whole new one, and a
    write that fails (a full disk) leaves no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(_jsonable(data), indent=2, sort_keys=True).encode())


def record_death(
    run_dir: Path, rank: int, world_size: int, error: str, bundle: str | None = None
) -> None:
    """Write this rank's death record (see the module docstring) and log it; never raises.

    ``bundle``: the rank's latest saved bundle (``<dir>/<stem>``), if any.
    """
    from flodl.checkpoint import write_death_record

    where = Path(bundle) if bundle is not None else None
    directory, stem = (where.parent, where.name) if where is not None else (run_dir, DEATH_STEM)
    try:
        path = write_death_record(directory, stem, rank=rank, world_size=world_size, error=error)
        log.error("rank %d: %s (death record: %s)", rank, error, path)
    except (OSError, CheckpointError) as err:
        log.error("rank %d: %s (could not write the death record: %s)", rank, error, err)


def tensors_sha256(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 over the raw bytes of ``tensors`` in order (equal iff bitwise equal)."""
    import torch

    digest = hashlib.sha256()
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
