"""When ranks average: the one setting both protocol ends read."""

from __future__ import annotations

import enum


class Policy(enum.Enum):
    """When ranks average: every step (SYNC), on ElChe's cadence (CADENCE), or loosely (ASYNC)."""

    SYNC = "sync"
    CADENCE = "cadence"
    ASYNC = "async"
