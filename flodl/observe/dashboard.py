"""The live web dashboard (placeholder until it is written: refuses to start)."""

from __future__ import annotations

import trio

from flodl.errors import ConfigError
from flodl.observe.hub import Observer

__all__ = ["serve"]


async def serve(
    observer: Observer,
    host: str,
    port: int,
    token: str | None,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the dashboard on ``host:port`` until cancelled; started with its URL."""
    raise ConfigError("the dashboard is not available yet")
