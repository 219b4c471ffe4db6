"""``flodl report --tensorboard DIR``: the event log as TensorBoard scalars (placeholder)."""

from __future__ import annotations

from pathlib import Path

from flodl.errors import ConfigError

__all__ = ["export_tensorboard"]


def export_tensorboard(run_dir: Path, out_dir: Path) -> int:
    """Write ``run_dir``'s event log to ``out_dir`` as TensorBoard scalars; return how many."""
    raise ConfigError("flodl report --tensorboard is not available yet")
