"""Files a rank leaves in its run directory: the exit report and the death record.

* ``rank<N>.json``: written at exit, read by the launcher into ``summary.json``:
  ``{rank, steps, batches, syncs, idle_s, wall_s, final_metrics, exit_reason, ...}``.
* ``rank<N>.death.json``: written when the rank gives up on its coordinator:
  ``{rank, world_size, error, unix_time_secs}``.

Both are written atomically (temporary file, then rename), so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def report_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank{rank}.json"


def death_record_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank{rank}.death.json"


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
    """Write ``data`` to ``path`` as JSON; readers see the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_jsonable(data), indent=2, sort_keys=True))
    os.replace(tmp, path)


def write_death_record(run_dir: Path, rank: int, world_size: int, error: str) -> Path:
    """Write ``rank<N>.death.json`` and return its path."""
    path = death_record_path(run_dir, rank)
    write_json_atomic(
        path,
        {
            "rank": rank,
            "world_size": world_size,
            "error": error,
            "unix_time_secs": time.time(),
        },
    )
    return path


def tensors_sha256(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 over the raw bytes of ``tensors`` in order (equal iff bitwise equal)."""
    import torch

    digest = hashlib.sha256()
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).contiguous().cpu()
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
