"""Resume helpers: fit a saved ElChe to the world size of the resumed run (pure).

The function lives in :mod:`flodl.core.elche` so the coordinator core can use it; it is
re-exported here beside the rest of the checkpoint API.
"""

from __future__ import annotations

from flodl.core.elche import elche_for_world

__all__ = ["elche_for_world"]
