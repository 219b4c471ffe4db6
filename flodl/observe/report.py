"""``flodl report RUN_DIR``: plots of a run's event log in RUN_DIR/report/index.html
(placeholder until it is written)."""

from __future__ import annotations

from pathlib import Path

from flodl.errors import ConfigError

__all__ = ["write_report"]


def write_report(run_dir: Path) -> Path:
    """Write ``run_dir/report/index.html`` and its plots; return the page's path."""
    raise ConfigError("flodl report is not available yet")
