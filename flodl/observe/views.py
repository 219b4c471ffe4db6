"""Which views a run shows, and starting them beside the coordinator.

:class:`ViewConfig` is what ``flodl run`` and ``flodl coordinator`` were asked to show;
:func:`run_views` starts them in the caller's nursery: the terminal output
(:mod:`flodl.observe.terminal`: a live table on a terminal, plain lines otherwise) and the web
dashboard (:mod:`flodl.observe.dashboard`) when one was asked for. Each is imported only
when it is used, so a run that shows nothing extra never imports rich or hypercorn.
"""

from __future__ import annotations

import trio

from flodl.observe.hub import Observer
from flodl.observe.view_config import ViewConfig

__all__ = ["run_views"]


async def run_views(
    observer: Observer,
    views: ViewConfig,
    *,
    task_status: trio.TaskStatus[str | None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the views ``views`` asks for until cancelled; started (``nursery.start``) once the
    dashboard listens, with its URL (None without a dashboard)."""
    from flodl.observe.terminal import show

    async with trio.open_nursery() as nursery:
        await nursery.start(show, observer, views)
        url = None
        if views.dashboard is not None:
            from flodl.observe.dashboard import serve

            host, port = views.dashboard
            url = await nursery.start(serve, observer, host, port, views.token())
        task_status.started(url)
